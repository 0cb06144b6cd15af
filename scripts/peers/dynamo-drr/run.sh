#!/usr/bin/env bash
# NVIDIA Dynamo 1.6.1's own priority-class DRR (its KV router's policy-class queues) on the
# burst of docs/benchmarks.md, "Priority classes": starts its frontend (KV router, the policy
# file) and one mocker worker, sends the burst (burst.py), keeps its /metrics, stops both.
# Needs the peer installed: ../shared/peers/dynamo/setup.sh "$HOME/.cache/flotilla-peers/dynamo".
# usage: run.sh PORT SPEEDUP N [POLICY_YAML|none] [extra frontend args...]
#   env: OUT (default /tmp/dynamo_drr), BURST_ARGS (e.g. "--classes gold,silver,bronze"),
#        SHARED (default ../shared beside the repo)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SHARED=${SHARED:-$HERE/../../../../shared}
OUT=${OUT:-/tmp/dynamo_drr}; mkdir -p "$OUT"
port=$1; speed=$2; n=$3; pol=${4:-$HERE/policy_2class_thr1024.yaml}; shift 4 || true
[[ $pol != none ]] && pol=$(cd "$(dirname "$pol")" && pwd)/$(basename "$pol")
source "$SHARED/peers/dynamo/env.sh" "$HOME/.cache/flotilla-peers/dynamo"
cd "$DYN_DIR"; rm -rf kvstore/*; tag=p${port}_s${speed}_n${n}_$(basename "$pol" .yaml)
polargs=(); [[ $pol != none ]] && polargs=(--router-policy-config "$pol")
venv/bin/python -m dynamo.frontend --router-mode kv --http-host 127.0.0.1 --http-port "$port" \
  --discovery-backend file "${polargs[@]}" "$@" > "$OUT/frontend_$tag.log" 2>&1 &
fpid=$!
venv/bin/python -m dynamo.mocker --model-path "$DYN_DIR/model/smollm2-135m" --model-name smollm2 \
  --discovery-backend file --num-workers 1 --block-size 16 --num-gpu-blocks-override 28672 \
  --max-num-seqs 64 --max-num-batched-tokens 512 --speedup-ratio "$speed" \
  > "$OUT/mocker_$tag.log" 2>&1 &
mpid=$!
for _ in $(seq 60); do curl -sf "127.0.0.1:$port/v1/models" | grep -q smollm2 && break; sleep 1; done
sleep 3
# shellcheck disable=SC2086
venv/bin/python "$HERE/burst.py" "http://127.0.0.1:$port/v1/completions" "$n" ${BURST_ARGS:-} \
  --json "$OUT/result_$tag.json"
curl -s "127.0.0.1:$port/metrics" | grep -i -E "queue|policy_class" | grep -v "^#" > "$OUT/metrics_$tag.txt"
kill $fpid $mpid; wait $fpid $mpid 2>/dev/null
