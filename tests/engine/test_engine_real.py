"""The engine on the real default model (SmolLM2-135M-Instruct), against Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from tests.engine.test_engine import engine_logits

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain in one sentence what a CPU does.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.",
    "Why is the sky blue? Answer briefly, in simple words that a child would understand, "
    "and mention sunlight and the atmosphere.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What does HTTP stand for?",
    "Name a famous painting by Leonardo da Vinci.",
    "Write a Python function that reverses a string.",
    "How many legs does a spider have?",
    "Suggest a healthy breakfast.",
    "What is the boiling point of water at sea level in Celsius? Please also tell me the value in Fahrenheit "
    "and explain why the boiling point changes at high altitude, like on a mountain.",
]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), num_kv_blocks=2048, max_num_seqs=64)


def chat(llm, q):
    return llm.tokenizer.encode_chat([{"role": "user", "content": q}])


def test_greedy_batch_matches_hf_token_for_token(llm, default_hf_model):
    prompts = [chat(llm, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) > 8  # mixed lengths
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    for prompt, out in zip(prompts, outs, strict=True):
        ref = default_hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        assert out.token_ids == ref[0, len(prompt) :].tolist(), llm.tokenizer.decode(prompt)
    assert "paris" in outs[0].text.lower()


def test_batch_invariance_greedy_and_seeded(llm):
    prompts = [chat(llm, QUESTIONS[i % 16] + " " * (i // 16)) for i in range(32)]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    seeded = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=12) for i in range(32)]
    together = llm.generate(prompts + prompts, [greedy] * 32 + seeded)
    for i in range(0, 32, 3):  # a spread of the 32, alone
        (g,) = llm.generate([prompts[i]], greedy)
        (s,) = llm.generate([prompts[i]], seeded[i])
        assert g.token_ids == together[i].token_ids
        assert s.token_ids == together[32 + i].token_ids


def test_prefix_cache_hits_200_token_prefix(default_model_dir):
    llm = LLM(str(default_model_dir), num_kv_blocks=512)
    system = "You are a careful assistant. " + " ".join(
        f"Rule {i}: be concise and accurate." for i in range(30)
    )
    first = chat_with(llm, system, "What is the capital of Italy?")
    second = chat_with(llm, system, "What is the capital of Spain?")
    assert first[1] > 200
    params = SamplingParams(temperature=0, max_tokens=16)
    llm.generate([first[0]], params)
    (hit,) = llm.generate([second[0]], params)
    assert hit.num_cached_tokens >= 192
    (cold,) = LLM(str(default_model_dir), num_kv_blocks=512, enable_prefix_caching=False).generate(
        [second[0]], params
    )
    assert hit.token_ids == cold.token_ids


def chat_with(llm, system, q):
    ids = llm.tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
    return ids, len(ids)


def test_preemption_64_requests_in_a_small_pool(default_model_dir, llm):
    prompts = [chat(llm, QUESTIONS[i % 16] + f" (#{i})") for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=16)
    ample = llm.generate(prompts, params)
    blocks_per_req = -(-(max(map(len, prompts)) + 16) // 16)
    small = LLM(str(default_model_dir), num_kv_blocks=8 * blocks_per_req, max_num_seqs=64)
    tight = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert small.engine.block_manager.num_free_blocks == small.engine.block_manager.num_blocks


def test_chunked_prefill_2000_tokens(llm):
    text = " ".join(f"Sentence {i} talks about topic {i % 17} and number {i * 3}." for i in range(200))
    prompt = llm.tokenizer.encode(text)[:2000]
    assert len(prompt) == 2000
    (one,) = engine_logits(llm.engine, [prompt])
    (chunked,) = engine_logits(llm.engine, [prompt], chunk=256)
    # Tolerance: fp32, the same math in a different order (chunks see cached K/V instead of fresh ones).
    torch.testing.assert_close(chunked, one, atol=2e-3, rtol=1e-3)
    assert (chunked.argmax(-1) == one.argmax(-1)).float().mean() > 0.999
