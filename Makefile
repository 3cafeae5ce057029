# Everything installs into .venv in the repository root; `make test` and `make demo` set it up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# CPU build on the CI machine (a local file there); override on machines that want another build.
TORCH_SPEC ?= torch==2.13.0
# Processes for the interpreter's kernel tests (pytest-xdist): the interpreter runs a kernel's programs in Python,
# one core a process, so CI's 2 cores take 2 (765 -> 433 s there). The CPU tests stay in one process: their
# multi-process gloo tests and timed worker deaths want the cores, and torch already uses both.
TEST_WORKERS ?= 2

.PHONY: install test test-cpu test-kernels demo lint gpu-check clean

$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" 2>/dev/null; then $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else $(PYTHON) -m venv $(VENV); fi; fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

install: $(STAMP)

# The README's test command: CPU tests, then the `interp` ones (Triton kernels) under the interpreter, which
# must be in the environment before triton is imported (hence a second process).
test: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not interp"
	TRITON_INTERPRET=1 $(PY) -m pytest -q -n $(TEST_WORKERS) -m "interp and not gpu"

demo: $(STAMP)
	$(VENV)/bin/moelora demo

lint: $(STAMP)
	$(VENV)/bin/ruff check moelora tests benchmarks scripts

# On a CUDA machine: every `gpu` test and the benchmarks; logs and CSVs under $$OUT (default ./out).
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache
