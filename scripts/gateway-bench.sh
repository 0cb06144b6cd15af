#!/usr/bin/env bash
# Gateway throughput, several flotilla builds (and NVIDIA Dynamo's frontend) side by side in
# one run.
#
#   scripts/gateway-bench.sh BIN [BIN ...]
#   BENCH_ARGS="--stream --max-tokens 64 --fresh-connections" DYNAMO=1 scripts/gateway-bench.sh BIN
#   GATEWAYS=1,2,4 scripts/gateway-bench.sh BIN     # 1, 2 and 4 gateway + router nodes
#
# For each binary: start `BIN up` with sim engines (3 nodes: a gateway + router node and two
# worker nodes with 2 replicas each, `worker.sim_speedup=1000` so the engine costs next to
# nothing), wait for /health, run `examples/gateway_bench.rs` at concurrency 32 and 128, stop
# the cluster. The first binary is the baseline; the figures of the others follow it.
# With GATEWAYS=N1,N2,… each binary runs once per count: `up --gateways N` (the gateway
# nodes on consecutive ports) and the bench's clients spread over them (client i on gateway
# i mod N). Environment: SECONDS_PER_POINT (default 10), CONCURRENCY (default 32,128), PORT (18080),
# BENCH_ARGS (more flags for examples/gateway_bench.rs: --stream, --max-tokens, --prompt-tokens,
# --fresh-connections), DYNAMO=1 (then the same bench against Dynamo 1.6.1's frontend over 4
# mocker workers at the same speed-up, scripts/peers/dynamo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 BIN [BIN ...]" >&2; exit 2; }
PORT=${PORT:-18080}
GATEWAYS_SET=${GATEWAYS:-}; GATEWAYS=${GATEWAYS:-1}
MODEL=${FLOTILLA_MODEL:-models/smollm2-135m-instruct-q4_1.gguf}
cargo build --example gateway_bench >/dev/null 2>&1 || cargo build --example gateway_bench
BENCH=${CARGO_TARGET_DIR:-target}/debug/examples/gateway_bench
for bin in "$@"; do
  for n in ${GATEWAYS//,/ }; do
    echo "== $bin${GATEWAYS_SET:+ ($n gateways)}"
    "$bin" up --engine sim --nodes 3 --workers 4 --gateways "$n" --http "127.0.0.1:$PORT" \
      --model "$MODEL" --set worker.sim_speedup=1000 >/tmp/gateway-bench-up.log 2>&1 &
    up=$!
    urls=
    for ((k = 0; k < n; k++)); do
      g="127.0.0.1:$((PORT + k))"
      for _ in $(seq 1 120); do
        curl -fs "http://$g/health" >/dev/null 2>&1 && break
        sleep 0.5
      done
      curl -fs "http://$g/health" >/dev/null || { cat /tmp/gateway-bench-up.log; kill $up; exit 1; }
      urls+="${urls:+,}http://$g"
    done
    "$BENCH" --gateway "$urls" --concurrency "${CONCURRENCY:-32,128}" \
      --seconds "${SECONDS_PER_POINT:-10}" --warmup 2 ${BENCH_ARGS:-}
    kill -INT $up; wait $up || true
  done
done
if [ "${DYNAMO:-0}" = 1 ]; then
  echo "== NVIDIA Dynamo 1.6.1 (frontend, --router-mode kv, 4 mocker workers)"
  DPORT=$((PORT + 10))
  trap 'scripts/peers/dynamo.sh stop' EXIT
  scripts/peers/dynamo.sh start kv "$DPORT" 4 --block-size 16 --speedup-ratio 1000 >/dev/null
  sleep 8
  "$BENCH" --gateway "http://127.0.0.1:$DPORT" --model smollm2 --concurrency "${CONCURRENCY:-32,128}" \
    --seconds "${SECONDS_PER_POINT:-10}" --warmup 2 ${BENCH_ARGS:-}
  scripts/peers/dynamo.sh stop
fi
