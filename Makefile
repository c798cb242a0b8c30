# kvfleet — the command contract these targets keep is listed in README.md (Quick start).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PACKAGES := kernel/kvfleet_kernel operator/kvfleet_operator gateway/kvfleet_gateway cli/kvfleet_cli sim/kvfleet_sim localcluster/kvfleet_localcluster bench/kvfleet_bench

.PHONY: help setup test lint unit integration demo bench crds docs clean controlplane sglang
.DEFAULT_GOAL := help

help:  ## this list of targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z]+):[^#]*## /\1\t/' \
		| awk -F'\t' '{printf "  make %-12s %s\n", $$1, $$2}'

# uv resolves and installs the dev extras in seconds where pip takes minutes (the venv is the
# same: `pip` still works in it); a user installing the product runs plain pip (.ci/runtime_only.py).
$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(BIN)/uv: $(BIN)/python
	$(BIN)/pip install --quiet uv

$(VENV)/.installed: $(BIN)/uv pyproject.toml
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev]'
	touch $@

setup: $(VENV)/.installed  ## .venv + editable install with dev extras (idempotent)

lint: setup  ## ruff, mypy --strict, import-linter
	$(BIN)/ruff check .
	$(BIN)/ruff format --check $(PACKAGES) tests
	$(BIN)/mypy $(PACKAGES)
	$(BIN)/lint-imports

test: setup  ## the whole suite (what .ci/run calls)
	@# Three stages, measured on two cores (`.ci/run` prints the whole time; it was 932 s with
	@# unit, integration and serial tests one after another).
	@# 1. The integration tests on two workers: the CPU-bound stage. Three took as long (409-463 s
	@#    against 458 s) at a load average of 8-10 instead of 3-4, where the in-cluster stories
	@#    ran twice as slow and their waits missed their limits. (One pool for unit and
	@#    integration tests was measured slower.)
	@# 2. Those with latency bounds (marked serial), in two lanes of one test at a time
	@#    (tests/conftest.py), and beside them at the lowest CPU priority (nice 19) the lint and
	@#    the unit tests: the lanes mostly wait, and a niced process takes only the CPU they
	@#    leave (the unit tests, 149 s, ran inside the lanes' 213 s). Their output follows.
	@# 3. The README's fixed host ports (marked alone), by themselves.
	$(BIN)/pytest -q -rsx -p no:cacheprovider -n 2 --dist loadgroup -m "not serial and not alone" --durations=10 tests/integration
	@log=$$(mktemp); nice -n 19 $(MAKE) --no-print-directory lint unit > $$log 2>&1 & niced=$$!; \
		$(BIN)/pytest -q -rs -p no:cacheprovider -n 2 --dist loadgroup -m serial --durations=10 tests/integration; \
		lanes=$$?; wait $$niced; niced=$$?; echo "--- lint and unit tests (niced, beside the lanes) ---"; \
		cat $$log; rm -f $$log; test $$lanes -eq 0 -a $$niced -eq 0
	$(BIN)/pytest -q -rs -p no:cacheprovider -m alone tests/integration

# SGLang's own server-argument parser, which tests/unit/test_sglang_parser.py runs on the
# rendered engine command lines and on every hand-kept table of SGLang flags: SGLang without
# its dependency tree, plus what its import chain needs (.ci/sglang-parser.txt), at the
# release the operator renders for.
SGLANG_VERSION := $(shell sed -n 's/^ENGINE_IMAGE = "lmsysorg\/sglang:v\(.*\)"/\1/p' operator/kvfleet_operator/spec.py)
sglang: setup  ## SGLang's argument parser in .venv (torch and its CUDA libraries: several GB)
	$(BIN)/uv pip install --quiet --python $(BIN)/python -r .ci/sglang-parser.txt
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps sglang==$(SGLANG_VERSION)

controlplane: setup  ## build the real Kubernetes control plane from its Go modules (cached)
	$(BIN)/kvfleet cluster build

unit: setup  ## the unit tests only (two workers: they are CPU-bound and share nothing)
	$(BIN)/pytest -q -rs -p no:cacheprovider -n 2 --durations=5 tests/unit

integration: setup  ## the integration tests only
	$(BIN)/pytest -q tests/integration

demo: setup  ## the whole stack on one machine, no GPU, no cluster
	$(BIN)/kvfleet demo

# LiteLLM, the peer `kvfleet bench gateway` also measures, in a virtualenv of its own: its
# dependency tree is large and pins its own versions. One version, declared in the bench.
LITELLM := .venv-litellm/bin/litellm
LITELLM_VERSION := $(shell sed -n 's/^LITELLM_VERSION = "\(.*\)"/\1/p' bench/kvfleet_bench/litellm_peer.py)
$(LITELLM): $(BIN)/uv bench/kvfleet_bench/litellm_peer.py
	$(PY) -m venv .venv-litellm
	$(BIN)/uv pip install --quiet --python .venv-litellm/bin/python 'litellm[proxy]==$(LITELLM_VERSION)'

bench: setup $(LITELLM)  ## all benchmarks; writes bench/results/*.md and *.png
	KVFLEET_PROPERTY_EXAMPLES=1000 $(BIN)/pytest -q -p no:cacheprovider --timeout 0 tests/unit/test_scheduler.py -k over_committed
	$(BIN)/kvfleet bench sim
	$(BIN)/kvfleet bench gateway --litellm $(LITELLM)
	$(BIN)/kvfleet bench reliability
	$(BIN)/kvfleet bench spec
	$(BIN)/kvfleet bench cluster
	$(BIN)/kvfleet bench routing
	$(BIN)/kvfleet bench pd
	$(BIN)/kvfleet bench fairness
	$(BIN)/kvfleet bench autoscale --seeds 11,12,13 \
		--trace-file bench/kvfleet_bench/data/azure-llm-2023-code-15min.csv \
		--trace-file bench/kvfleet_bench/data/azure-llm-2023-conv-15min.csv \
		--trace-file bench/kvfleet_bench/data/azure-llm-2023-conv-15min-at30m.csv \
		--trace-file bench/kvfleet_bench/data/mooncake-fast25-conversation-10min.jsonl --rate-scale 8

crds: setup  ## regenerate crds/ from the spec model, and the Helm chart's copies
	$(BIN)/kvfleet crds --out crds

docs: setup  ## regenerate the CRD and gateway-config references in docs/ from their models
	$(BIN)/kvfleet docs --out docs

clean:  ## remove .venv and caches
	rm -rf $(VENV) .venv-litellm .mypy_cache .ruff_cache .pytest_cache build *.egg-info
