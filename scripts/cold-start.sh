#!/usr/bin/env bash
# Scale from zero, measured: `flotilla up --planner` with a pool that may go to zero; once it
# is at zero, one streamed request's time to first token (the cold start: the planner's next
# interval, the node process, weight load, the first token) against a warm request's.
#
# Usage: scripts/cold-start.sh [sim|cpu]     (cpu: the real model; writes a capacity profile
#        with `flotilla profile` first). Env: BIN (default target/release/flotilla).
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE=${1:-sim}
BIN=${BIN:-${CARGO_TARGET_DIR:-target}/release/flotilla}
WORK=$(mktemp -d)
PORT=${PORT:-18190}
SETS=(--set planner.interval_s=1 --set planner.aggregated.min=0 --set planner.idle_to_zero_s=5
      --set planner.cooldown_s=2 --set planner.scale_down_intervals=2)
if [[ "$ENGINE" == cpu ]]; then
    "$BIN" profile --out "$WORK/sim-profile.json" --capacity-out "$WORK/capacity.json" \
        --ttft-target-ms 5000 --itl-target-ms 500 > /dev/null
    SETS+=(--set planner.capacity_profile="$WORK/capacity.json")
else
    SETS+=(--engine sim)
fi
"$BIN" up --nodes 2 --http 127.0.0.1:$PORT --planner "${SETS[@]}" > "$WORK/up.log" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
until grep -q FLOTILLA_UP "$WORK/up.log"; do sleep 0.5; done
MODEL=$(curl -s http://127.0.0.1:$PORT/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
ttft() {
    python3 - "$PORT" "$MODEL" <<'PY'
import json, sys, time, urllib.request
port, model = sys.argv[1], sys.argv[2]
body = json.dumps({"model": model, "prompt": "The fleet woke up and", "max_tokens": 8,
                   "stream": True}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                             {"content-type": "application/json"})
t0 = time.monotonic()
with urllib.request.urlopen(req, timeout=300) as r:
    for line in r:
        if line.startswith(b"data: {"):
            print(f"{(time.monotonic() - t0) * 1000:.0f}")
            break
PY
}
WARM=$(ttft)
echo "warm request: TTFT ${WARM} ms"
# Wait for the pool to go to zero (no ready worker in the fleet view).
until [[ $(curl -s http://127.0.0.1:$PORT/v1/fleet | python3 -c 'import json,sys; f=json.load(sys.stdin); print(sum(1 for n in f["nodes"] if n["state"]=="up" for w in n["workers"] if w.get("health")=="ready"))') == 0 ]]; do sleep 1; done
echo "the pool is at zero"
COLD=$(ttft)
echo "request at zero: TTFT ${COLD} ms (engine $ENGINE)"
grep -o 'waited_ms=[0-9]*' "$WORK/up.log" | tail -1 || true
