# The two commands of the README: `make run` (a local cluster on the default model) and
# `make test` (the whole suite, with fmt and clippy). Both do their own set-up.
SHELL := /bin/bash
MODEL := models/smollm2-135m-instruct-q4_1.gguf
CARGO ?= cargo
NODES ?= 3
HTTP ?= 127.0.0.1:8080

.PHONY: run test deps model build lint venv nvrtc

deps:
	@scripts/deps.sh

model: $(MODEL)

$(MODEL):
	@scripts/fetch-model.sh

build: deps model
	$(CARGO) build --release

run: build
	@echo "flotilla: $${CARGO_TARGET_DIR:-target}/release/flotilla (not on PATH: cargo install --path . puts it there)"
	@$${CARGO_TARGET_DIR:-target}/release/flotilla up --chaos --nodes $(NODES) --http $(HTTP) --model $(MODEL)

# The official OpenAI and Anthropic Python clients, for the client-compatibility tests;
# kubernetes-validate (the Kubernetes API schemas, offline), for the manifests in deploy/k8s.
OPENAI_VERSION := 3.57.0
ANTHROPIC_VERSION := 2.17.0
KUBERNETES_VALIDATE_VERSION := 1.37.0
VENV_MARKER := .venv/.openai-$(OPENAI_VERSION)-anthropic-$(ANTHROPIC_VERSION)-kv-$(KUBERNETES_VALIDATE_VERSION)
venv: $(VENV_MARKER)

$(VENV_MARKER):
	python3 -m venv .venv
	.venv/bin/pip install --quiet openai==$(OPENAI_VERSION) \
		anthropic==$(ANTHROPIC_VERSION) \
		kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION)
	touch $@

# NVRTC (no GPU needed) so that the tests compile the CUDA kernels to PTX: fetched once from
# the nvidia-cuda-nvrtc-cu12 wheel, cached in ~/.cache/flotilla (scripts/fetch-nvrtc.sh).
nvrtc:
	@scripts/fetch-nvrtc.sh >/dev/null

# The second clippy is the build without the `cuda` feature (no CUDA code at all), with the
# features deploy/Dockerfile builds the binary with: it must stay green too.
lint: deps
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) clippy --no-default-features --features kubernetes --lib --bins -- -D warnings

test: deps model venv nvrtc lint
	@export LD_LIBRARY_PATH="$$(scripts/fetch-nvrtc.sh)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}" \
		FLOTILLA_REQUIRE_NVRTC=1 FLOTILLA_REQUIRE_CHROMIUM=1; \
	if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(CARGO) nextest run --no-fail-fast; \
	else \
		$(CARGO) test --no-fail-fast; \
	fi
