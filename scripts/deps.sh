#!/usr/bin/env bash
# Check (and, as root on Debian/Ubuntu, install) what building and testing Flotilla needs.
# Rust itself (cargo, rustc, with clippy and rustfmt) must already be installed.
set -euo pipefail
# Debian packages the build and tests need; grows as features land. (The contended soak makes
# its own CPU hog: no stress-ng needed.)
# - libucx-dev: UCX, the KV transport's fast path. The binary loads libucp.so.0 at run time
#   (src/transport/ucx/sys.rs holds bindings generated from these headers), so building needs
#   neither it nor libclang; without it the transport falls back to TCP and the UCX tests skip.
# - haproxy: tests/gateways.rs runs deploy/haproxy/haproxy.cfg in front of two gateways
#   (skipped without it).
# - chromium, chromium-driver: tests/fleet_page.rs drives the live fleet page in headless
#   Chromium through chromedriver (`make test` requires them: FLOTILLA_REQUIRE_CHROMIUM=1).
pkgs=(libucx-dev haproxy chromium chromium-driver)
need=()
command -v python3 >/dev/null || need+=(python3)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing: ${need[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "error: please install: ${need[*]} (e.g. sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
fi
for tool in cargo rustc; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found; install Rust (rustup)" >&2; exit 1; }
done
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
cargo fmt --version >/dev/null 2>&1 || rustup component add rustfmt
# `make test` runs the suite with cargo-nextest when it is there (else plain `cargo test`).
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "installing cargo-nextest (cargo install --locked cargo-nextest)…" >&2
  cargo install --locked cargo-nextest
fi
