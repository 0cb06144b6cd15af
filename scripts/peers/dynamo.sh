#!/usr/bin/env bash
# NVIDIA Dynamo 1.6.1 on loopback, as a peer for side-by-side benchmarks: its OpenAI frontend
# and KV router over its GPU-free "mocker" engine (the same vLLM-on-H100 timing fit as
# Flotilla's sim engine). No GPU, etcd or NATS: file discovery, TCP request plane, ZMQ events.
#
#   scripts/peers/dynamo.sh setup                          # venv + model folder, ~1 min, 0.7 GB
#   scripts/peers/dynamo.sh start MODE PORT WORKERS [mocker args]   # MODE: kv | round-robin | random
#     (DYN_FRONTEND_ARGS: extra frontend flags, e.g. "--router-policy-config FILE")
#   scripts/peers/dynamo.sh stop
#
# Mocker args worth setting for a fair comparison: --block-size 16 (its default is 64),
# --num-gpu-blocks-override N, --max-num-batched-tokens, --max-num-seqs, --speedup-ratio X
# (Flotilla's worker.sim_speedup; 0 is not "infinitely fast").
# Files live in $FLOTILLA_PEERS/dynamo (default ~/.cache/flotilla-peers/dynamo).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
DIR=${FLOTILLA_PEERS:-${XDG_CACHE_HOME:-$HOME/.cache}/flotilla-peers}/dynamo
GGUF=${FLOTILLA_MODEL:-$ROOT/models/smollm2-135m-instruct-q4_1.gguf}

env_vars() {
  export DYN_DISCOVERY_BACKEND=file DYN_FILE_KV=$DIR/kvstore
  export DYN_REQUEST_PLANE=tcp DYN_EVENT_PLANE=zmq
  export DYN_TCP_RPC_HOST=127.0.0.1 DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1
  export DYN_EVENT_PLANE_HOST=127.0.0.1 DYN_SYSTEM_HOST=127.0.0.1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DYN_LOG=${DYN_LOG:-warn}
}

case ${1:-} in
  setup)
    mkdir -p "$DIR"/{logs,kvstore,model}
    [[ -x $DIR/venv/bin/python ]] || python3 -m venv "$DIR/venv"
    # ai-dynamo's declared dependency aisimulate 0.13.0 downloads from a host outside the
    # package index (it serves only the planner and replay extras): install without
    # dependencies, then the ones the frontend and mocker import.
    "$DIR/venv/bin/pip" install -q --no-deps ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
    "$DIR/venv/bin/pip" install -q 'aiohttp>=3.14.3,<4' 'msgspec>=0.19' \
      'prometheus-client>=0.23.1,<1' 'pyzmq>=26' 'tqdm>=4' 'transformers>=4.56' \
      'typing-extensions>=4.10' 'zstandard>=0.23,<1' 'pydantic>=2.10.6,<=2.13.5' \
      'uvloop>=0.21' 'certifi>=2026.10.19' 'kubernetes>=32.0.1,<33' 'redis>=6.2,<9' \
      gguf tokenizers
    "$DIR/venv/bin/python" "$HERE/model_card.py" "$GGUF" "$DIR/model/smollm2"
    echo "ready: $0 start kv 18090 4 --block-size 16"
    ;;
  start)
    mode=${2:?mode}; port=${3:?port}; n=${4:?workers}; shift 4
    [[ -x $DIR/venv/bin/python ]] || { echo "run $0 setup first" >&2; exit 1; }
    env_vars
    if curl -sf "127.0.0.1:$port/v1/models" > /dev/null 2>&1; then
      echo "port $port already answers: stop what runs there first ($0 stop)" >&2; exit 1
    fi
    rm -rf "$DIR/kvstore" && mkdir -p "$DIR/kvstore" "$DIR/logs"
    cd "$DIR"
    # shellcheck disable=SC2086
    nohup venv/bin/python -m dynamo.frontend --router-mode "$mode" --http-host 127.0.0.1 \
      --http-port "$port" --discovery-backend file ${DYN_FRONTEND_ARGS:-} > logs/frontend.log 2>&1 &
    echo $! > frontend.pid
    nohup venv/bin/python -m dynamo.mocker --model-path "$DIR/model/smollm2" \
      --model-name smollm2 --discovery-backend file --num-workers "$n" "$@" \
      > logs/mocker.log 2>&1 &
    echo $! > mocker.pid
    # Registration takes several seconds; wait until the model is listed.
    for _ in $(seq 120); do
      curl -sf "127.0.0.1:$port/v1/models" | grep -q smollm2 && { echo "dynamo: http://127.0.0.1:$port (model smollm2)"; exit 0; }
      sleep 1
    done
    echo "dynamo did not come up; see $DIR/logs" >&2; exit 1
    ;;
  stop)
    # SIGTERM, then wait up to 30 s for both to exit (the port must be free for the next
    # start), then SIGKILL.
    pids=()
    for p in frontend mocker; do
      [[ -f $DIR/$p.pid ]] && pids+=("$(cat "$DIR/$p.pid")")
      rm -f "$DIR/$p.pid"
    done
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
      for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -9 "$pid" 2>/dev/null || true
    done
    ;;
  *) sed -n 2,13p "$0"; exit 2 ;;
esac
