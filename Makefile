# salusd: `make demo` and `make test` work from a clean clone (Python 3.11, pip, no GPU).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; pyproject keeps the open range torch>=2.5 for users.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench sim clean gpu-wheels

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

# Wheels of the runtime deps the lent GPU machine (Python 3.12, no network) may lack, for
# linux x86_64, into .whl/; bench/gpu/run.sh installs only those its Python has not, with
# --target (docs/gpu.md). fastapi imports opentelemetry-api at import time.
GPU_WHEELS := fastapi starlette uvicorn pydantic pydantic-core annotated-types \
	typing-inspection typing-extensions opentelemetry-api importlib-metadata zipp \
	anyio sniffio idna h11 click prometheus-client \
	cloudpickle safetensors fsspec rich markdown-it-py mdurl pygments httpx httpcore certifi \
	hypothesis sortedcontainers attrs networkx pytest-timeout
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform any

gpu-wheels:
	$(PYTHON) -m pip download --quiet --dest .whl --only-binary=:all: \
		--implementation cp --python-version 3.12 $(GPU_PLATFORMS) $(GPU_WHEELS)
	du -sh .whl

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
