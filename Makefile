# Two set-up-free entry points: `make demo` (main job) and `make test`.
# Each creates .venv from a Python 3.10 (PATH or pyenv) when it is missing.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench gpu-check env clean-env

demo: $(STAMP)
	$(PY) recipes/synthesize.py

# two processes: most tests run one thread's work (tiny models), and the suite takes half the time
test: $(STAMP)
	$(PY) -m pytest -n 2

bench: $(STAMP)
	$(PY) recipes/benchmark.py

# on a machine with a CUDA GPU (this checkout's .venv, else python3: an offline image after
# `source .gpu/setup.sh`): benchmarks with and without compile, the CUDA tests, under a time budget
# (docs/gpu.md, "make gpu-check"); writes benchmarks/gpu_<device>.json; CACHE_OUT=DIR: also packs
# torch.compile's cache into DIR/compile-cache.tar.gz for the next loan (tools/compile_cache.py)
gpu-check:
	$(if $(wildcard $(PY)),$(PY),python3) tools/gpu_check.py $(if $(CACHE_OUT),--cache-out $(CACHE_OUT))

env: $(STAMP)

$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x $(PY) ]; then \
	  PY310=$$(tools/find_python310.sh); \
	  echo "creating $(VENV) with $$PY310"; \
	  "$$PY310" -m venv $(VENV); \
	fi; \
	$(PY) -m pip install -q "pip<24.1"; \
	$(PY) -m pip install -q -e ".[test]"; \
	touch $(STAMP)

clean-env:
	rm -rf $(VENV)
