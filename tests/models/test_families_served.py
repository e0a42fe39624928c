"""Every family served over HTTP as a tenant uses it: `motet serve` on a tiny random checkpoint of the family
(uvicorn on a loopback port), a PEFT adapter uploaded through `POST /v1/adapters`, and greedy text completions
through the OpenAI SDK on the base model and on the adapter, equal to transformers' and PEFT's greedy
continuation of the same prompt tokens."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from tests.engine.test_engine import PROMPTS
from tests.live_server import ThreadServer
from tests.models.test_gpt_oss import build_gpt_oss
from tests.models.test_model_declarations import FAMILIES
from tests.models.test_moe import MOE_MODELS, randomize_norms
from tests.peft_adapters import peft_reference, save_peft_adapters
from tests.tiny_models import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

ATTENTION = ["q_proj", "v_proj"]
# family -> (tiny_models arch, overrides, the adapter's targets by PEFT's names)
SERVED = {
    "llama": ("llama", {}, ATTENTION + ["down_proj"]),
    "mistral": ("mistral", {"sliding_window": 12}, ATTENTION),  # prompts and answers run past the window
    "qwen2": ("qwen2", {}, ATTENTION),
    **{name: (arch, overrides, attn + mlp) for name, (arch, overrides, (attn, mlp)) in FAMILIES.items()},
    "mixtral": (*MOE_MODELS["mixtral"], ATTENTION),  # experts: attention adapters only
    "qwen2_moe": (*MOE_MODELS["qwen2_moe"], ATTENTION),  # its shared expert and gate
    "qwen3_moe": (*MOE_MODELS["qwen3_moe"], ATTENTION),
    "gpt_oss": ("gpt_oss", None, ATTENTION),
}
NEW_TOKENS = 8


@pytest.mark.parametrize("family", list(SERVED))
def test_family_served_over_http_matches_transformers_and_peft(family, tmp_path):
    arch, overrides, targets = SERVED[family]
    if arch == "gpt_oss":
        model_dir = build_gpt_oss(tmp_path / "model")
    else:
        model_dir = build_tiny_model(tmp_path / "model", arch=arch, tied=False, **overrides)
        randomize_norms(model_dir)
    peft = save_peft_adapters(model_dir, tmp_path / "adapters", [("tenant", 8, targets)], std=0.1)
    server = ThreadServer(  # float32: greedy tokens equal to transformers' fp32 model's (bf16 parts at near-ties)
        "--model", str(model_dir), "--data-dir", str(tmp_path / "data"), "--num-kv-blocks", "128", "--block-size", "8",
        "--dtype", "float32",
    )  # fmt: skip
    try:
        adapter = tmp_path / "adapters" / "tenant"
        files = [
            ("files", (f.name, f.read_bytes()))
            for f in sorted(adapter.iterdir())
            if f.suffix in (".json", ".safetensors")
        ]
        r = httpx.post(f"{server.url}/v1/adapters", data={"name": "tenant"}, files=files, timeout=60)
        assert r.status_code == 200, r.text
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none")
        served = client.models.list().data[0].id
        for prompt in (PROMPTS[1], PROMPTS[4]):
            for model, adapter_name in ((served, None), ("tenant", "tenant")):
                out = client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=NEW_TOKENS,
                    temperature=0,
                    extra_body={"min_tokens": NEW_TOKENS, "return_token_ids": True},
                )
                expected = peft_reference(peft, adapter_name, prompt, NEW_TOKENS)[0][len(prompt) :]
                assert out.choices[0].model_extra["token_ids"] == expected, (family, model)
                assert out.usage.completion_tokens == NEW_TOKENS
    finally:
        server.stop()
