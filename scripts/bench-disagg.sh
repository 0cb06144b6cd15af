#!/usr/bin/env bash
# Aggregated vs disaggregated serving on the real model (docs/benchmarks.md, "Disaggregated
# prefill and decode"). Two clients at once: short streams (128-token prompts, 64-token
# answers, 4 at a time; they measure ITL) and long prompts (3000 tokens, 1 at a time).
#
#   scripts/bench-disagg.sh NAME [--pin] -- UP_FLAGS…
#   scripts/bench-disagg.sh agg -- --nodes 4
#   scripts/bench-disagg.sh disagg --pin -- --prefill 1 --decode 2
#
# --pin: once the cluster is up, the prefill node and the gateway run on CPU 0 and every other
# node on CPU 1 (taskset), so that the pools stop sharing cores. Reports go to
# ${OUT:-/tmp/bench-disagg}/NAME-{short,long}/report.json; a summary line each is printed.
set -euo pipefail
BIN=${FLOTILLA:-${CARGO_TARGET_DIR:-target}/release/flotilla}
OUT=${OUT:-/tmp/bench-disagg}
GW=${GW:-127.0.0.1:18300}
name=$1; shift
pin=0
if [ "${1:-}" = "--pin" ]; then pin=1; shift; fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$OUT"
"$BIN" up --http "$GW" "$@" > "$OUT/$name.up.log" 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 1 180); do grep -q FLOTILLA_UP "$OUT/$name.up.log" 2>/dev/null && break; sleep 1; done
if [ $pin = 1 ]; then
  curl -s "http://$GW/v1/fleet" | python3 -c '
import json, sys
for n in json.load(sys.stdin)["nodes"]:
    role = n["workers"][0]["role"] if n["workers"] else "gateway"
    print(n["pid"], 0 if role in ("prefill", "gateway") else 1)' |
  while read -r pid cpu; do taskset -a -p -c "$cpu" "$pid" > /dev/null; done
fi
C="--gateway $GW --dataset synthetic-sessions --turns 1 --system-prompt-tokens 0 --arrival fixed"
"$BIN" bench $C --user-tokens 128 --session-output-tokens 16 --concurrency 3 --sessions 6 \
  --max-requests 6 --salt 1 > "$OUT/$name.warm.log" 2>&1
"$BIN" bench $C --user-tokens 3000 --session-output-tokens 16 --concurrency 1 --sessions 10 \
  --max-requests 10 --salt 3 --slo-ttft-ms 10000 --out "$OUT/$name-long" > "$OUT/$name.long.log" 2>&1 &
L=$!
"$BIN" bench $C --user-tokens 128 --session-output-tokens 64 --concurrency 4 --sessions 40 \
  --max-requests 40 --salt 2 --out "$OUT/$name-short" > "$OUT/$name.short.log" 2>&1
wait $L
for part in short long; do
  python3 - "$OUT/$name-$part/report.json" "$name-$part" <<'PY'
import json, sys
for x in json.load(open(sys.argv[1])):
    print(sys.argv[2], "n", x["requests"], "errors", x["errors"],
          "ttft p50/p99 ms", round(x["ttft_ms"]["p50"]), round(x["ttft_ms"]["p99"]),
          "itl p50/p90/p99 ms", round(x["itl_ms"]["p50"]), round(x["itl_ms"]["p90"]),
          round(x["itl_ms"]["p99"]), "itl max", round(x["itl_max_ms"]),
          "out tok/s", round(x["output_tokens_per_s"], 1))
PY
done
