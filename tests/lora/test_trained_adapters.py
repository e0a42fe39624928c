"""The committed trained adapters (tests/fixtures/adapters/{upper,json}, from motet/evals/train_adapters.py) on
the real default model: motet serves them with the behaviour they were trained for, on held-out prompts,
while the base model does not have it; and motet's logits with each adapter are HF transformers + PEFT's.
"""

from __future__ import annotations

import pytest
import torch

from motet.evals.train_adapters import CHECKS, FIXTURES, behaviour, offline_generate, prompts
from tests.engine.test_engine import engine_logits

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

ADAPTERS = {check: FIXTURES / check for check in CHECKS}


@pytest.fixture(scope="module")
def llm(default_model_dir):
    from motet.engine.llm import LLM

    llm = LLM(str(default_model_dir), num_threads=1)  # one thread: robust on a shared CPU
    for name, path in ADAPTERS.items():
        llm.add_lora(name, path)
    return llm


def test_fixtures_are_small_peft_safetensors():
    for path in ADAPTERS.values():
        assert (path / "adapter_config.json").is_file()
        assert (path / "adapter_model.safetensors").stat().st_size < 6 << 20  # a few MB: fine to commit


def test_adapters_change_behaviour_and_base_does_not(llm):
    held_out = prompts("eval")[:16]
    assert not set(held_out) & set(prompts("train"))
    result = behaviour(offline_generate(llm), held_out, {check: check for check in CHECKS})
    for check, r in result.items():
        # measured on 64 held-out prompts: upper 0.84 (it misses words copied from the prompt), json 0.97
        assert r["adapter_rate"] >= 0.75, (check, r["failures"])
        assert r["base_rate"] <= 0.1, (check, r["examples"])


def test_logits_match_peft(llm, default_model_dir):
    from transformers import AutoModelForCausalLM

    from motet.evals.lora_reference import peft_model

    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": prompts("eval")[0]}])
    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    peft = peft_model(base, ADAPTERS).eval()
    for name in ADAPTERS:
        peft.set_adapter(name)
        with torch.no_grad():
            want = peft(torch.tensor([prompt])).logits[0]
        (got,) = engine_logits(llm.engine, [prompt], adapters=[name])
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
        with torch.no_grad(), peft.disable_adapter():  # and the adapter matters at this scale
            assert (peft(torch.tensor([prompt])).logits[0] - want).abs().max() > 0.1
