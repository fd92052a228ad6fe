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
# The image the chart installs by default (values.yaml image.repository), tagged VERSION.
IMAGE ?= $(shell awk '$$1 == "repository:" {print $$2; exit}' $(CHART)/values.yaml):$(VERSION)
# A container engine for make image: docker, else podman, else buildah.
ENGINE ?= $(shell command -v docker || command -v podman || command -v buildah)
DIST ?= dist
ACTIONLINT ?= $(CACHE)/bin/actionlint-$(shell awk '$$1 == "require" && $$2 == "github.com/rhysd/actionlint" {print $$3}' tests/rig/lint/go.mod)

.PHONY: help test demo provision rig-up rig-down lint build crds bench image chart-package release-check docs

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

lint: ## rustfmt, clippy (warnings are errors), the committed CRD matches the code, helm lint, actionlint
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets --locked -- -D warnings
	@tmp=$$(mktemp) && trap 'rm -f "$$tmp"' EXIT && \
	  for kind in OutboxRelay OutboxReplay; do \
	    file=crds/$$(echo $$kind | tr A-Z a-z).yaml; \
	    $(CARGO) run --quiet --locked -- crd --kind $$kind > "$$tmp" && \
	    if ! diff -u $$file "$$tmp"; then \
	      echo "$$file is out of date with src/api: run make crds" >&2; exit 1; \
	    fi; \
	  done
	@diff -r crds $(CHART)/crds || { echo "$(CHART)/crds differs from crds/: run make crds" >&2; exit 1; }
	@test -x $(HELM) || { echo "$(HELM) is missing: run make provision" >&2; exit 1; }
	$(HELM) lint --strict $(CHART)
	@test -x $(ACTIONLINT) || { echo "$(ACTIONLINT) is missing: run make provision" >&2; exit 1; }
	$(ACTIONLINT) .github/workflows/*.yml

docs: provision ## build the documentation book (docs/) into $(CACHE)/docs-book
	$(CACHE)/bin/mdbook-$(shell awk -F= '/^MDBOOK_VERSION=/ {print $$2}' tests/rig/lib.sh) build docs --dest-dir $(CACHE)/docs-book
	@echo "open $(CACHE)/docs-book/index.html"

crds: ## regenerate crds/ and the chart's copy from the Rust types (commit the result)
	$(CARGO) run --quiet --locked -- crd --kind OutboxRelay > crds/outboxrelay.yaml
	$(CARGO) run --quiet --locked -- crd --kind OutboxReplay > crds/outboxreplay.yaml
	cp crds/outboxrelay.yaml crds/outboxreplay.yaml $(CHART)/crds/

bench: provision ## benchmark on a fresh rig: relay throughput and latency, operator scale (~24 min); results in $(CACHE)/bench/
	@mkdir -p $(CACHE)/bench && rm -f $(CACHE)/bench/results.md $(CACHE)/bench/results.json
	set -o pipefail; OUTBOX_BENCH_DIR=$(CACHE)/bench OUTBOX_RIG_NODE=0 tests/rig/with-rig.sh \
	  $(CARGO) bench --locked --benches 2>&1 | tee $(CACHE)/bench/bench.log
	@echo; cat $(CACHE)/bench/results.md

build: ## build the binary
	$(CARGO) build --release --locked

image: ## build the image the chart installs (IMAGE=...; docker, podman or buildah), from this checkout
	@test -n "$(ENGINE)" || { echo "make image needs docker, podman or buildah" >&2; exit 1; }
	$(ENGINE) build -t $(IMAGE) --build-arg VERSION=$(VERSION) \
	  --build-arg REVISION=$$(git rev-parse HEAD) --build-arg CREATED=$$(date -u +%FT%TZ) .

chart-package: ## package the Helm chart for VERSION into $(DIST)/ (the release workflow's step)
	@mkdir -p $(DIST)
	$(HELM) package $(CHART) --version $(VERSION) --app-version $(VERSION) -d $(DIST)

release-check: ## a release tag (TAG=v1.2.3) names the version of Cargo.toml and the chart
	@test -n "$(TAG)" || { echo "release-check: set TAG=v<version>" >&2; exit 1; }
	@chart=$$(awk -F'"' '/^appVersion:/ {print $$2}' $(CHART)/Chart.yaml); \
	  [ "$(TAG)" = "v$(VERSION)" ] || { echo "tag $(TAG) is not v$(VERSION), the version in Cargo.toml" >&2; exit 1; }; \
	  [ "$$chart" = "$(VERSION)" ] || { echo "the chart's appVersion $$chart is not $(VERSION), the version in Cargo.toml" >&2; exit 1; }; \
	  grep -q "^## \[$(VERSION)\]" docs/changelog.md || { echo "docs/changelog.md has no section ## [$(VERSION)]" >&2; exit 1; }; \
	  echo "release $(TAG): Cargo.toml, the chart's appVersion and docs/changelog.md agree"
