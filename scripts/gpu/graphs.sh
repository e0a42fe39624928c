#!/usr/bin/env bash
# CUDA graphs for decode (motet/engine/worker/cuda_graphs.py): the GPU tests, then eager vs graphs tokens/s with HF
# generate as the peer, in one device call (after scripts/gpu/run.sh on the same warm machine, or alone):
#   run(command="bash scripts/gpu/graphs.sh", carry=[".whl", ".gpu"])
# Results land in $OUT: graphs_pytest.log, decode_graphs.{json,md}, profile_b1_*.txt.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -d /tmp/site/xgrammar ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
MODEL=${MOTET_MODEL_DIR:-/tmp/smol}
if [ ! -f "$MODEL/model.safetensors" ]; then  # SmolLM2-135M's architecture, random weights (as run.sh)
python3 - "$MODEL" <<'PY'
import shutil, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
out = sys.argv[1]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(".gpu/smol"), dtype=torch.float32).save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
    shutil.copy(f".gpu/smol/{f}", out)
PY
fi
timeout ${GRAPH_TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --timeout 120 tests/engine/test_cuda_graphs.py \
  tests/kernels/test_paged_attention.py -k "write or graph or bucket" 2>&1 | tee "$OUT/graphs_pytest.log" | tail -15
timeout ${GRAPH_BENCH_TIMEOUT:-300} python3 scripts/gpu/decode_graphs.py --model-dir "$MODEL" --out "$OUT" ${GRAPH_ARGS:-} 2>&1 | tail -70
