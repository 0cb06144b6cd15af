#!/usr/bin/env bash
# SGLang's and vLLM's routers on loopback, as peers for side-by-side benchmarks, in front of
# Flotilla workers' own OpenAI faces (worker.http; request_plane/gateway/face.rs). Both are
# Rust routers shipped as Python wheels; no GPU, no model download.
#
#   scripts/peers/routers.sh setup                         # two venvs, ~1 min, 0.3 GB
#   scripts/peers/routers.sh start sglang PORT POLICY URL…  # sglang-router 0.3.2 (cache_aware, round_robin, …)
#   scripts/peers/routers.sh start vllm PORT POLICY URL[=KV_EVENTS]…
#                                                          # vllm-router 0.1.17 (kv_aware, cache_aware, …);
#                                                          # URL=tcp://… names the worker's ZMQ KV events
#                                                          # (worker.kv_events_addr) for kv_aware
#   scripts/peers/routers.sh stop                          # every router started (several may run
#                                                          # at once, on different ports)
#
# What they need of a worker (and the faces serve): GET /health, the OpenAI routes, and for
# vllm-router's cache_aware/kv_aware POST /v1/{chat/,}completions/render → {"token_ids"};
# kv_aware also hashes the token ids of vLLM-format BlockStored events to follow each cache.
# Metrics ports are set explicitly (both default to 29000). Files live in
# $FLOTILLA_PEERS/{sglang,vllm-router} (default ~/.cache/flotilla-peers).
set -euo pipefail
PEERS_DIR=${FLOTILLA_PEERS:-${XDG_CACHE_HOME:-$HOME/.cache}/flotilla-peers}
MODEL_NAME=${MODEL_NAME:-smollm2-135m-instruct-q4_1}

venv() { echo "$PEERS_DIR/$1/venv"; }

case ${1:-} in
  setup)
    for p in "sglang sglang-router==0.3.2" "vllm-router vllm-router==0.1.17"; do
      set -- $p
      [[ -x $(venv "$1")/bin/python ]] || python3 -m venv "$(venv "$1")"
      "$(venv "$1")/bin/pip" install -q --only-binary :all: "$2"
    done
    echo "ready: $0 start sglang 18100 cache_aware http://127.0.0.1:PORT …"
    ;;
  start)
    which=${2:?sglang or vllm}; port=${3:?port}; policy=${4:?policy}; shift 4
    [[ $# -gt 0 ]] || { echo "no worker URLs" >&2; exit 1; }
    mport=$((port + 1))
    case $which in
      sglang)
        dir=$PEERS_DIR/sglang
        urls=(); for w in "$@"; do urls+=("${w%%=*}"); done
        [[ -x $dir/venv/bin/python ]] || { echo "run $0 setup first" >&2; exit 1; }
        mkdir -p "$dir/logs"
        nohup "$dir/venv/bin/python" -m sglang_router.launch_router --host 127.0.0.1 \
          --port "$port" --prometheus-host 127.0.0.1 --prometheus-port "$mport" \
          --policy "$policy" --worker-urls "${urls[@]}" --log-level warn \
          > "$dir/logs/router-$port.log" 2>&1 &
        echo $! > "$dir/router-$port.pid"
        # Workers register asynchronously: wait until every one is listed.
        for _ in $(seq 60); do
          n=$(curl -sf "127.0.0.1:$port/workers" 2>/dev/null | python3 -c \
            'import json,sys; d=json.load(sys.stdin); w=d.get("workers", d) if isinstance(d, dict) else d; print(len(w))' 2>/dev/null || echo 0)
          [[ $n == "${#urls[@]}" ]] && { echo "sglang-router: http://127.0.0.1:$port ($policy, $n workers)"; exit 0; }
          sleep 1
        done
        echo "sglang-router did not register its workers; see $dir/logs/router-$port.log" >&2; exit 1
        ;;
      vllm)
        dir=$PEERS_DIR/vllm-router
        [[ -x $dir/venv/bin/vllm-router ]] || { echo "run $0 setup first" >&2; exit 1; }
        urls=(); kv=()
        for w in "$@"; do
          urls+=("${w%%=*}")
          [[ $w == *=* ]] && kv+=(--kv-event-source "$w")
        done
        if [[ ${#kv[@]} -gt 0 ]]; then
          kv+=(--kv-event-model "$MODEL_NAME" --kv-event-block-size "${BLOCK_SIZE:-16}")
        fi
        mkdir -p "$dir/logs"
        nohup "$dir/venv/bin/vllm-router" --host 127.0.0.1 --port "$port" \
          --prometheus-host 127.0.0.1 --prometheus-port "$mport" --policy "$policy" \
          --worker-urls "${urls[@]}" "${kv[@]}" --log-level warning \
          > "$dir/logs/router-$port.log" 2>&1 &
        echo $! > "$dir/router-$port.pid"
        # It blocks until every worker answers /health, then serves.
        for _ in $(seq 60); do
          curl -sf "127.0.0.1:$port/health" > /dev/null 2>&1 &&
            { echo "vllm-router: http://127.0.0.1:$port ($policy, ${#urls[@]} workers)"; exit 0; }
          sleep 1
        done
        echo "vllm-router did not come up; see $dir/logs/router-$port.log" >&2; exit 1
        ;;
      *) echo "start sglang|vllm …" >&2; exit 2 ;;
    esac
    ;;
  stop)
    for d in sglang vllm-router; do
      for f in "$PEERS_DIR/$d"/router*.pid; do
        [[ -f $f ]] || continue
        pid=$(cat "$f"); rm -f "$f"
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -9 "$pid" 2>/dev/null || true
      done
    done
    ;;
  *)
    sed -n '2,18p' "$0"; exit 2 ;;
esac
