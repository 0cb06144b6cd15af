#!/usr/bin/env bash
# Peer pulls (G4) on a fork-heavy agent workload, on the simulated fleet, one command, one
# table (docs/benchmarks.md, "Peer pulls"): the router's pure affinity (no pulls, no balance
# guard), recompute (router.pull_credit=0), and pull credits 0.5 / 0.75 (the default) / 1. The
# ratio table is against the first variant (affinity).
#
# The workload, written as a Mooncake trace (512-token hash_id blocks) so anyone can replay it:
# AGENTS agents arrive GAP_MS apart; each first sends its root request (ROOT_BLOCKS blocks of
# private context, e.g. a repository and a task), then, FORK_AFTER_MS later, fans out FANOUT
# sub-agent requests at once (FORK_SPREAD_MS apart), each its root's context plus
# SUFFIX_TOKENS private tokens (the sub-task). Under the balance guard the root's holder cannot take the whole
# fan-out: the forks placed elsewhere either recompute the root's context or, with pulls on,
# pull it from the holder. This is the shape of llm-d's fork-heavy agent benchmark (issue 30).
#
#   scripts/bench-peer-pulls.sh [SIM_FLAGS…]
#   AGENTS=400 FANOUT=16 scripts/bench-peer-pulls.sh --kill 60:3
#   LIVE=1 scripts/bench-peer-pulls.sh [BENCH_FLAGS…]
#
# LIVE=1: the real model instead, on a fresh `flotilla up --nodes 4` (3 CPU worker processes,
# KV pulled over TCP) per variant — affinity, recompute, pulls at 0.75 — replayed by
# `flotilla bench`, one table at the end; a workload two CPU cores carry by default (AGENTS 6,
# GAP_MS 10000, ROOT_BLOCKS 1, FANOUT 16 — more than the balance guard leaves on one worker of
# three —, SUFFIX_TOKENS 64, OUTPUT 16: ~5 minutes). HTTP on
# 127.0.0.1:18110.
#
# Environment: FLOTILLA (binary, default $CARGO_TARGET_DIR/release/flotilla, else target/…,
# else the debug build), OUT (default /tmp/bench-peer-pulls), WORKERS (16), AGENTS (300),
# GAP_MS (400), ROOT_BLOCKS (6: 3,072 tokens), FANOUT (8), FORK_AFTER_MS (1500),
# FORK_SPREAD_MS (5), SUFFIX_TOKENS (300: a fork's private tokens), OUTPUT (128 tokens per
# request), CREDITS (the compared
# router.pull_credit values, default 0+router.balance_ratio=0,0,0.5,0.75,1: the first is the
# router's pure affinity — no pulls, no balance guard, every fork on its root's holder).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-target}
BIN=${FLOTILLA:-}
if [ -z "$BIN" ]; then
  BIN=$T/release/flotilla; [ -x "$BIN" ] || BIN=$T/debug/flotilla
fi
OUT=${OUT:-/tmp/bench-peer-pulls}
LIVE=${LIVE:-0}
if [ "$LIVE" = 1 ]; then
  AGENTS=${AGENTS:-6}; GAP_MS=${GAP_MS:-10000}; ROOT_BLOCKS=${ROOT_BLOCKS:-1}
  FANOUT=${FANOUT:-16}; SUFFIX_TOKENS=${SUFFIX_TOKENS:-64}; OUTPUT=${OUTPUT:-16}
fi
WORKERS=${WORKERS:-16}; AGENTS=${AGENTS:-300}; GAP_MS=${GAP_MS:-400}
ROOT_BLOCKS=${ROOT_BLOCKS:-6}; FANOUT=${FANOUT:-8}; FORK_AFTER_MS=${FORK_AFTER_MS:-1500}
FORK_SPREAD_MS=${FORK_SPREAD_MS:-5}; OUTPUT=${OUTPUT:-128}; SUFFIX_TOKENS=${SUFFIX_TOKENS:-300}
CREDITS=${CREDITS:-0+router.balance_ratio=0,0,0.5,0.75,1}
mkdir -p "$OUT"
TRACE=$OUT/agent-forks.jsonl

