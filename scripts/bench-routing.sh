#!/usr/bin/env bash
# KV-aware routing side by side with NVIDIA Dynamo's router, one workload, one table
# (docs/benchmarks.md, "KV-aware routing"). Both run 16 simulated workers with the same
# vLLM-on-H100 timing fit, block size 16, the same KV blocks per worker, step budget and
# batch limit, on loopback; every request opens a fresh connection (Dynamo's listener lacks
# TCP_NODELAY). Runs, in order: Flotilla round_robin, kv and dynamo_kv (NVIDIA Dynamo's cost
# inside Flotilla, one fleet, switched per request), then Dynamo 1.6.1's frontend with
# --router-mode kv and round-robin over its mocker engine (scripts/peers/dynamo.sh), then
# SGLang's router (cache_aware) and vLLM's router (kv_aware, fed by the workers' vLLM-format
# ZMQ KV events) in front of a fresh Flotilla fleet each, through the workers' own OpenAI faces
# (worker.http; scripts/peers/routers.sh).
#
#   scripts/bench-routing.sh [BENCH_FLAGS…]        default: the first 600 Mooncake conversation requests
#   REQUESTS=2000 DATASET=mooncake-synthetic scripts/bench-routing.sh
#
# Environment: FLOTILLA (binary, default $CARGO_TARGET_DIR/release/flotilla, else target/…), OUT (default
# /tmp/bench-routing), WORKERS (16), KV_BLOCKS (8192), SIM_SPEEDUP (0.25: engine time ×4, so that
# 2 cores carry the fleet near saturation), TRACE_SPEEDUP (5), REQUESTS (600), DATASET
# (mooncake-conversation), STALL_MS (0: Flotilla's stall-free cap off, as vLLM and Dynamo's
# mocker have none), SALT (prompts; the same for every run), POLICIES (Flotilla's, default
# round_robin,kv,dynamo_kv), PEERS (1: also run Dynamo), ROUTERS (peer routers over Flotilla
# workers, default sglang:cache_aware,vllm:kv_aware; empty: none), SETS (extra Flotilla
# settings for every Flotilla fleet, space-separated KEY=VALUE, e.g. "router.queue_weight=4").
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FLOTILLA:-${CARGO_TARGET_DIR:-target}/release/flotilla}
OUT=${OUT:-/tmp/bench-routing}
WORKERS=${WORKERS:-16}; KV_BLOCKS=${KV_BLOCKS:-8192}; SIM_SPEEDUP=${SIM_SPEEDUP:-0.25}
TRACE_SPEEDUP=${TRACE_SPEEDUP:-5}; REQUESTS=${REQUESTS:-600}
DATASET=${DATASET:-mooncake-conversation}; STALL_MS=${STALL_MS:-0}; SALT=${SALT:-1647954570651526062}
PEERS=${PEERS:-1}; POLICIES=${POLICIES:-round_robin,kv,dynamo_kv}
ROUTERS=${ROUTERS-sglang:cache_aware,vllm:kv_aware}
EXTRA=(); for kv in ${SETS:-}; do EXTRA+=(--set "$kv"); done
FGW=127.0.0.1:18080; DGW=127.0.0.1:18090; RGW=127.0.0.1:18100
mkdir -p "$OUT"
BENCH=(--dataset "$DATASET" --max-requests "$REQUESTS" --speedup "$TRACE_SPEEDUP"
       --trace-jitter-ms 3000 --fresh-connections --salt "$SALT" "$@")

. scripts/lib/fleet.sh
UP=
start_fleet() { start_sim_fleet "$@"; }  # scripts/lib/fleet.sh
trap 'stop_fleet; scripts/peers/dynamo.sh stop 2>/dev/null || true; scripts/peers/routers.sh stop 2>/dev/null || true' EXIT

start_fleet
"$BIN" bench --gateway "$FGW" "${BENCH[@]}" --compare "policy=$POLICIES" \
  --out "$OUT/flotilla" > "$OUT/flotilla.log" 2>&1
stop_fleet

