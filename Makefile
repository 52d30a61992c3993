# salusd: `make demo` and `make test` work from a clean clone (Python 3.11, pip, no GPU).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch; pyproject keeps the open range torch>=2.5 for users.
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench sim clean gpu-wheels k8s-stubs

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m salus.demo

# The daemon tests mostly wait on processes: three workers, each test file on one of them (its
# module-scoped daemon started once), keep two cores busy. The suite starts several hundred
# Pythons that import salusd (daemons, zygotes, clients, CLI runs); compileall first writes the
# bytecode of the repo's code once (only what changed), so that none of them compiles it again
# where PYTHONDONTWRITEBYTECODE keeps them from writing it themselves.
test: $(STAMP)
	$(PY) -m compileall -q -j 0 salusd adapters scheduler bench tests
	$(PY) -m pytest -n 3 --dist loadfile

# The house rules: ruff over everything, mypy over the package code (.ci/run: after `make test`).
# mypy reads the code by the names it is imported as (`salus.daemon`, ...): from a tree of links
# so named (pyproject's package-dir), since it cannot see the editable install's import hook and
# would take every import of another module as Any.
MYPY_TREE := build/mypy
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	rm -rf $(MYPY_TREE)
	$(PY) -c 'import os, tomllib; dirs = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]["package-dir"]; [os.makedirs(os.path.join("$(MYPY_TREE)", *name.split(".")[:-1]), exist_ok=True) or os.symlink(os.path.abspath(d), os.path.join("$(MYPY_TREE)", *name.split("."))) for name, d in dirs.items()]'
	cd $(MYPY_TREE) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml \
		--namespace-packages --explicit-package-bases -p salus

sim: $(STAMP)
	$(PY) -m salus.scheduler.sim --trace tests/data/tiresias-60job.csv --format tiresias --compare

# The cp312 manylinux x86_64 wheels the lent GPU machine (Python 3.12, torch, cupy, nvidia-ml-py,
# prometheus-client, httpx and pytest installed; no network) lacks, into .whl/ (about 4 MB): the
# REST stack with the strict runtime deps that torch, httpx and pytest do not bring (fastapi
# imports opentelemetry-api at import time, which needs only typing-extensions; uvicorn needs
# click; the machine's typing-extensions is too old for pydantic), and what the kit's cuda_tests
# step needs beside pytest (pytest-timeout, hypothesis). --no-deps keeps the set exact, and
# `install.py --check` fails if a wheel needs a distribution neither .whl/ nor the machine has;
# bench/gpu/install.py installs only those the machine lacks or has older (docs/gpu.md).
GPU_WHEELS := fastapi starlette uvicorn click pydantic pydantic-core annotated-types \
	annotated-doc typing-inspection typing-extensions opentelemetry-api \
	pytest-timeout hypothesis sortedcontainers
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform any

gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download --quiet --no-deps --dest .whl --only-binary=:all: \
		--implementation cp --python-version 3.12 $(GPU_PLATFORMS) $(GPU_WHEELS)
	$(PYTHON) bench/gpu/install.py --check
	du -sh .whl

# The Python modules of the kubelet APIs the device plugin speaks (salusd/k8s/third_party/*.proto),
# committed beside them (salusd/k8s/third_party/README.md). The protos are compiled as
# salus/daemon/k8s/third_party/<name>.proto so the gRPC modules import their messages by package
# name; a newer grpcio-tools raises the grpcio and protobuf floors of the `k8s` extra in
# pyproject.toml to the versions its output names.
GRPC_TOOLS ?= grpcio-tools==1.85.1
K8S_API := salusd/k8s/third_party

k8s-stubs: $(PY)
	$(PY) -m pip install --quiet "$(GRPC_TOOLS)"
	rm -rf build/k8s-stubs && mkdir -p build/k8s-stubs
	$(PY) -m grpc_tools.protoc --proto_path=salus/daemon/k8s/third_party=$(K8S_API) \
		--python_out=build/k8s-stubs --pyi_out=build/k8s-stubs --grpc_python_out=build/k8s-stubs \
		$(K8S_API)/deviceplugin.proto $(K8S_API)/podresources.proto
	cp build/k8s-stubs/salus/daemon/k8s/third_party/*_pb2*.py* $(K8S_API)/

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
