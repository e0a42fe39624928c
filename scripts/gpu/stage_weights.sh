#!/usr/bin/env bash
# Here (not on the device): the default model's weights as bf16 safetensors split into parts that each fit
# one device call beside the working tree: .wp0/part0 .. .wp4/part4 (48 MiB), .wp5/part5 + model.sha256.
# The folders are ignored (.git/info/exclude: /.wp*/). scripts/gpu/real_model.sh says how they travel.
set -euo pipefail
SRC=${1:-$HOME/.cache/motet/models/SmolLM2-135M-Instruct}
TMP=$(mktemp -d)
python3 - "$SRC/model.safetensors" "$TMP/model.safetensors" <<'PY'
import sys, torch
from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1])
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}, sys.argv[2], metadata={"format": "pt"})
PY
(cd "$TMP" && sha256sum model.safetensors > model.sha256 && split -b 48M -d -a 1 model.safetensors part)
for i in 0 1 2 3 4 5; do rm -rf ".wp$i"; mkdir -p ".wp$i"; mv "$TMP/part$i" ".wp$i/"; done
mv "$TMP/model.sha256" .wp5/
rm -rf "$TMP"
grep -q '^/.wp\*/$' .git/info/exclude || echo '/.wp*/' >> .git/info/exclude
du -sh .wp*
