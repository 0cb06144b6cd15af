#!/usr/bin/env bash
# Fetch NVRTC (NVIDIA's run-time CUDA compiler) once, so that the CUDA kernels
# (src/kernels/cuda/kernels.cu) compile to PTX in the tests on machines without a GPU or a CUDA
# install: NVRTC needs no driver and no device.
# Source: the PyPI wheel nvidia-cuda-nvrtc-cu12==12.8.93 (CUDA 12.8, the version cudarc is built
# against: feature cuda-12080). Its two libraries are checked by sha256 and cached under
# ${XDG_CACHE_HOME:-~/.cache}/flotilla/nvrtc-12.8.93; the folder is printed on stdout (for
# LD_LIBRARY_PATH; libnvrtc finds its builtins beside itself through RUNPATH $ORIGIN).
set -euo pipefail
version="12.8.93"
dir="${XDG_CACHE_HOME:-$HOME/.cache}/flotilla/nvrtc-$version"
sums="43731e24cd89e3749826304f304e8aa11fbecf1188715271b1f5018d6212b5e6  libnvrtc.so.12
eccaa824230ee7858a94a3055cb01f1cb634df05d313880d0bdcf195161fcb4e  libnvrtc-builtins.so.12.8"

ok() { [ -d "$dir" ] && (cd "$dir" && echo "$sums" | sha256sum -c --quiet - >/dev/null 2>&1); }

if ! ok; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching NVRTC (nvidia-cuda-nvrtc-cu12==$version from PyPI, ~90 MB)…" >&2
  python3 -m pip download --quiet --no-deps --only-binary :all: \
    "nvidia-cuda-nvrtc-cu12==$version" -d "$tmp" >&2
  python3 - "$tmp" "$tmp/lib" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/nvidia_cuda_nvrtc_cu12-*.whl")[0]
os.makedirs(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    for name in ("libnvrtc.so.12", "libnvrtc-builtins.so.12.8"):
        with open(os.path.join(sys.argv[2], name), "wb") as out:
            out.write(z.read("nvidia/cuda_nvrtc/lib/" + name))
PY
  if ! (cd "$tmp/lib" && echo "$sums" | sha256sum -c --quiet -); then
    echo "error: the NVRTC libraries do not match their sha256" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$dir")"
  rm -rf "$dir"
  mv "$tmp/lib" "$dir"
  echo "NVRTC ready: $dir" >&2
fi
echo "$dir"
