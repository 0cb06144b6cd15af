#!/usr/bin/env bash
# Gateway throughput on 1-token requests, several flotilla builds side by side in one run.
#
#   scripts/gateway-bench.sh BIN [BIN ...]
#
# For each binary: start `BIN up` with sim engines (3 nodes: a gateway + router node and two
# worker nodes with 2 replicas each, `worker.sim_speedup=1000` so the engine costs next to
# nothing), wait for /health, run `examples/gateway_bench.rs` at concurrency 32 and 128, stop
# the cluster. The first binary is the baseline; the figures of the others follow it.
# Environment: SECONDS_PER_POINT (default 10), CONCURRENCY (default 32,128), PORT (18080).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 BIN [BIN ...]" >&2; exit 2; }
PORT=${PORT:-18080}
MODEL=${FLOTILLA_MODEL:-models/smollm2-135m-instruct-q4_1.gguf}
cargo build --example gateway_bench >/dev/null 2>&1 || cargo build --example gateway_bench
BENCH=${CARGO_TARGET_DIR:-target}/debug/examples/gateway_bench
for bin in "$@"; do
  echo "== $bin"
  "$bin" up --engine sim --nodes 3 --workers 4 --http "127.0.0.1:$PORT" --model "$MODEL" \
    --set worker.sim_speedup=1000 >/tmp/gateway-bench-up.log 2>&1 &
  up=$!
  for _ in $(seq 1 120); do
    curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    sleep 0.5
  done
  curl -fs "http://127.0.0.1:$PORT/health" >/dev/null || { cat /tmp/gateway-bench-up.log; kill $up; exit 1; }
  "$BENCH" --gateway "http://127.0.0.1:$PORT" --concurrency "${CONCURRENCY:-32,128}" \
    --seconds "${SECONDS_PER_POINT:-10}" --warmup 2
  kill -INT $up; wait $up || true
done
