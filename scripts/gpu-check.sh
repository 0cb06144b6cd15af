#!/usr/bin/env bash
# The GPU device check (issue 14), prepared here and run on a lent GPU machine in two calls.
#
# A device call carries at most 64 MiB of working tree and the machine has no network, while
# the default model alone is 98 MB: so `prepare` splits it in two, and the first call only
# parks part A in the machine's /tmp (a machine stays warm for 30 s after a call, so the second
# call must follow at once). The binary travels gzipped; the kernels travel as PTX compiled
# here by NVRTC 12.8 (the driver JIT-compiles PTX, so the GPU machine needs no NVRTC); cuBLAS
# is taken from the machine when one loads (else prefill products run as GEMVs, and the
# output says so).
#
#   scripts/gpu-check.sh prepare     # here: release build, PTX, model parts into gpu-check/
#   device call 1 (carry gpu-check/a):  scripts/gpu-check.sh stage
#   device call 2 (carry gpu-check/b):  scripts/gpu-check.sh run
#
# On a machine of your own with a GPU, run the three steps there, one after the other (or
# simply `flotilla cuda --check --bench` from a build with NVRTC on LD_LIBRARY_PATH).
#
# `run` prints (and writes to $OUT/gpu-check.txt): which libraries load, the golden cases on
# the GPU (greedy ids exact and top-5 logits within 2e-2 with f32 products; the bf16 error),
# a 64-sequence batch against solo runs, a KV handoff through the transport (the GPU pool
# staged through host memory: GPU → GPU and GPU → CPU, greedy tokens equal), and the
# throughput table (device-to-device copy
# bandwidth, prefill 512 tokens/s, decode tokens/s at batch 1, 8, 32, 128, GPU and CPU
# engines in the same run). It exits non-zero when a check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
model="models/smollm2-135m-instruct-q4_1.gguf"
sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
stage_dir="/tmp/flotilla-gpu-check"

case "${1:-}" in
prepare)
  scripts/deps.sh
  scripts/fetch-model.sh
  nvrtc="$(scripts/fetch-nvrtc.sh)"
  cargo build --release
  bin="${CARGO_TARGET_DIR:-target}/release/flotilla"
  grep -qx '/gpu-check/' .git/info/exclude 2>/dev/null || echo '/gpu-check/' >>.git/info/exclude
  rm -rf gpu-check && mkdir -p gpu-check/a gpu-check/b/ptx
  LD_LIBRARY_PATH="$nvrtc" "$bin" cuda --arch sm_90 --ptx-out gpu-check/b/ptx
  strip -o gpu-check/b/flotilla "$bin"
  gzip -9 gpu-check/b/flotilla
  head -c 56000000 "$model" >gpu-check/a/model.part-a
  tail -c +56000001 "$model" >gpu-check/b/model.part-b
  du -sh gpu-check/a gpu-check/b
  echo "ready: call 1 carries gpu-check/a and runs 'scripts/gpu-check.sh stage';"
  echo "       call 2, at once, carries gpu-check/b and runs 'scripts/gpu-check.sh run'"
  ;;
stage)
  test -f gpu-check/a/model.part-a || { echo "no gpu-check/a: run 'prepare' first (and carry gpu-check/a)" >&2; exit 1; }
  mkdir -p "$stage_dir"
  cp gpu-check/a/model.part-a "$stage_dir/"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  ls -la "$stage_dir"
  ;;
run)
  out="${OUT:-/tmp}"
  test -f "$stage_dir/model.part-a" || { echo "part A is not staged: run 'stage' first (same machine)" >&2; exit 1; }
  cat "$stage_dir/model.part-a" gpu-check/b/model.part-b >"$stage_dir/model.gguf"
  echo "$sha  $stage_dir/model.gguf" | sha256sum -c -
  gunzip -c gpu-check/b/flotilla.gz >"$stage_dir/flotilla" && chmod +x "$stage_dir/flotilla"
  # cudarc 0.19 looks for libcublas.so / libcublas.so.12 by name: link whatever this machine
  # ships (CUDA 13 here: libcublas.so.13, its Lt beside it) under the unversioned name.
  libs="$stage_dir/lib"; mkdir -p "$libs"
  for name in cublas cublasLt; do
    found="$(find /usr/local /opt /usr/lib /usr/lib64 -name "lib$name.so*" -type f 2>/dev/null | sort | head -n 1)"
    if [ -n "$found" ]; then
      ln -sf "$found" "$libs/lib$name.so"
      echo "lib$name: $found"
    else
      echo "lib$name: not found (prefill products will run as GEMVs)"
    fi
  done
  export LD_LIBRARY_PATH="$libs:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export FLOTILLA_CUDA_PTX_DIR="$PWD/gpu-check/b/ptx" RUST_LOG=info
  set -o pipefail
  "$stage_dir/flotilla" cuda --check --bench \
    --model "$stage_dir/model.gguf" --golden tests/data/smollm2-golden.json 2>&1 \
    | tee "$out/gpu-check.txt"
  ;;
*)
  sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'
  exit 2
  ;;
esac
