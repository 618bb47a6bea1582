# make run: install if needed, then decompose the default toy (TMS 5-2) on CPU.
# make test: install if needed, then the whole test suite (slow tiers included).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast bench lint clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/pdecomp $(ARGS)

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(PY) bench/bench_tms.py

lint: install
	$(VENV)/bin/ruff check pdecomp launcher tests bench

clean:
	rm -rf outputs multirun .pytest_cache
