# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

DEMO := configs/embedded.yaml

demo: $(STAMP)
	$(VENV)/bin/dflashkit doctor --check
	$(VENV)/bin/dflashkit prepare -c $(DEMO)
	$(VENV)/bin/dflashkit train -c $(DEMO) --move-aside
	$(VENV)/bin/dflashkit eval -c $(DEMO) --prompts validation --check-lossless

test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
