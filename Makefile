# make run: install if needed, then decompose the default toy (TMS 5-2) on CPU.
# make test: install if needed (with the deviceless GPU compile plugin), then the whole test
# suite (slow tiers included).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CUDA compile plugin for deviceless GPU gates (gate.target=h100|h200|b200), at jaxlib's
# version, kept out of site-packages so CPU runs never load it (pdecomp/hardware.py).
GPU_COMPILE := $(VENV)/gpu-compile
GPU_STAMP := $(GPU_COMPILE)/.installed

.PHONY: install install-gpu-compile run test test-fast bench lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

$(GPU_STAMP): $(STAMP)
	v=$$($(PY) -c "import jaxlib; print(jaxlib.__version__)") && \
	$(PY) -m pip install -q --no-deps --upgrade --target $(GPU_COMPILE) \
		"jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v"
	touch $(GPU_STAMP)

install-gpu-compile: $(GPU_STAMP)

run: install
	$(VENV)/bin/pdecomp $(ARGS)

test: install install-gpu-compile
	$(PY) -m pytest -q

test-fast: install install-gpu-compile
	$(PY) -m pytest -q -m "not slow"

bench: install install-gpu-compile
	$(PY) bench/bench_tms.py
	$(PY) bench/bench_gate.py
	$(PY) bench/bench_llama_gate.py

lint: install
	$(VENV)/bin/ruff check pdecomp launcher tests bench

clean:
	rm -rf outputs multirun .pytest_cache