# Deterministic: block ids count up, no randomness.
awk -v agents="$AGENTS" -v gap="$GAP_MS" -v root="$ROOT_BLOCKS" -v fan="$FANOUT" \
    -v after="$FORK_AFTER_MS" -v spread="$FORK_SPREAD_MS" -v out="$OUTPUT" \
    -v suffix="$SUFFIX_TOKENS" 'BEGIN {
  next_id = 0; n = 0
  for (a = 0; a < agents; a++) {
    ids = ""
    for (b = 0; b < root; b++) { ids = ids (b ? ", " : "") next_id; next_id++ }
    t = a * gap
    line[n] = t; body[n] = sprintf("\"input_length\": %d, \"output_length\": %d, \"hash_ids\": [%s]", root * 512, out, ids); n++
    for (f = 0; f < fan; f++) {
      line[n] = t + after + f * spread
      body[n] = sprintf("\"input_length\": %d, \"output_length\": %d, \"hash_ids\": [%s, %d]", root * 512 + suffix, out, ids, next_id); next_id++; n++
    }
  }
  # Time order (insertion sort is enough for a few thousand lines, and keeps awk portable).
  for (i = 1; i < n; i++) {
    tl = line[i]; tb = body[i]; j = i - 1
    while (j >= 0 && line[j] > tl) { line[j + 1] = line[j]; body[j + 1] = body[j]; j-- }
    line[j + 1] = tl; body[j + 1] = tb
  }
  for (i = 0; i < n; i++) printf("{\"timestamp\": %d, %s}\n", line[i], body[i])
}' > "$TRACE"
echo "trace: $TRACE ($(wc -l < "$TRACE") requests: $AGENTS agents × (1 root + $FANOUT forks))" >&2

if [ "$LIVE" != 1 ]; then
  exec "$BIN" sim --trace "$TRACE" --workers "$WORKERS" --max-input-tokens 8192 \
    --compare "router.pull_credit=$CREDITS" --out "$OUT" "$@"
fi

# Live: one fresh fleet per variant, the same trace through the gateway.
. scripts/lib/fleet.sh
GW=127.0.0.1:18110
UP=
trap stop_fleet EXIT
runs=()
for variant in "affinity:router.pull_credit=0 router.balance_ratio=0" \
               "recompute:router.pull_credit=0" "pull-0.75:router.pull_credit=0.75"; do
  name=${variant%%:*}; sets=()
  for kv in ${variant#*:}; do sets+=(--set "$kv"); done
  "$BIN" up --nodes 4 --http "$GW" --set transport.backend=tcp "${sets[@]}" \
    > "$OUT/$name.up.log" 2>&1 &
  UP=$!
  wait_fleet "$GW" 3 "$OUT/$name.up.log" 180
  echo "$name: running the trace…" >&2
  "$BIN" bench --gateway "$GW" --trace "$TRACE" --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  curl -sf "http://$GW/v1/fleet" > "$OUT/$name/fleet.json" || true
  stop_fleet
  runs+=("$OUT/$name")
done
python3 - "${runs[@]}" <<'PY'
import json, os, sys
def f(x, spec):
    return "–" if x is None else format(x, spec)
print("| variant | prefix hit | TTFT p50 / p90 / p99 ms | E2E p50 ms | peer pulls (blocks) | errors |")
print("|---|---:|---:|---:|---:|---:|")
base = None
for d in sys.argv[1:]:
    r = json.load(open(os.path.join(d, "report.json")))[0]
    pulls = blocks = 0
    try:
        for n in json.load(open(os.path.join(d, "fleet.json")))["nodes"]:
            for w in n["workers"]:
                p = w.get("kv_peer_pulls", {})
                pulls += p.get("pulled", 0); blocks += p.get("blocks", 0)
    except (OSError, ValueError, KeyError):
        pass
    t = r["ttft_ms"]
    print(f"| {os.path.basename(d)} | {f(r['prefix_hit_rate'] and 100 * r['prefix_hit_rate'], '.1f')} % | "
          f"{f(t['p50'], '.0f')} / {f(t['p90'], '.0f')} / {f(t['p99'], '.0f')} | {f(r['e2e_ms']['p50'], '.0f')} | "
          f"{pulls} ({blocks}) | {r['errors']} |")
PY
