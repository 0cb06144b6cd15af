#!/usr/bin/env bash
# Peer pulls (G4) on a fork-heavy agent workload, on the simulated fleet: pulls off
# (router.pull_credit=0, the default) against pull credits 0.25 / 0.5 / 0.75, one command, one
# table (docs/benchmarks.md, "Peer pulls").
#
# The workload, written as a Mooncake trace (512-token hash_id blocks) so anyone can replay it:
# AGENTS agents arrive GAP_MS apart; each first sends its root request (ROOT_BLOCKS blocks of
# private context, e.g. a repository and a task), then, FORK_AFTER_MS later, fans out FANOUT
# sub-agent requests at once (FORK_SPREAD_MS apart), each its root's context plus one private
# block (the sub-task). Under the balance guard the root's holder cannot take the whole
# fan-out: the forks placed elsewhere either recompute the root's context or, with pulls on,
# pull it from the holder. This is the shape of llm-d's fork-heavy agent benchmark (issue 30).
#
#   scripts/bench-peer-pulls.sh [SIM_FLAGS…]
#   AGENTS=400 FANOUT=16 scripts/bench-peer-pulls.sh --kill 60:3
#
# Environment: FLOTILLA (binary, default $CARGO_TARGET_DIR/release/flotilla, else target/…,
# else the debug build), OUT (default /tmp/bench-peer-pulls), WORKERS (16), AGENTS (300),
# GAP_MS (400), ROOT_BLOCKS (6: 3,072 tokens), FANOUT (8), FORK_AFTER_MS (1500),
# FORK_SPREAD_MS (5), OUTPUT (128 tokens per request), CREDITS (0,0.25,0.5,0.75).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${CARGO_TARGET_DIR:-target}
BIN=${FLOTILLA:-}
if [ -z "$BIN" ]; then
  BIN=$T/release/flotilla; [ -x "$BIN" ] || BIN=$T/debug/flotilla
fi
OUT=${OUT:-/tmp/bench-peer-pulls}
WORKERS=${WORKERS:-16}; AGENTS=${AGENTS:-300}; GAP_MS=${GAP_MS:-400}
ROOT_BLOCKS=${ROOT_BLOCKS:-6}; FANOUT=${FANOUT:-8}; FORK_AFTER_MS=${FORK_AFTER_MS:-1500}
FORK_SPREAD_MS=${FORK_SPREAD_MS:-5}; OUTPUT=${OUTPUT:-128}
CREDITS=${CREDITS:-0,0.25,0.5,0.75}
mkdir -p "$OUT"
TRACE=$OUT/agent-forks.jsonl

# Deterministic: block ids count up, no randomness.
awk -v agents="$AGENTS" -v gap="$GAP_MS" -v root="$ROOT_BLOCKS" -v fan="$FANOUT" \
    -v after="$FORK_AFTER_MS" -v spread="$FORK_SPREAD_MS" -v out="$OUTPUT" 'BEGIN {
  next_id = 0; n = 0
  for (a = 0; a < agents; a++) {
    ids = ""
    for (b = 0; b < root; b++) { ids = ids (b ? ", " : "") next_id; next_id++ }
    t = a * gap
    line[n] = t; body[n] = sprintf("\"input_length\": %d, \"output_length\": %d, \"hash_ids\": [%s]", root * 512, out, ids); n++
    for (f = 0; f < fan; f++) {
      line[n] = t + after + f * spread
      body[n] = sprintf("\"input_length\": %d, \"output_length\": %d, \"hash_ids\": [%s, %d]", root * 512 + 300, out, ids, next_id); next_id++; n++
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

"$BIN" sim --trace "$TRACE" --workers "$WORKERS" --max-input-tokens 8192 \
  --compare "router.pull_credit=$CREDITS" --out "$OUT" "$@"
