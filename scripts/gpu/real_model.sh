#!/usr/bin/env bash
# The real SmolLM2-135M-Instruct on the GPU: greedy and mixed-adapter equality with HF / HF + PEFT on CUDA,
# a JSON-schema request, the real-model test files (motet serve answering the openai SDK among them), and
# eager vs CUDA-graph decode tokens/s with HF generate as the peer.
#
# Its weights (bf16, 269 MB; scripts/gpu/stage_weights.sh makes the parts) exceed what one call carries
# (64 MiB), so they travel in parts over consecutive calls to one warm machine (it keeps /tmp for 30 s
# after a call):
#   run(command="mkdir -p /tmp/wparts && cp .wp0/part0 /tmp/wparts/", carry=[".wp0"])   # likewise 1..4
#   run(command="bash scripts/gpu/real_model.sh", carry=[".whl", ".whl2", ".gpu", ".wp5"], timeout_s=600)
# .whl: the wheels run.sh installs; .whl2: openai and its needs (openai, httpx2, httpcore2, truststore,
# jiter, distro, sniffio). Results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ ! -d /tmp/site/xgrammar ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site2 .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD PYTHONUNBUFFERED=1
export MOTET_CACHE_DIR=/tmp/motet-cache   # the model store finds the default model there: no pull
M=$MOTET_CACHE_DIR/models/SmolLM2-135M-Instruct
mkdir -p "$M"
cat /tmp/wparts/part0 /tmp/wparts/part1 /tmp/wparts/part2 /tmp/wparts/part3 /tmp/wparts/part4 .wp5/part5 > "$M/model.safetensors" || exit 1
echo "$(cut -d' ' -f1 .wp5/model.sha256)  $M/model.safetensors" | sha256sum -c || exit 1
cp .gpu/smol/*.json "$M/"
echo '{"source": "bf16 copy staged by scripts/gpu/real_model.sh", "format": 1}' > "$M/.motet-complete"
export MOTET_MODEL_DIR=$M
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== real checks"; timeout ${CHECKS_TIMEOUT:-150} python3 scripts/gpu/real_checks.py --model-dir "$M" --out "$OUT" 2>&1 | grep -v "Loading weights" | tail -20
echo "== decode bench"; timeout ${BENCH_TIMEOUT:-170} python3 scripts/gpu/decode_graphs.py --model-dir "$M" --out "$OUT" ${GRAPH_ARGS:-} 2>&1 | grep -v "Loading weights" | grep -v "^ \|^---\|Self \|Name " | tail -30
echo "== real-model tests"; timeout ${TEST_TIMEOUT:-230} python3 -m pytest -q -p no:cacheprovider --timeout 200 ${REAL_TESTS:-tests/engine/test_cuda_graphs.py tests/engine/test_engine_real.py tests/api/test_api.py tests/grammar/test_structured_engine.py} 2>&1 | tee "$OUT/real_pytest.log" | tail -25
