# make run: install if needed, then decompose the default toy (TMS 5-2) on CPU.
# make test: install if needed (with the deviceless GPU compile plugin), then the whole test
# suite (slow tiers included) on Python 3.12 with jax 0.11 (constraints.txt), the versions
# the GPU jobs run, then the fast tier on Python 3.11 with jax 0.10 (constraints-jax010.txt).
PY_VERSION ?= 3.12
CONSTRAINTS ?= constraints.txt
PYTHON ?= $(shell scripts/find_python.sh $(PY_VERSION))
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CUDA compile plugin for deviceless GPU gates (gate.target=h100|h200|b200), at jaxlib's
# version, kept out of site-packages so CPU runs never load it (pdecomp/hardware.py).
GPU_COMPILE := $(VENV)/gpu-compile
GPU_STAMP := $(GPU_COMPILE)/.installed

.PHONY: install install-gpu-compile run test test-fast test-jax010 bench lint clean

# A venv of another Python (an older checkout's) is made anew rather than upgraded in place.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PY) -c "import sys; sys.exit(not sys.version.startswith('$(PY_VERSION).'))" 2>/dev/null \
		|| { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
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
	$(MAKE) test-jax010

test-fast: install install-gpu-compile
	$(PY) -m pytest -q -m "not slow"

# The oldest supported versions, Python 3.11 with jax 0.10 (XLA's dump format and buffer
# assignment differ from 0.11's), in a venv of their own: the fast tier.
JAX010 := PY_VERSION=3.11 CONSTRAINTS=constraints-jax010.txt VENV=.venv-jax010
test-jax010:
	$(MAKE) install install-gpu-compile $(JAX010)
	.venv-jax010/bin/python -m pytest -q -m "not slow"

bench: install install-gpu-compile
	$(PY) bench/bench_tms.py
	$(PY) bench/bench_gate.py
	$(PY) bench/bench_llama_gate.py

lint: install
	$(VENV)/bin/ruff check pdecomp launcher tests bench

clean:
	rm -rf outputs multirun .pytest_cache
