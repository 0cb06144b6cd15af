#!/usr/bin/env bash
# The planner on the Azure LLM inference trace 2023 (conversation), in `flotilla sim`: the
# planner in the loop against an oracle that knows the coming load and against static fleets —
# one the planner's capacity rule sizes for the busiest interval, and the smallest one that
# meets the SLOs (found by a sweep). Aggregated, then disaggregated pools. Prints the tables
# recorded in docs/benchmarks.md ("The planner on the Azure trace").
#
# The trace (1 h, 19,366 requests, 5.4 req/s) is time-compressed SPEEDUP× so that it needs a
# fleet of ~10 H100 replicas, not one; the planner's interval, cool-down and the replicas'
# cold start are compressed with it (SCALE=1), so that the planner sees the trace's dynamics
# as it would at real time with its defaults (10 s interval, 60 s cool-down, 30 s cold start).
# SCALE=0 keeps them unscaled (a harder test: a cold start then spans 5 minutes of trace).
#
# Usage: scripts/planner-bench.sh            (builds target/release/flotilla if needed)
# Env: BIN, SPEEDUP (10), SCALE (1), OUT (a temp folder), STATIC ("7 8 9 10 11 12").
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-}
if [[ -z "$BIN" ]]; then
    cargo build --release --quiet
    BIN="${CARGO_TARGET_DIR:-target}/release/flotilla"
fi
SPEEDUP=${SPEEDUP:-10}
SCALE=${SCALE:-1}
OUT=${OUT:-$(mktemp -d)}
STATIC=${STATIC:-"7 8 9 10 11 12"}
if [[ "$SCALE" == 1 ]]; then
    INTERVAL=$(python3 -c "print(10/$SPEEDUP)")
    COOLDOWN=$(python3 -c "print(60/$SPEEDUP)")
    COLD_MS=$(python3 -c "print(int(30000/$SPEEDUP))")
else
    INTERVAL=10 COOLDOWN=60 COLD_MS=30000
fi
COMMON=(--dataset azure-conv --speedup "$SPEEDUP" --slo-ttft-ms 500 --slo-itl-ms 50
    --set planner.interval_s="$INTERVAL" --set planner.cooldown_s="$COOLDOWN"
    --cold-start-ms "$COLD_MS")
echo "# Azure conversation trace ×$SPEEDUP; planner interval $INTERVAL s, cool-down $COOLDOWN s, cold start $COLD_MS ms"
echo "# SLO per request: TTFT ≤ 500 ms and TPOT ≤ 50 ms (the planner's targets); outputs in $OUT"
table() { sed -n '/^| run | SLO met/,/^$/p'; }

echo; echo "## aggregated: planner vs oracle vs the rule's peak fleet (starting at 8 replicas)"
"$BIN" sim "${COMMON[@]}" --workers 8 --compare planner=on,oracle,peak --out "$OUT/agg" 2>/dev/null | table

echo; echo "## aggregated: static fleets (the smallest meeting 99 % is the best static fleet)"
"$BIN" sim "${COMMON[@]}" --compare "workers=$(echo $STATIC | tr ' ' ',')" 2>/dev/null | table

echo; echo "## disaggregated: planner vs oracle vs the rule's peak pools (starting at 8 prefill + 3 decode)"
"$BIN" sim "${COMMON[@]}" --prefill 8 --decode 3 --compare planner=on,oracle,peak --out "$OUT/disagg" 2>/dev/null | table
python3 - "$OUT" <<'PY'
import json, sys
for name in ("agg", "disagg"):
    runs = json.load(open(f"{sys.argv[1]}/{name}/sim.json"))
    for r in runs:
        p = r["planner"]
        pools = ", ".join(f"{role} {s:.0f}" for role, s in p["replica_seconds_by_pool"])
        print(f"{name} {r['label']}: replica-seconds by pool: {pools}")
PY
