#!/usr/bin/env bash
# Several routers on a live fleet, one workload, one table (docs/benchmarks.md, "Several
# routers"): Flotilla with 1, 2, 4 and 8 gateway + router nodes (`flotilla up --gateways N`:
# every router applies every worker's KV events and shares its load), then SGLang's router
# (cache_aware) run as 1 and as N independent replicas in front of the same kind of fleet,
# through the workers' own OpenAI faces (worker.http; scripts/peers/routers.sh). The clients
# are spread over the N front doors: session i goes to router i mod N (`flotilla bench
# --gateway URL1,URL2,…`). Every run starts a fresh fleet (cold caches) and sends the same
# prompts (same salt). Workload and fleet as scripts/bench-routing.sh: 16 sim workers, the
# first 600 Mooncake conversation requests, arrivals jittered by up to 3 s.
#
#   scripts/bench-routers.sh [BENCH_FLAGS…]
#   COUNTS=1,8 WORKERS=64 REQUESTS=2000 scripts/bench-routers.sh
#
# Environment: FLOTILLA (binary, default $CARGO_TARGET_DIR/release/flotilla, else target/…),
# OUT (/tmp/bench-routers), COUNTS (router counts, 1,2,4,8), PEER (1: also SGLang's router;
# 0: Flotilla only), WORKERS (16), KV_BLOCKS (8192), SIM_SPEEDUP (0.25), TRACE_SPEEDUP (5),
# REQUESTS (600), DATASET (mooncake-conversation), STALL_MS (0), SALT, SETS (extra Flotilla
# settings, space-separated KEY=VALUE).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FLOTILLA:-${CARGO_TARGET_DIR:-target}/release/flotilla}
OUT=${OUT:-/tmp/bench-routers}
COUNTS=${COUNTS:-1,2,4,8}; PEER=${PEER:-1}
WORKERS=${WORKERS:-16}; KV_BLOCKS=${KV_BLOCKS:-8192}; SIM_SPEEDUP=${SIM_SPEEDUP:-0.25}
TRACE_SPEEDUP=${TRACE_SPEEDUP:-5}; REQUESTS=${REQUESTS:-600}
DATASET=${DATASET:-mooncake-conversation}; STALL_MS=${STALL_MS:-0}; SALT=${SALT:-1647954570651526062}
EXTRA=(); for kv in ${SETS:-}; do EXTRA+=(--set "$kv"); done
FGW=127.0.0.1:18080; RPORT=18100
mkdir -p "$OUT"
BENCH=(--dataset "$DATASET" --max-requests "$REQUESTS" --speedup "$TRACE_SPEEDUP"
       --trace-jitter-ms 3000 --fresh-connections --salt "$SALT" "$@")
. scripts/lib/fleet.sh
UP=
trap 'stop_fleet; scripts/peers/routers.sh stop 2>/dev/null || true' EXIT
# "http://127.0.0.1:P,http://127.0.0.1:P+1,…" for N front doors from port P, STEP apart.
urls() { local p=$1 n=$2 step=$3 k out=; for ((k = 0; k < n; k++)); do out+="${out:+,}http://127.0.0.1:$((p + k * step))"; done; echo "$out"; }

runs=()
for n in ${COUNTS//,/ }; do
  start_sim_fleet --gateways "$n"
  "$BIN" bench --gateway "$(urls "${FGW#*:}" "$n" 1)" "${BENCH[@]}" --out "$OUT/flotilla-$n" \
    > "$OUT/flotilla-$n.log" 2>&1
  stop_fleet
  runs+=("$OUT/flotilla-$n")
done

if [ "$PEER" = 1 ]; then
  MODEL_ID=$(basename "${FLOTILLA_MODEL:-models/smollm2-135m-instruct-q4_1.gguf}" .gguf)
  [ -x "${FLOTILLA_PEERS:-${XDG_CACHE_HOME:-$HOME/.cache}/flotilla-peers}/sglang/venv/bin/python" ] ||
    scripts/peers/routers.sh setup
  for n in ${COUNTS//,/ }; do
    start_sim_fleet --set worker.http=127.0.0.1:0 --set worker.kv_events_addr=127.0.0.1:0
    mapfile -t workers < <(fleet_faces "$FGW")
    # N independent replicas, each with every worker; ports RPORT, RPORT+2, … (metrics at +1).
    for ((k = 0; k < n; k++)); do
      MODEL_NAME=$MODEL_ID scripts/peers/routers.sh start sglang $((RPORT + 2 * k)) cache_aware \
        "${workers[@]}" > /dev/null
    done
    "$BIN" bench --gateway "$(urls "$RPORT" "$n" 2)" --model "$MODEL_ID" --text-prompts \
      "${BENCH[@]}" --out "$OUT/sglang-$n" > "$OUT/sglang-$n.log" 2>&1
    scripts/peers/routers.sh stop
    stop_fleet
    runs+=("$OUT/sglang-$n")
  done
fi

python3 - "${runs[@]}" <<'PY'
import json, os, sys
def f(x, spec):  # NaN is null in report.json
    return "–" if x is None else format(x, spec)
print("| system | routers | prefix hit | ÷ 1 router | TTFT p50 / p99 ms | E2E p50 / p99 s | goodput req/s | errors |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
one = {}
for d in sys.argv[1:]:
    system, n = os.path.basename(d).rsplit("-", 1)
    r = json.load(open(os.path.join(d, "report.json")))[0]
    hit = r["prefix_hit_rate"]
    one.setdefault(system, hit)
    ratio = hit / one[system] if hit is not None and one[system] else None
    name = {"flotilla": "Flotilla (shared index and load)", "sglang": "SGLang router 0.3.2 cache_aware, independent replicas"}[system]
    e2e = r["e2e_ms"]
    print(f"| {name} | {n} | {f(hit and 100 * hit, '.1f')} % | {f(ratio, '.2f')} | "
          f"{f(r['ttft_ms']['p50'], '.0f')} / {f(r['ttft_ms']['p99'], '.0f')} | "
          f"{f(e2e['p50'] and e2e['p50'] / 1000, '.2f')} / {f(e2e['p99'] and e2e['p99'] / 1000, '.2f')} | "
          f"{f(r['goodput_rps'], '.2f')} | {r['errors']} |")
PY
