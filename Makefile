# Two set-up-free entry points: `make demo` (main job) and `make test`.
# Each creates .venv from a Python 3.10 (PATH or pyenv) when it is missing.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench env clean-env

demo: $(STAMP)
	$(PY) recipes/synthesize.py

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) recipes/benchmark.py

env: $(STAMP)

$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x $(PY) ]; then \
	  PY310=$$(command -v python3.10 || true); \
	  if [ -z "$$PY310" ] && command -v pyenv >/dev/null; then \
	    PY310=$$(ls -d "$$(pyenv root)"/versions/3.10.*/bin/python 2>/dev/null | tail -n 1); fi; \
	  if [ -z "$$PY310" ]; then \
	    PY310=$$(ls -d "$$HOME"/.pyenv/versions/3.10.*/bin/python 2>/dev/null | tail -n 1); fi; \
	  if [ -z "$$PY310" ]; then echo "error: Python 3.10 not found (fairseq, pulled by spear-tts, needs <3.11)" >&2; exit 1; fi; \
	  echo "creating $(VENV) with $$PY310"; \
	  "$$PY310" -m venv $(VENV); \
	fi; \
	$(PY) -m pip install -q "pip<24.1"; \
	$(PY) -m pip install -q -e ".[test]"; \
	touch $(STAMP)

clean-env:
	rm -rf $(VENV)