runs=("$OUT/flotilla")
if [ "$PEERS" = 1 ]; then
  [ -x "${FLOTILLA_PEERS:-${XDG_CACHE_HOME:-$HOME/.cache}/flotilla-peers}/dynamo/venv/bin/python" ] ||
    scripts/peers/dynamo.sh setup
  for mode in kv round-robin; do
    scripts/peers/dynamo.sh start "$mode" "${DGW#*:}" "$WORKERS" --block-size 16 \
      --num-gpu-blocks-override "$KV_BLOCKS" --max-num-batched-tokens 8192 --max-num-seqs 256 \
      --speedup-ratio "$SIM_SPEEDUP"
    sleep 10  # every mocker worker registered
    "$BIN" bench --gateway "$DGW" --model smollm2 "${BENCH[@]}" --out "$OUT/dynamo-$mode" \
      > "$OUT/dynamo-$mode.log" 2>&1
    scripts/peers/dynamo.sh stop; sleep 2
    runs+=("$OUT/dynamo-$mode")
  done
fi

MODEL_ID=$(basename "${FLOTILLA_MODEL:-models/smollm2-135m-instruct-q4_1.gguf}" .gguf)
for spec in ${ROUTERS//,/ }; do
  which=${spec%%:*}; policy=${spec#*:}
  d=${FLOTILLA_PEERS:-${XDG_CACHE_HOME:-$HOME/.cache}/flotilla-peers}
  [ -x "$d/sglang/venv/bin/python" ] && [ -x "$d/vllm-router/venv/bin/vllm-router" ] ||
    scripts/peers/routers.sh setup
  # Every replica with its own face and vLLM-format KV event socket (free ports).
  start_fleet --set worker.http=127.0.0.1:0 --set worker.kv_events_addr=127.0.0.1:0
  mapfile -t workers < <(fleet_faces "$FGW")
  MODEL_NAME=$MODEL_ID scripts/peers/routers.sh start "$which" "${RGW#*:}" "$policy" "${workers[@]}"
  # The routers take only text on /v1/completions: one single-token word per trace token id
  # (same lengths, same shared prefixes; `flotilla bench --text-prompts`).
  "$BIN" bench --gateway "$RGW" --model "$MODEL_ID" --text-prompts "${BENCH[@]}" \
    --out "$OUT/router-$which-$policy" \
    > "$OUT/router-$which-$policy.log" 2>&1
  curl -sf "127.0.0.1:$((${RGW#*:} + 1))/metrics" > "$OUT/router-$which-$policy/router-metrics.txt" || true
  scripts/peers/routers.sh stop
  stop_fleet
  runs+=("$OUT/router-$which-$policy")
done

python3 - "${runs[@]}" <<'PY'
import json, os, sys
def f(x, spec):  # NaN is null in report.json
    return "–" if x is None else format(x, spec)
print("| system / policy | prefix hit | % of ideal | TTFT p50 / p99 ms | TTFT mean, reuse > 512 tok (n) / other | ITL p50 / p99 ms | TPOT p50 ms | E2E p50 s | goodput req/s | errors |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for d in sys.argv[1:]:
    base = os.path.basename(d)
    if base.startswith("dynamo"):
        sysname, label = "Dynamo 1.6.1", base.split("-", 1)[1]
    elif base.startswith("router-"):
        which, label = base.split("-", 2)[1:]
        sysname = {"sglang": "SGLang router 0.3.2", "vllm": "vLLM router 0.1.17"}[which] + " (Flotilla workers)"
    else:
        sysname, label = "Flotilla", None
    for r in json.load(open(os.path.join(d, "report.json"))):
        label_r = label or r["label"].replace("policy=", "")
        hit, ideal = r["prefix_hit_rate"], r["ideal_prefix_hit_rate"]
        share = hit / ideal if hit is not None and ideal else None
        e2e = r["e2e_ms"]["p50"]
        print(f"| {sysname} {label_r} | {f(hit and 100 * hit, '.1f')} % | {f(share and 100 * share, '.0f')} % | "
              f"{f(r['ttft_ms']['p50'], '.0f')} / {f(r['ttft_ms']['p99'], '.0f')} | "
              f"{f(r['reuse_ttft_mean_ms'], '.0f')} ({r['reuse_requests']}) / {f(r['other_ttft_mean_ms'], '.0f')} | "
              f"{f(r['itl_ms']['p50'], '.0f')} / {f(r['itl_ms']['p99'], '.0f')} | {f(r['tpot_ms']['p50'], '.1f')} | "
              f"{f(e2e and e2e / 1000, '.1f')} | {f(r['goodput_rps'], '.2f')} | {r['errors']} |")
PY
