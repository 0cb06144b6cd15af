#!/usr/bin/env bash
# Failover: what a control node's death or hang costs the requests going on around it
# (docs/benchmarks.md, "No single point of failure"). Nodes started by hand (`flotilla node`),
# sim engines:
#   gateways  : gw-0 and gw-1 (role gateway only), HTTP on $PORT and $PORT+1
#   routers   : router-a and router-b (role router only; a gateway asks one of them)
#   worker    : worker-0 with 4 sim replicas
# A client (4 threads, non-streamed 1-token chat requests back to back, each thread starting on
# its own gateway and moving to the other one when its gateway does not answer) runs through
# five faults: router-a killed (SIGKILL), then (router-a back) router-b killed, then each
# router hung (SIGSTOP: its connections stay open, only the liveness timeout tells; killed and
# restarted 6 s later), then gw-0 killed. Per fault, over the requests in flight at it or sent
# in the 6 s after it: how many were slowed past 100 ms and how many lost (failed on both
# gateways), the longest one, and when the last slowed one ended (the time until every
# request is served normally again; with none slowed, the first one served after the fault).
#
#   scripts/failover-bench.sh            # ~45 s
#
# Environment: FLOTILLA (binary, default $CARGO_TARGET_DIR/release/flotilla, else target/…),
# PORT (18400), CPORT (first cluster port, 17400), OUT (/tmp/failover-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FLOTILLA:-${CARGO_TARGET_DIR:-target}/release/flotilla}
PORT=${PORT:-18400}; CPORT=${CPORT:-17400}; OUT=${OUT:-/tmp/failover-bench}
mkdir -p "$OUT"
rm -f "$OUT"/*.log  # a node's log gathers its restarts within one run, not across runs
export FLOTILLA_NODE__COOKIE=failover-bench
SIM=(--set worker.engine=sim --set worker.sim_speedup=20)
declare -A PID
start() {  # NAME OFFSET ROLES [FLAGS…]
  local name=$1 off=$2 roles=$3; shift 3
  local join=(); [ "$off" = 0 ] || join=(--join "127.0.0.1:$CPORT")
  "$BIN" node --name "$name" --listen "127.0.0.1:$((CPORT + off))" --roles "$roles" \
    "${join[@]}" "${SIM[@]}" "$@" >> "$OUT/$name.log" 2>&1 &
  PID[$name]=$!
}
stop_all() { for p in "${PID[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap stop_all EXIT
routers_up() {  # wait until /v1/fleet on gw-0 or gw-1 lists N router nodes up
  for _ in $(seq 60); do
    for g in $PORT $((PORT + 1)); do
      n=$(curl -sf "127.0.0.1:$g/v1/fleet" 2>/dev/null | python3 -c 'import json,sys; print(sum(1 for n in json.load(sys.stdin)["nodes"] if n["state"] == "up" and "router" in n["roles"]))' 2>/dev/null || echo 0)
      [ "$n" = "$1" ] && return 0
    done
    sleep 0.5
  done
  echo "the fleet never showed $1 routers up" >&2; exit 1
}

start gw-0 0 gateway --http "127.0.0.1:$PORT"
start router-a 1 router
start router-b 2 router
start worker-0 3 worker --replicas 4
start gw-1 4 gateway --http "127.0.0.1:$((PORT + 1))"
for _ in $(seq 120); do
  n=$(curl -sf "127.0.0.1:$PORT/v1/fleet" 2>/dev/null | python3 -c 'import json,sys; print(sum(len(n["workers"]) for n in json.load(sys.stdin)["nodes"] if n["state"] == "up"))' 2>/dev/null || echo 0)
  [ "$n" = 4 ] && break; sleep 0.5
done
routers_up 2

# The client: runs until $OUT/stop exists; appends "start end ok gateway_index retried" lines.
rm -f "$OUT/stop" "$OUT/requests.txt" "$OUT/kills.txt"
MODEL_ID=$(curl -sf "127.0.0.1:$PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
python3 - "$PORT" "$OUT" "$MODEL_ID" <<'PY' &
import http.client, json, os, sys, threading, time
port, out, model = int(sys.argv[1]), sys.argv[2], sys.argv[3]
lock = threading.Lock()
rows = open(os.path.join(out, "requests.txt"), "w")
def send(g, i):
    c = http.client.HTTPConnection("127.0.0.1", port + g, timeout=30)
    body = json.dumps({"model": model, "max_tokens": 1,
                       "messages": [{"role": "user", "content": f"request {i}: say hi"}]})
    try:
        c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        r = c.getresponse(); r.read()
        return r.status == 200
    except Exception:
        return False
    finally:
        c.close()
def client(k):
    g, i = k % 2, 0
    while not os.path.exists(os.path.join(out, "stop")):
        i += 1
        t0 = time.time()
        ok = send(g, f"{k}.{i}")
        retried = 0
        if not ok:  # the other gateway, once
            g, retried = 1 - g, 1
            ok = send(g, f"{k}.{i}")
        with lock:
            rows.write(f"{t0:.6f} {time.time():.6f} {int(ok)} {g} {retried}\n"); rows.flush()
for t in [threading.Thread(target=client, args=(k,)) for k in range(4)]:
    t.start()
PY
CLIENT=$!
kill_node() {  # NAME: SIGKILL, note the time
  sleep 3
  echo "$1 $(date +%s.%N)" >> "$OUT/kills.txt"
  kill -9 "${PID[$1]}"; wait "${PID[$1]}" 2>/dev/null || true
}
hang_node() {  # NAME: SIGSTOP (a hung process: its sockets stay open), note the time; then
  # SIGKILL it once the others have had the liveness timeout and more to notice
  sleep 3
  echo "$1(hung) $(date +%s.%N)" >> "$OUT/kills.txt"
  kill -STOP "${PID[$1]}"; sleep 6
  kill -9 "${PID[$1]}"; wait "${PID[$1]}" 2>/dev/null || true
}
kill_node router-a
sleep 4; start router-a 1 router; routers_up 2
kill_node router-b
sleep 4; start router-b 2 router; routers_up 2
hang_node router-a
start router-a 1 router; routers_up 2
hang_node router-b
start router-b 2 router; routers_up 2
kill_node gw-0
sleep 4
touch "$OUT/stop"; wait $CLIENT || true

python3 - "$OUT" <<'PY'
import os, sys
out = sys.argv[1]
reqs = [tuple(map(float, l.split())) for l in open(os.path.join(out, "requests.txt"))]
kills = [(l.split()[0], float(l.split()[1])) for l in open(os.path.join(out, "kills.txt"))]
lat = sorted(r[1] - r[0] for r in reqs)
print(f"{len(reqs)} requests, {sum(1 for r in reqs if not r[2])} failed on both gateways; "
      f"latency p50 {lat[len(lat) // 2] * 1e3:.1f} ms, p99 {lat[int(len(lat) * 0.99)] * 1e3:.1f} ms")
print("| fault | requests slowed (> 100 ms) / lost | longest request (ms) | all served normally again after (ms) |")
print("|---|---:|---:|---:|")
for name, t in kills:
    # Requests that overlap the fault: in flight at it, or sent in the 6 s after it (the next
    # fault comes 7 s or more later).
    window = [r for r in reqs if r[1] >= t and r[0] <= t + 6]
    slowed = [r for r in window if r[1] - r[0] > 0.1]
    lost = [r for r in window if not r[2]]
    longest = max((r[1] - r[0] for r in window), default=0.0)
    # The end of the last slowed or lost request; none: the first request served after.
    hit = slowed + lost
    again = max(r[1] for r in hit) - t if hit else min(r[1] for r in window if r[2]) - t
    label = name.replace("(hung)", " hung (SIGSTOP)") if "(hung)" in name else f"{name} killed (SIGKILL)"
    print(f"| {label} | {len(slowed)} / {len(lost)} | {longest * 1e3:.0f} | {again * 1e3:.0f} |")
PY
