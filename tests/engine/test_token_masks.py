"""vLLM's logits masks on a tiny random model: `allowed_token_ids` and `bad_words` give HF transformers'
greedy generation under the same constraint (`prefix_allowed_tokens_fn`, `bad_words_ids`), the banned
sequences never appear, and speculation (drafts verified under the same masks) changes no output, greedy
or sampled. Prompt logprobs match HF's logits, ranks included, and survive preemption unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from tests.engine.speculative.test_speculative import PROMPTS, accepted, pair

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

TEXTS = ["def add(a, b):", "The quick brown fox jumps over", "Paris is the capital of"]
N = 24


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_kv_blocks=256, speculative="off")


def hf_greedy(hf, prompt: list[int], **constraint) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N, do_sample=False, **constraint
    )
    return out[0, len(prompt) :].tolist()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kw)


def contains(tokens: list[int], seq: list[int]) -> bool:
    return any(tokens[i : i + len(seq)] == seq for i in range(len(tokens) - len(seq) + 1))


def vllm_sequences(tok, word: str) -> list[list[int]]:
    """The token sequences vLLM bans for a bad word (its documented rule): the word, and the word after a
    space where that is another sequence of the same length."""
    alone = tok.encode(word.lstrip(), add_special_tokens=False)
    spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
    return [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])


def test_allowed_token_ids_match_hf_generate(llm, tiny_hf_model, tok):
    for text in TEXTS:
        prompt = tok.encode(text)
        free = hf_greedy(tiny_hf_model, prompt)
        allowed = sorted({free[1], free[4], *tok.encode(" the brown fox", add_special_tokens=False)})
        (out,) = llm.generate([prompt], greedy(allowed_token_ids=allowed))
        ref = hf_greedy(
            tiny_hf_model, prompt, prefix_allowed_tokens_fn=lambda batch, ids, allowed=allowed: allowed
        )
        assert out.token_ids == ref, text
        assert set(out.token_ids) <= set(allowed) and out.token_ids != free


def test_bad_words_match_hf_generate(llm, tiny_hf_model, tok):
    banned_any = False
    for text in TEXTS:
        prompt = tok.encode(text)
        free = hf_greedy(tiny_hf_model, prompt)
        # a printable word the model would write: two adjacent output tokens that are its whole encoding
        words = [
            w
            for i in range(len(free) - 1)
            if (w := tok.decode(free[i : i + 2])).isprintable()
            and w.strip()
            and tok.encode(w.lstrip(), add_special_tokens=False) == free[i : i + 2]
        ]
        if not words:
            continue
        word = words[0]
        seqs = vllm_sequences(tok, word)
        # HF also looks at the prompt, vLLM (and motet) only at the output: no word may begin at its end
        assert all(s[0] != prompt[-1] for s in seqs)
        (out,) = llm.generate([prompt], greedy(bad_words=[word]))
        assert out.token_ids == hf_greedy(tiny_hf_model, prompt, bad_words_ids=seqs), (text, word)
        assert not any(contains(out.token_ids, s) for s in seqs)
        assert any(contains(free, s) for s in seqs)  # the constraint did something
        banned_any = True
    assert banned_any


def test_single_token_bad_words_never_appear(llm, tok):
    prompt = tok.encode(TEXTS[0])
    (free,) = llm.generate([prompt], greedy())
    words = [tok.decode([t]) for t in dict.fromkeys(free.token_ids)]
    words = [w for w in words if w.strip() and w.isprintable()][:3]
    (out,) = llm.generate([prompt], greedy(bad_words=words))
    for w in words:
        for s in vllm_sequences(tok, w):
            assert not contains(out.token_ids, s), w


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, top_p=0.95, seed=11)])
def test_masks_give_the_same_output_with_speculation(tiny_model_dir, sampling):
    off, on = pair(tiny_model_dir)
    tok = off.engine.tokenizer.hf
    allowed = sorted({t for p in PROMPTS for t in p} | {1, 2, 50, 60, 123})
    free = off.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True, **sampling))
    params = []
    for i, out in enumerate(free):
        if i % 2 == 0:
            params.append(
                SamplingParams(max_tokens=30, ignore_eos=True, allowed_token_ids=allowed, **sampling)
            )
        else:  # a word the plain output has, inside the repeats drafts copy
            word = tok.decode(out.token_ids[6:8])
            params.append(SamplingParams(max_tokens=30, ignore_eos=True, bad_words=[word], **sampling))
    plain, spec = off.generate(PROMPTS, params), on.generate(PROMPTS, params)
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids and b.text == a.text
    assert accepted(on) > 0


def test_jump_forward_never_skips_the_masks(tiny_model_dir):
    """Tokens a grammar forces are appended unsampled by jump-forward: not for a request with masks."""
    from motet.grammar.specs import RegexSpec

    llm = LLM(str(tiny_model_dir), num_kv_blocks=128, jump_forward=True, speculative="off")
    tok = llm.engine.tokenizer.hf
    banned = vllm_sequences(tok, "cab")
    params = dict(temperature=0, max_tokens=10, grammar=RegexSpec("(abc)+x"))
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(**params))
    assert llm.engine.stats().grammar.jump_forward_tokens > 0
    assert any(contains(out.token_ids, s) for s in banned)  # what the grammar forces holds the word
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(**params, bad_words=["cab"]))
    assert not any(contains(out.token_ids, s) for s in banned)
    assert tok.decode(out.token_ids).startswith("abc")  # still the grammar's


def test_prompt_logprobs_match_hf(tiny_model_dir, tiny_hf_model):
    prompt = [(i * 7) % 300 + 3 for i in range(40)]
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_num_batched_tokens=16)  # several prefill chunks
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))
    with torch.no_grad():
        ref = torch.log_softmax(tiny_hf_model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(out.prompt_logprobs) == len(prompt) - 1
    for t, lp in enumerate(out.prompt_logprobs):
        want = ref[t]
        assert lp.token_id == prompt[t + 1]
        assert lp.logprob == pytest.approx(want[prompt[t + 1]].item(), abs=1e-4)
        assert lp.rank == int((want > want[prompt[t + 1]]).sum()) + 1
        assert [i for i, _ in lp.top] == want.topk(3).indices.tolist()


def test_prompt_logprobs_survive_preemption(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=2)
    prompts = [[3 + i, 40 + i, 90 + (i * 13) % 200] * (4 + i % 5) for i in range(16)]
    ample = LLM(str(tiny_model_dir), num_kv_blocks=512, block_size=4).generate(prompts, params)
    small = LLM(str(tiny_model_dir), num_kv_blocks=40, block_size=4, max_num_batched_tokens=32)
    tight = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    for a, b in zip(ample, tight, strict=True):
        assert [lp.token_id for lp in b.prompt_logprobs] == [lp.token_id for lp in a.prompt_logprobs]
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) - 1
