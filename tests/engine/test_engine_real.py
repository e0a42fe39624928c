"""The engine on the real default model (SmolLM2-135M-Instruct), against Hugging Face transformers."""

from __future__ import annotations

import math
from pathlib import Path

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
    # (outputs not overlapped: the default path where the step has every core; scripts/test.sh runs one thread)
    return LLM(str(default_model_dir), num_kv_blocks=2048, max_num_seqs=64, overlap_output="off")


def chat(llm, q):
    return llm.tokenizer.encode_chat([{"role": "user", "content": q}])


def test_greedy_batch_matches_hf_token_for_token(llm, default_hf_model):
    """The batch's greedy answers are HF's: each token is the argmax of HF's fp32 logits after the prompt and the
    answer's tokens before it (teacher-forced: one HF forward an answer, where HF's own generate took a forward a
    token; equal argmaxes at every position are HF's greedy answer, token for token). A tie within 1e-4 may go
    either way: the same math in another order."""
    prompts = [chat(llm, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) > 8  # mixed lengths
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32))
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 32 or out.token_ids[-1] in llm.engine.eos_token_ids  # (HF stops too)
        with torch.no_grad():
            logits = default_hf_model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (chosen >= logits.max(-1).values - 1e-4).all(), llm.tokenizer.decode(prompt)
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


def test_the_default_models_sampling_defaults_end_the_readmes_question(llm, default_model_dir):
    """Issue 57: with the default model's sampling defaults (its generation_config.json, which the server gives a
    request that omits them: temperature 0.2 and top_p 0.9 then) the README's first question went on for a third of
    the seeds ("L'Étoile, la Marseillaise, la femme, la femme, ...") to the end of the context. Its defaults bound an
    answer, and every seed's answer to that question ends (the model's end of turn)."""
    from motet.api.generation_config import sampling_defaults

    defaults = sampling_defaults("auto", default_model_dir)
    assert (
        0 < defaults.get("max_tokens", 0) < 8192
    )  # a request without max_tokens ends before the context does
    question = [{"role": "user", "content": QUESTIONS[0]}]
    outs = llm.chat([question] * 24, [SamplingParams(**defaults, seed=s) for s in range(24)])
    assert [o.finish_reason for o in outs] == ["stop"] * 24, [o.text[:80] for o in outs]
    assert sum("paris" in o.text.lower() for o in outs) > 12


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


def test_chunked_prefill_1000_tokens(llm):
    text = " ".join(f"Sentence {i} talks about topic {i % 17} and number {i * 3}." for i in range(100))
    prompt = llm.tokenizer.encode(text)[:1000]
    assert len(prompt) == 1000
    (one,) = engine_logits(llm.engine, [prompt])
    (chunked,) = engine_logits(llm.engine, [prompt], chunk=192)  # (1000 = 5 x 192 + 40)
    # Tolerance: fp32, the same math in a different order (chunks see cached K/V instead of fresh ones).
    torch.testing.assert_close(chunked, one, atol=2e-3, rtol=1e-3)
    assert (chunked.argmax(-1) == one.argmax(-1)).float().mean() > 0.999


TEXT = Path(__file__).parents[2] / "benchmarks" / "data" / "public_domain.txt"  # (benchmarks/quant_quality's)


@pytest.fixture(scope="module")
def hf_fp32_text(default_model_dir):
    """1,024 tokens of text in 512-token windows (2,048 took 81 s of the suite on a CPU without avx512_bf16, where
    the eager bf16 model is emulated), HF's fp32 logits of them, and the score of each model that is the same for
    every tier: (windows, scores(logits) -> (perplexity, share of positions whose top-1 is HF fp32's) over the
    first len(logits) windows, HF's perplexity, the eager bf16 model's top-1 share on the first window: the eager
    step runs torch's kernels, whatever the tier; on a CPU without avx512_bf16 they are emulated, ~30 s a window)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir)(TEXT.read_text())["input_ids"][:1024]
    windows = [ids[i : i + 512] for i in range(0, len(ids), 512)]
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = [hf(torch.tensor([w])).logits[0] for w in windows]
    del hf

    def scores(logits) -> tuple[float, float]:
        logits = [lg.float() for lg in logits]
        scored = windows[: len(logits)]
        nll = sum(
            -lg.log_softmax(-1)[:-1].gather(1, torch.tensor(w[1:])[:, None]).sum()
            for w, lg in zip(scored, logits, strict=True)
        )
        same = sum((lg.argmax(-1) == r.argmax(-1)).sum() for lg, r in zip(logits, ref, strict=False))
        positions = sum(map(len, scored))
        return math.exp(nll / (positions - len(scored))), float(same) / positions

    _, top1_eager = scores(engine_logits(_bf16_engine(default_model_dir, compile_step=False), windows[:1]))
    return windows, scores, scores(ref)[0], top1_eager


def _bf16_engine(model_dir, compile_step: bool):
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(model_dir), num_kv_blocks=256, dtype="bfloat16", compile_step=compile_step
    )
    return LLMEngine(config)


def test_bf16_predictions_stay_those_of_hf_fp32(default_model_dir, cpu_tier, hf_fp32_text):
    """The bf16 model in the native step of each instruction-set tier (avx512bf16: its products round their
    inputs to bf16) predicts the text as HF's fp32 model does in substance: perplexity within 0.5%, the
    top-1 token the same at >= 98% of 1,024 positions, and on the first 512 at least as often as the eager bf16
    model does. (The weights' own rounding to bf16 costs 1%: HF's fp32 model on the bf16-rounded weights agrees at
    99.0%.)"""
    if cpu_tier == "scalar":
        pytest.skip("the portable loops: minutes on the real model (tests/kernels checks them)")
    windows, scores, ppl_hf, top1_eager = hf_fp32_text
    native = _bf16_engine(default_model_dir, compile_step=True)
    assert native.runner.native is not None and native.runner.cpu_kernels == cpu_tier
    logits = engine_logits(native, windows)
    ppl, top1 = scores(logits)
    _, top1_first = scores(logits[:1])  # (the eager model's is of the first window)
    assert abs(ppl / ppl_hf - 1) <= 0.005 and top1 >= 0.98 and top1_first >= top1_eager, (
        ppl / ppl_hf,
        top1,
        top1_first,
        top1_eager,
    )
