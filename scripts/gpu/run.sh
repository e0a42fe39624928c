#!/usr/bin/env bash
# The GPU checks of issue 19 in one device call (the `run` tool; see /work/.library/device/README.md):
#   run(command="bash scripts/gpu/run.sh", carry=[".whl", ".gpu"])
# .whl: the wheels the device image lacks (pip download ... --python-version 3.12, listed in docs/gpu.md
# section "GPU"); .gpu/smol: SmolLM2-135M-Instruct's config and tokenizer (its weights are 538 MB, over the
# 64 MiB a call carries: the same architecture gets random weights there, which is what decode speed and
# equality with HF need). Results land in $OUT (gpu_bench.md, gpu_bench.json, pytest.log).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 - <<'PY'
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained(".gpu/smol")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
model.save_pretrained("/tmp/smol", safe_serialization=True)
for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
    shutil.copy(f".gpu/smol/{f}", "/tmp/smol/")
print("random-weight SmolLM2-135M at /tmp/smol")
PY
export MOTET_MODEL_DIR=/tmp/smol
# Kernels natively (no TRITON_INTERPRET), the engine on CUDA (device "auto"), LoRA, grammar, actors: the
# tests that need no network and no real weights' answers.
timeout ${SUITE_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m "not slow" --timeout 200 ${PYTEST_ARGS:-} \
  tests/kernels/test_paged_attention.py tests/kernels/test_sgmv.py tests/lora/test_lora_pool.py tests/engine/test_engine.py \
  tests/lora/test_lora_engine.py tests/engine/test_sampler.py tests/engine/test_scheduler.py tests/engine/test_block_manager.py \
  tests/actors/test_actors.py tests/lora/test_adapter_hardening.py tests/api/test_api_app.py tests/api/test_api_hardening.py tests/grammar/test_grammar.py \
  tests/kernels/test_fused_kernels.py tests/engine/test_cuda_graphs.py tests/engine/test_overlap_output.py tests/kernels/test_triton_moe.py \
  tests/kernels/test_triton_quant.py tests/engine/test_startup.py tests/kernels/test_latent_decode.py \
  tests/models/test_deepseek_graphs.py 2>&1 | tee "$OUT/pytest.log" | tail -40
timeout ${BENCH_TIMEOUT:-240} python3 -m benchmarks.gpu_bench --model-dir /tmp/smol --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -60
