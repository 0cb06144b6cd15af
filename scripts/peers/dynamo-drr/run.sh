#!/usr/bin/env bash
# NVIDIA Dynamo 1.6.1's own priority-class DRR (its KV router's policy-class queues,
# `--router-policy-config`) on the burst of docs/benchmarks.md, "Priority classes": one mocker
# worker (block size 16), the burst from burst.py, its per-request results and /metrics kept.
# usage: run.sh PORT SPEEDUP N [POLICY_YAML]      (after scripts/peers/dynamo.sh setup)
#   env: OUT (default /tmp/dynamo_drr), BURST_ARGS (e.g. "--classes gold,silver,bronze")
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DIR=${FLOTILLA_PEERS:-${XDG_CACHE_HOME:-$HOME/.cache}/flotilla-peers}/dynamo
OUT=${OUT:-/tmp/dynamo_drr}; mkdir -p "$OUT"
port=${1:?port}; speed=${2:?speedup}; n=${3:?requests}; pol=${4:-$HERE/policy_2class_thr1024.yaml}
pol=$(cd "$(dirname "$pol")" && pwd)/$(basename "$pol")
tag=s${speed}_n${n}_$(basename "$pol" .yaml)
DYN_FRONTEND_ARGS="--router-policy-config $pol" "$HERE/../dynamo.sh" start kv "$port" 1 \
  --block-size 16 --num-gpu-blocks-override 28672 --max-num-seqs 64 \
  --max-num-batched-tokens 512 --speedup-ratio "$speed"
trap '"$HERE/../dynamo.sh" stop' EXIT
# shellcheck disable=SC2086
"$DIR/venv/bin/python" "$HERE/burst.py" "http://127.0.0.1:$port/v1/completions" "$n" \
  ${BURST_ARGS:-} --json "$OUT/result_$tag.json"
curl -s "127.0.0.1:$port/metrics" | grep -E "queue|policy_class" | grep -v "^#" \
  > "$OUT/metrics_$tag.txt" || true
