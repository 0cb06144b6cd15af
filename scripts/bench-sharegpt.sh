#!/usr/bin/env bash
# KV-aware routing on the real model, side by side with SGLang's (and optionally vLLM's)
# router, one workload, one table (docs/benchmarks.md, "KV-aware routing on the real model").
# Every run gets a fresh fleet of the embedded model on 3 CPU worker nodes (plus the gateway
# node), every replica with its own OpenAI face (worker.http) and vLLM-format KV events, so
# that every system serves through the same processes; the same multi-turn ShareGPT sessions
# (same arrivals, same salt) go through Flotilla's gateway with each of its policies, then
# through each peer router in front of the workers' faces.
#
#   scripts/bench-sharegpt.sh [BENCH_FLAGS…]       ~4 min a run on 2 cores; fetches ShareGPT
#                                                  and installs the peers on first use
#
# Environment: FLOTILLA (binary, default $CARGO_TARGET_DIR/release/flotilla, else target/…), OUT (default
# /tmp/bench-sharegpt), REQUESTS (60), RATE (sessions/s, 0.5), MAX_INPUT (1024 tokens),
# MAX_OUTPUT (48 tokens), SALT (the same for every run), POLICIES (Flotilla's, default
# round_robin,kv), ROUTERS (peer routers over the workers' faces, default sglang:cache_aware;
# vllm:kv_aware adds vLLM's router; empty: none), REPEAT (1: runs of every system, in turn),
# SETS (extra Flotilla settings, space-separated KEY=VALUE).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FLOTILLA:-${CARGO_TARGET_DIR:-target}/release/flotilla}
OUT=${OUT:-/tmp/bench-sharegpt}
REQUESTS=${REQUESTS:-60}; RATE=${RATE:-0.5}; MAX_INPUT=${MAX_INPUT:-1024}; MAX_OUTPUT=${MAX_OUTPUT:-48}
SALT=${SALT:-7340117215467402871}; POLICIES=${POLICIES:-round_robin,kv}
ROUTERS=${ROUTERS-sglang:cache_aware}; REPEAT=${REPEAT:-1}
EXTRA=(); for kv in ${SETS:-}; do EXTRA+=(--set "$kv"); done
FGW=127.0.0.1:18110; RGW=127.0.0.1:18120
WORKERS=3
mkdir -p "$OUT"
scripts/fetch-sharegpt.sh
BENCH=(--dataset sharegpt --max-requests "$REQUESTS" --arrival poisson --rate "$RATE"
       --max-input-tokens "$MAX_INPUT" --max-output-tokens "$MAX_OUTPUT" --salt "$SALT" "$@")

. scripts/lib/fleet.sh
UP=
start_fleet() {
  "$BIN" up --nodes $((WORKERS + 1)) --http "$FGW" \
    --set worker.http=127.0.0.1:0 --set worker.kv_events_addr=127.0.0.1:0 "${EXTRA[@]}" "$@" \
    > "$OUT/flotilla.up.log" 2>&1 &
  UP=$!
  wait_fleet "$FGW" "$WORKERS" "$OUT/flotilla.up.log" 180
}
trap 'stop_fleet; scripts/peers/routers.sh stop 2>/dev/null || true' EXIT

MODEL_ID=$(basename "${FLOTILLA_MODEL:-models/smollm2-135m-instruct-q4_1.gguf}" .gguf)
runs=()
for rep in $(seq 1 "$REPEAT"); do
  for policy in ${POLICIES//,/ }; do
    start_fleet --set router.policy="$policy"
    "$BIN" bench --gateway "$FGW" "${BENCH[@]}" --out "$OUT/r$rep-flotilla-$policy" \
      > "$OUT/r$rep-flotilla-$policy.log" 2>&1
    stop_fleet
    runs+=("$OUT/r$rep-flotilla-$policy")
  done
  for spec in ${ROUTERS//,/ }; do
    which=${spec%%:*}; policy=${spec#*:}
    d=${FLOTILLA_PEERS:-${XDG_CACHE_HOME:-$HOME/.cache}/flotilla-peers}
    [ -x "$d/sglang/venv/bin/python" ] && [ -x "$d/vllm-router/venv/bin/vllm-router" ] ||
      scripts/peers/routers.sh setup
    start_fleet
    mapfile -t workers < <(fleet_faces "$FGW")
    MODEL_NAME=$MODEL_ID scripts/peers/routers.sh start "$which" "${RGW#*:}" "$policy" "${workers[@]}"
    "$BIN" bench --gateway "$RGW" --model "$MODEL_ID" "${BENCH[@]}" \
      --out "$OUT/r$rep-router-$which-$policy" > "$OUT/r$rep-router-$which-$policy.log" 2>&1
    scripts/peers/routers.sh stop
    stop_fleet
    runs+=("$OUT/r$rep-router-$which-$policy")
  done
done

python3 - "${runs[@]}" <<'PY'
import json, os, sys
def f(x, spec):  # NaN is null in report.json
    return "–" if x is None else format(x, spec)
print("| run | system / policy | TTFT p50 / p99 ms | TPOT p50 ms | E2E p50 ms | goodput req/s | SLO met | prefix hit | ideal | errors |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for d in sys.argv[1:]:
    rep, kind, rest = os.path.basename(d).split("-", 2)
    if kind == "router":
        which, policy = rest.split("-", 1)
        name = {"sglang": "SGLang router 0.3.2", "vllm": "vLLM router 0.1.17"}[which] + " " + policy
    else:
        name = "Flotilla " + rest
    r = json.load(open(os.path.join(d, "report.json")))[0]
    hit, ideal = r["prefix_hit_rate"], r["ideal_prefix_hit_rate"]
    print(f"| {rep[1:]} | {name} | {f(r['ttft_ms']['p50'], '.0f')} / {f(r['ttft_ms']['p99'], '.0f')} | "
          f"{f(r['tpot_ms']['p50'], '.1f')} | {f(r['e2e_ms']['p50'], '.0f')} | {f(r['goodput_rps'], '.2f')} | "
          f"{f(100 * r['slo_attainment'], '.1f')} % | {f(hit and 100 * hit, '.1f')} % | "
          f"{f(ideal and 100 * ideal, '.1f')} % | {r['errors']} |")
PY
