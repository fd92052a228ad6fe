# outbox-operator: the commands a user and CI run. `make help` lists them.

SHELL := /bin/bash
CACHE ?= $(HOME)/.cache/outbox-operator
# A fixed target folder outside the checkout, so a fresh clone (CI) reuses the build.
export CARGO_TARGET_DIR ?= $(CACHE)/target
export PATH := $(HOME)/.cargo/bin:/usr/local/go/bin:$(PATH)
CARGO ?= cargo
CHART := charts/outbox-operator
# The rig builds helm from source (no registry ships a Linux binary); see tests/rig/helm.
HELM ?= $(CACHE)/bin/helm-$(shell awk '$$1 == "require" && $$2 == "helm.sh/helm/v4" {print $$3}' tests/rig/helm/go.mod)

VERSION := $(shell awk -F'"' '/^version = / {print $$2; exit}' Cargo.toml)

.PHONY: help test demo provision rig-up rig-down lint build crds bench image chart-package

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

test: provision lint ## provision the rig, lint, start every server, run all tests, stop the servers
	$(CARGO) build --all-targets --locked
	CARGO=$(CARGO) tests/rig/with-rig.sh tests/rig/test-all.sh

demo: provision ## the operator end to end on a rig of its own, until Ctrl-C (DEMO_ARGS="--duration 2m")
	tests/rig/demo.sh $(DEMO_ARGS)

provision: ## install or build every server the tests need (cached under $(CACHE))
	tests/rig/provision.sh

rig-up: provision ## start the rig and leave it running (then: export OUTBOX_RIG_ENV=.rig/rig.env)
	tests/rig/up.sh

rig-down: ## stop a rig started with make rig-up
	tests/rig/down.sh

lint: ## rustfmt, clippy (warnings are errors) and the committed CRD matches the code
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets --locked -- -D warnings
	@tmp=$$(mktemp) && trap 'rm -f "$$tmp"' EXIT && \
	  $(CARGO) run --quiet --locked -- crd > "$$tmp" && \
	  if ! diff -u crds/outboxrelay.yaml "$$tmp"; then \
	    echo "crds/outboxrelay.yaml is out of date with src/api: run make crds" >&2; exit 1; \
	  fi
	@diff -r crds $(CHART)/crds || { echo "$(CHART)/crds differs from crds/: run make crds" >&2; exit 1; }
	@test -x $(HELM) || { echo "$(HELM) is missing: run make provision" >&2; exit 1; }
	$(HELM) lint --strict $(CHART)

crds: ## regenerate crds/ and the chart's copy from the Rust types (commit the result)
	$(CARGO) run --quiet --locked -- crd > crds/outboxrelay.yaml
	cp crds/outboxrelay.yaml $(CHART)/crds/outboxrelay.yaml

bench: provision ## benchmark on a fresh rig: relay throughput and latency, operator scale (~24 min); results in $(CACHE)/bench/
	@mkdir -p $(CACHE)/bench && rm -f $(CACHE)/bench/results.md $(CACHE)/bench/results.json
	set -o pipefail; OUTBOX_BENCH_DIR=$(CACHE)/bench OUTBOX_RIG_NODE=0 tests/rig/with-rig.sh \
	  $(CARGO) bench --locked --benches 2>&1 | tee $(CACHE)/bench/bench.log
	@echo; cat $(CACHE)/bench/results.md

build: ## build the binary
	$(CARGO) build --release --locked

image: ## build the container image (needs a container engine; CI builds the same binary with make build)
	docker build -t ghcr.io/outbox-operator/outbox-operator:$(VERSION) \
	  --build-arg REVISION=$$(git rev-parse HEAD) --build-arg CREATED=$$(date -u +%FT%TZ) .

chart-package: ## package the Helm chart into dist/
	$(HELM) package $(CHART) -d dist/
