# Developer entry points. `make demo` and `make test` are the README's quick start; both set
# up everything they need from scratch (virtual environment, Kubernetes test binaries).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# One venv, two stamps: `make demo` installs only what `gpupart simulate` and `gpupart plan`
# import (gpupart itself and PyYAML, docs/adr-017-demo-installs-what-it-runs.md); lint and test
# add the components' dependencies and the pinned test tools on top.
DEMO_STAMP := $(VENV)/.demo-stamp
STAMP := $(VENV)/.installed-stamp
PIP := $(BIN)/python -P -m pip --disable-pip-version-check -q

.PHONY: demo test lint unit k8s-bins typecheck-tree clean cluster cluster-down

# `python -P`: never put the checkout on sys.path, where the directory operator/ would shadow
# the standard library's operator module in a fresh interpreter.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -P -m venv $(VENV)
	$(PIP) install --no-deps -e . 'pyyaml>=6.0'
	touch $@

# tests/support is its own small package (gpupart_testsupport), kept out of the gpupart wheel.
$(STAMP): $(DEMO_STAMP) tests/support/pyproject.toml
	$(PIP) install -e '.[test]' -e tests/support
	touch $@

## demo: set up (gpupart alone, about 20 s) and run `gpupart simulate` on its built-in example
demo: $(DEMO_STAMP)
	$(BIN)/gpupart simulate

## lint: ruff (check and format), mypy --strict, import contracts
lint: $(STAMP) typecheck-tree
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cd build/typecheck && ../../$(BIN)/mypy --config-file ../../pyproject.toml
	$(BIN)/lint-imports

# mypy finds modules by their import names; link each package under that name and run mypy
# from there, where no directory named operator/ shadows the standard library's module.
typecheck-tree:
	mkdir -p build/typecheck
	ln -sfn ../../gpupart build/typecheck/gpupart
	ln -sfn ../../operator build/typecheck/gpupart_operator
	ln -sfn ../../plugin build/typecheck/gpupart_plugin
	ln -sfn ../../extender build/typecheck/gpupart_extender

## k8s-bins: build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kwok and
## the test programs (cached by version; ~35 min the first time on 2 cores), fetch kubectl, helm
k8s-bins: $(STAMP)
	scripts/build-k8s-bins.sh

## test: everything CI runs: lint, unit, integration and e2e tests against a real control plane
test: lint k8s-bins
	GPUPART_K8S_BIN="$$(scripts/build-k8s-bins.sh --print-dir)" $(BIN)/pytest

## cluster: a local playground (control plane, two real-kubelet nodes with simulated GPUs, gpupart);
## it checks that this machine can run it (root, mount namespaces) before building anything
cluster: $(STAMP)
	$(BIN)/python -P scripts/cluster.py check
	scripts/build-k8s-bins.sh
	$(BIN)/python -P scripts/cluster.py up

cluster-down:
	$(BIN)/python -P scripts/cluster.py down

unit: $(STAMP)
	$(BIN)/pytest tests/core tests/sim tests/adapters

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
