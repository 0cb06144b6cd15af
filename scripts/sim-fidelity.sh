#!/usr/bin/env bash
# The offline simulator against a live fleet, one workload, one table (issue 28, "Faithful"):
# `flotilla up --engine sim` + `flotilla bench`, then `flotilla sim` with the same workload,
# fleet and settings; prints each run's TTFT / ITL percentiles, prefix hit rate and goodput,
# and the simulator's error against the live run per metric.
#
#   scripts/sim-fidelity.sh [BENCH_FLAGS…]     default: the first 600 Mooncake conversation requests
#   WORKERS=16 REQUESTS=600 TRACE_SPEEDUP=2 scripts/sim-fidelity.sh
#   PREFILL=1 DECODE=2 DATASET=synthetic-sessions scripts/sim-fidelity.sh
#
# Environment: FLOTILLA (binary, default $CARGO_TARGET_DIR/debug/flotilla, else target/…), OUT
# (/tmp/sim-fidelity), WORKERS (16; or PREFILL and DECODE: a disaggregated fleet, one worker
# per node), REQUESTS (600), TRACE_SPEEDUP (2), DATASET (mooncake-conversation), SALT (1),
# SETS (settings for both, space-separated KEY=VALUE), KILL_AT (a chaos run: seconds into the
# replay, the live fleet's first worker replica is killed through the chaos API and the sim's
# worker 0 with --kill; its replica restarts after RESTART_MS, 2000 by default, in the sim).
# ENGINE=cpu runs the live fleet on the real model (the CPU engine) and the sim on PROFILE
# (a `flotilla profile` output, required with it); NODES (3) sets the live fleet's processes.
# Also draws both runs on one plot: $OUT/live_vs_sim.svg (flotilla plot).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FLOTILLA:-${CARGO_TARGET_DIR:-target}/debug/flotilla}
OUT=${OUT:-/tmp/sim-fidelity}
WORKERS=${WORKERS:-16}; REQUESTS=${REQUESTS:-600}; TRACE_SPEEDUP=${TRACE_SPEEDUP:-2}
DATASET=${DATASET:-mooncake-conversation}; SALT=${SALT:-1}
PREFILL=${PREFILL:-}; DECODE=${DECODE:-}
SETS_ARGS=(); for kv in ${SETS:-}; do SETS_ARGS+=(--set "$kv"); done
GW=127.0.0.1:18110
mkdir -p "$OUT"
WORKLOAD=(--dataset "$DATASET" --max-requests "$REQUESTS" --speedup "$TRACE_SPEEDUP" --salt "$SALT" "$@")

. scripts/lib/fleet.sh
UP=
trap 'stop_fleet' EXIT
if [ -n "$PREFILL" ]; then
  FLEET_UP=(--prefill "$PREFILL" --decode "$DECODE"); FLEET_SIM=(--prefill "$PREFILL" --decode "$DECODE")
  TOTAL=$((PREFILL + DECODE))
else
  FLEET_UP=(--nodes "${NODES:-3}" --workers "$WORKERS"); FLEET_SIM=(--workers "$WORKERS"); TOTAL=$WORKERS
fi
ENGINE=${ENGINE:-sim}; PROFILE_SIM=()
if [ "$ENGINE" = cpu ]; then
  [ -n "${PROFILE:-}" ] || { echo "ENGINE=cpu needs PROFILE=FILE (flotilla profile --out FILE)" >&2; exit 2; }
  PROFILE_SIM=(--set "worker.sim_profile=$PROFILE")
fi
KILL_AT=${KILL_AT:-}; RESTART_MS=${RESTART_MS:-2000}
CHAOS_UP=(); KILL_SIM=()
if [ -n "$KILL_AT" ]; then
  CHAOS_UP=(--chaos); KILL_SIM=(--kill "$KILL_AT:0" --restart-ms "$RESTART_MS")
fi
"$BIN" up --engine "$ENGINE" "${FLEET_UP[@]}" "${CHAOS_UP[@]}" --http "$GW" "${SETS_ARGS[@]}" > "$OUT/up.log" 2>&1 &
UP=$!
wait_fleet "$GW" "$TOTAL" "$OUT/up.log" 120
KILLER=
if [ -n "$KILL_AT" ]; then
  # The worker the sim numbers 0: the first worker in the fleet view's order.
  TARGET=$("$BIN" status --gateway "$GW" --json | python3 -c '
import json, sys
d = json.load(sys.stdin)
ws = sorted(w["id"] for n in d.get("nodes", []) for w in n.get("workers", []))
print(ws[0] if ws else "")')
  ( sleep "$KILL_AT"; "$BIN" chaos --gateway "$GW" kill --target "$TARGET" --actor replica \
      > "$OUT/kill.log" 2>&1 ) &
  KILLER=$!
fi
"$BIN" bench --gateway "$GW" "${WORKLOAD[@]}" --out "$OUT/live" > "$OUT/live.log" 2>&1
[ -z "$KILLER" ] || wait "$KILLER" || true
stop_fleet
"$BIN" sim "${FLEET_SIM[@]}" "${SETS_ARGS[@]}" "${PROFILE_SIM[@]}" "${KILL_SIM[@]}" "${WORKLOAD[@]}" --out "$OUT/sim" > "$OUT/sim.log" 2>&1
"$BIN" plot "$OUT/live=live" "$OUT/sim=sim" --out "$OUT/live_vs_sim.svg" 2>/dev/null

python3 - "$OUT/live/report.json" "$OUT/sim/report.json" <<'PY'
import json, sys
live, sim = (json.load(open(p))[0] for p in sys.argv[1:3])
rows = [
    ("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]),
    ("TTFT p99 ms", lambda r: r["ttft_ms"]["p99"]),
    ("ITL p50 ms", lambda r: r["itl_ms"]["p50"]),
    ("ITL p99 ms", lambda r: r["itl_ms"]["p99"]),
    ("TPOT p50 ms", lambda r: r["tpot_ms"]["p50"]),
    ("E2E p50 ms", lambda r: r["e2e_ms"]["p50"]),
    ("prefix hit %", lambda r: r["prefix_hit_rate"] and 100 * r["prefix_hit_rate"]),
    ("goodput req/s", lambda r: r["goodput_rps"]),
    ("errors", lambda r: r["errors"]),
]
print("| metric | live | sim | sim ÷ live − 1 |")
print("|---|---:|---:|---:|")
for name, get in rows:
    a, b = get(live), get(sim)
    err = "–" if not a or a is None or b is None else f"{100 * (b / a - 1):+.1f} %"
    fa = "–" if a is None else f"{a:.2f}"
    fb = "–" if b is None else f"{b:.2f}"
    print(f"| {name} | {fa} | {fb} | {err} |")
PY
