# salusd: `make demo` and `make test` work from a clean clone (Python 3.11, pip, no GPU).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; pyproject keeps the open range torch>=2.5 for users.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench sim clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m salus.demo

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy salusd scheduler adapters

sim: $(STAMP)
	$(PY) -m salus.scheduler.sim --trace tests/data/tiresias-60job.csv --format tiresias --compare

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
