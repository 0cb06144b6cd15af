# Shared by the bench scripts (source it): a Flotilla fleet started in the background as $UP.
#   wait_fleet GATEWAY WORKERS LOG [SECONDS]   wait until WORKERS workers are up (exit 1 if the
#                                              fleet dies or the time runs out)
#   stop_fleet                                 SIGTERM $UP and wait for it
#   fleet_faces GATEWAY                        one "http://FACE=KV_EVENTS" line per worker
#   start_sim_fleet [UP_FLAGS…]                a fleet of $WORKERS sim workers on 2 worker nodes
#                                              for the routing benchmarks, gateway $FGW, log in
#                                              $OUT/flotilla.up.log (needs BIN FGW WORKERS
#                                              KV_BLOCKS SIM_SPEEDUP STALL_MS OUT; EXTRA: more
#                                              flags, e.g. --set pairs)
start_sim_fleet() {
  "$BIN" up --nodes 3 --engine sim --workers "$WORKERS" --http "$FGW" \
    --set worker.kv_blocks="$KV_BLOCKS" --set worker.max_num_batched_tokens=8192 \
    --set worker.max_num_seqs=256 --set worker.sim_speedup="$SIM_SPEEDUP" \
    --set scheduler.max_decode_stall_ms="$STALL_MS" \
    --set gateway.busy_kv_ratio=1.0 --set gateway.busy_waiting=1000000 ${EXTRA[@]+"${EXTRA[@]}"} "$@" \
    > "$OUT/flotilla.up.log" 2>&1 &
  UP=$!
  wait_fleet "$FGW" "$WORKERS" "$OUT/flotilla.up.log" 120
}
wait_fleet() {
  local gw=$1 want=$2 log=$3 n=0
  for _ in $(seq 1 "${4:-180}"); do
    n=$(curl -sf "http://$gw/v1/fleet" 2>/dev/null | python3 -c 'import json,sys; print(sum(len(n["workers"]) for n in json.load(sys.stdin)["nodes"] if n["state"] == "up"))' 2>/dev/null || echo 0)
    [ "$n" = "$want" ] && break; kill -0 "$UP" 2>/dev/null || break; sleep 1
  done
  if [ "$n" != "$want" ] || ! kill -0 "$UP" 2>/dev/null; then
    echo "the Flotilla fleet did not come up ($n of $want workers); see $log" >&2
    exit 1
  fi
}
stop_fleet() { [ -n "${UP:-}" ] && { kill -TERM "$UP" 2>/dev/null || true; wait "$UP" 2>/dev/null || true; }; UP=; }
fleet_faces() {
  curl -sf "http://$1/v1/fleet" | python3 -c '
import json, sys
for n in json.load(sys.stdin)["nodes"]:
    for w in n["workers"]:
        print("http://%s=%s" % (w["http_addr"], w["kv_events_endpoint"]))'
}
