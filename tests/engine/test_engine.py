"""The engine on tiny random models, against Hugging Face transformers as the reference."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from motet.engine.config import EngineConfig
from motet.engine.core.scheduler import ScheduledBatch
from motet.engine.core.sequence import CacheScope, Sequence
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker.layers import Linear, onednn_available
from motet.models.declaration import ModelLoadError
from motet.models.rope_config import longrope_original
from tests.tiny_models import build_tiny_model

PROMPTS = [list(range(3, 3 + n)) for n in (1, 5, 17, 33, 60)] + [[7, 8, 9] * 11]


def hf_fp32(model_dir):
    """transformers' model of the checkpoint in `model_dir` in fp32, loaded once while its files stay as they are
    (the tests ask for one prompt's logits at a time: loading it for each was ~45 CPU-s of a run)."""
    return _hf_fp32(*_checkpoint(model_dir))


def _checkpoint(model_dir) -> tuple[str, tuple]:
    """The checkpoint's directory and its files' names, times and sizes: what a cached result is kept by."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    return str(Path(model_dir).resolve()), tuple(
        (p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files
    )


@functools.lru_cache(maxsize=1)
def _hf_fp32(model_dir: str, _files: tuple) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(model_dir, prompt):
    with torch.no_grad():
        return hf_fp32(model_dir)(torch.tensor([prompt])).logits[0]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of the prompt, exactly n tokens (EOS masked, as ignore_eos does)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def hf_greedy_outputs(model_dir, prompts, new_tokens: int) -> list[list[int]]:
    """`hf_greedy` of each prompt on the checkpoint in `model_dir`, loaded in fp32; computed once for a test's
    engine paths (eager, compiled, two ranks, ...) while the checkpoint's files stay as they are."""
    prompts = tuple(tuple(p) for p in prompts)
    return [list(out) for out in _hf_greedy_outputs(*_checkpoint(model_dir), prompts, new_tokens)]


@functools.lru_cache(maxsize=8)
def _hf_greedy_outputs(model_dir: str, files: tuple, prompts: tuple, new_tokens: int) -> tuple:
    hf = _hf_fp32(model_dir, files)
    return tuple(tuple(hf_greedy(hf, list(prompt), new_tokens)) for prompt in prompts)


def engine_logits(engine: LLMEngine, prompts, chunk: int | None = None, adapters=None, order=None):
    """All-row logits of each prompt, computed in flattened batches (optionally in chunks, with
    per-prompt adapters by name, sequences visited in `order`). A LongRoPE model's prompts past its original
    context turn by its long factors, as the engine takes them (`CacheScope.long_rope`)."""
    refs = [engine.adapters.resolve(a) for a in adapters or [None] * len(prompts)]
    uids = [engine.adapters.acquire(r) if r else 0 for r in refs]
    engine.adapters.prefetch(uids, in_use=set())  # resident, as the scheduler has them before a step
    original = longrope_original(engine.model_config.rope_scaling)
    seqs = [
        Sequence(p, adapter_id=a, cache=CacheScope(long_rope=original is not None and len(p) > original))
        for p, a in zip(prompts, uids, strict=True)
    ]
    visit = [seqs[i] for i in order] if order else seqs
    rows = {s.seq_id: [] for s in seqs}
    while any(s.num_computed_tokens < s.num_tokens for s in seqs):
        batch = ScheduledBatch()
        for s in visit:
            if n := s.num_tokens - s.num_computed_tokens:
                n = min(n, chunk or n)
                assert engine.block_manager.allocate_slots(s, n)
                batch.seqs.append(s)
                batch.num_new_tokens.append(n)
        lora = engine.adapters.batch([s.adapter_id for s in batch.seqs], batch.num_new_tokens)
        hidden, qsl = engine.runner.forward(batch.plan(), lora)
        logits = engine.runner.compute_logits(hidden, lora)
        for i, s in enumerate(batch.seqs):
            rows[s.seq_id].append(logits[qsl[i] : qsl[i + 1]])
            s.num_computed_tokens += batch.num_new_tokens[i]
    for s in seqs:
        engine.block_manager.free_seq(s)
        engine.adapters.release(s.adapter_id)
    return [torch.cat(rows[s.seq_id]).cpu() for s in seqs]  # beside references computed on the CPU


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": False}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
        ),
        ("mistral", {}),
        ("qwen2", {}),
        # YaRN (Qwen2.5's long context) past a small original context, its attention factor from the factor;
        # then DeepSeek's spelling (mscale / mscale_all_dim) and an explicit attention factor
        (
            "qwen2",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
        ),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 8.0,
                    "original_max_position_embeddings": 32,
                    "mscale": 1.0,
                    "mscale_all_dim": 0.5,
                    "beta_fast": 16,
                }
            },
        ),
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3}}),
        ("qwen3", {"head_dim": 32}),  # head_dim apart from hidden / heads, as Qwen3's configs have
    ],
)
def test_batched_logits_match_hf(tmp_path, arch, overrides):
    model_dir = build_tiny_model(tmp_path, arch=arch, **overrides)
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), block_size=8, num_kv_blocks=128), model_dir=model_dir
    )
    ours = engine_logits(engine, PROMPTS)
    for prompt, got in zip(PROMPTS, ours, strict=True):
        torch.testing.assert_close(got, hf_logits(model_dir, prompt), atol=2e-4, rtol=1e-4)


def test_chunked_prefill_matches_one_pass(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=8, num_kv_blocks=256))
    prompt = [(i * 7) % 300 + 3 for i in range(500)]
    (one,) = engine_logits(engine, [prompt])
    (chunked,) = engine_logits(engine, [prompt], chunk=64)
    torch.testing.assert_close(chunked, one, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(one, hf_logits(tiny_model_dir, prompt), atol=2e-4, rtol=1e-4)


def test_bf16_close_to_fp32(tiny_model_dir):
    fp32 = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    bf16 = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, dtype="bfloat16"))
    a, b = engine_logits(fp32, PROMPTS[:3]), engine_logits(bf16, PROMPTS[:3])
    for x, y in zip(a, b, strict=True):
        assert (x.softmax(-1) - y.softmax(-1)).abs().max() < 0.05


def test_greedy_generation_matches_hf_generate(tiny_model_dir, tiny_hf_model):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(tiny_hf_model, prompt, 12)
        assert out.finish_reason == "length"


def test_preemption_gives_the_same_outputs_and_frees_every_block(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[3 + i, 40 + i, 90 + (i * 13) % 200] * (2 + i % 5) for i in range(24)]
    ample = LLM(str(tiny_model_dir), num_kv_blocks=512, block_size=4).generate(prompts, params)
    small = LLM(str(tiny_model_dir), num_kv_blocks=40, block_size=4)
    tight = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert small.engine.block_manager.num_free_blocks == 40


def test_seeded_sampling_is_batch_invariant(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256)
    seeded = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=10) for i in range(len(PROMPTS))
    ]
    together = llm.generate(PROMPTS, seeded)
    for i, prompt in enumerate(PROMPTS):
        (alone,) = llm.generate([prompt], seeded[i])
        assert alone.token_ids == together[i].token_ids


def test_prefix_cache_computes_only_the_suffix(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=256, block_size=8)
    prefix = [(i * 11) % 300 + 3 for i in range(100)]
    params = SamplingParams(temperature=0, max_tokens=8)
    (first,) = llm.generate([prefix + [5, 6]], params)
    (second,) = llm.generate([prefix + [7, 8, 9]], params)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 96
    (uncached,) = LLM(str(tiny_model_dir), num_kv_blocks=256, enable_prefix_caching=False).generate(
        [prefix + [7, 8, 9]], params
    )
    assert second.token_ids == uncached.token_ids
    # Other adapters never share the cached blocks: tests/lora/test_lora_engine.py.


def test_bad_inputs_name_the_problem(tiny_model_dir, tmp_path):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * 64])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ModelLoadError, match="no such directory"):
        LLM(str(tmp_path / "nope"))


def test_stop_strings_end_the_text_without_leaking(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    (free,) = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop = free.text[6:9]
    (stopped,) = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
    assert stopped.text == free.text[: free.text.index(stop)]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert llm.engine.block_manager.num_free_blocks == 64


def test_stop_token_text_stays_out(tiny_model_dir):
    """As vLLM's detokenizer: the stop token that ends a request (a stop token id, EOS) leaves its text out, special
    tokens kept or not, unless include_stop_str_in_output."""
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    (free,) = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    stop = free.token_ids[4]
    hf = llm.tokenizer.hf
    for include in (False, True):
        params = SamplingParams(
            temperature=0,
            max_tokens=8,
            stop_token_ids=[stop],
            skip_special_tokens=False,
            include_stop_str_in_output=include,
        )
        (out,) = llm.generate([PROMPTS[3]], params)
        cut = free.token_ids.index(stop) + 1
        assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop"
        assert out.text == hf.decode(free.token_ids[: cut if include else cut - 1], skip_special_tokens=False)


def test_cli_generate_json(tiny_model_dir, capsys):
    import json

    from motet.api.cli import main

    assert (
        main(
            [
                "generate",
                "--model",
                str(tiny_model_dir),
                "--prompt",
                "Paris is",
                "--max-tokens",
                "5",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "finish_reason"} and len(out["token_ids"]) == 5
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_a_request_that_fails_in_processing_fails_alone(tiny_model_dir):
    """A backend raising for one sequence (here its grammar matcher) must not take its batch with it."""
    from motet.engine.guided import GuidedDecoding
    from motet.grammar.backend import Matcher

    class Broken(Matcher):
        accept_token = fill_bitmask = rollback = lambda *a: True
        is_terminated = lambda self: False  # noqa: E731

        def find_jump_forward_string(self):
            raise UnicodeDecodeError("utf-8", b"\x8b", 0, 1, "invalid start byte")

    engine = LLMEngine(
        EngineConfig(model=str(tiny_model_dir), block_size=8, num_kv_blocks=256, jump_forward=True)
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    bad = engine.add_request([5, 6, 7], params)
    good = engine.add_request([5, 6, 8], params)
    engine.structured_output.add(bad, GuidedDecoding(Broken()))
    engine.requests[bad].decided_by_tokens = False
    outs, answers = {}, RequestOutputs()
    while engine.has_unfinished():
        for o in answers.step(engine):
            outs.setdefault(o.request_id, []).append(o)
    assert outs[bad][-1].error and outs[bad][-1].finish_reason == "abort" and len(outs[bad]) == 1
    assert outs[good][-1].finish_reason == "length" and len(outs[good][-1].token_ids) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_request_that_fails_in_the_forward_pass_fails_alone(tiny_model_dir):
    """The engine bisects a batch whose forward pass raises until the failing rows are alone: they end with
    an error, every other row gets exactly the tokens it gets without them."""
    from tests.actors.test_actors import inject_fault

    cfg = EngineConfig(model=str(tiny_model_dir), block_size=8, num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7 + i] for i in range(5)]
    expected = [
        o.token_ids
        for o in LLM(str(tiny_model_dir), block_size=8, num_kv_blocks=256).generate(prompts, params)
    ]
    engine = LLMEngine(cfg)
    inject_fault(engine, 299)
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    bad = [engine.add_request([5, 299, i], params) for i in range(2)]
    ids += [engine.add_request(p, params) for p in prompts[2:]]
    outs, answers = {}, RequestOutputs()
    while engine.has_unfinished():
        for o in answers.step(engine):
            outs.setdefault(o.request_id, []).append(o)
    for rid in bad:
        assert (
            len(outs[rid]) == 1 and outs[rid][0].finish_reason == "abort" and "injected" in outs[rid][0].error
        )
    assert [outs[rid][-1].token_ids for rid in ids] == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 0.03)])
def test_prepacked_linear_matches_f_linear(dtype, tol):
    """The CPU runner's oneDNN path computes what F.linear does, for any number of rows and with bias."""
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=True).to(dtype)
    if not layer.prepack():  # oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT: F.linear serves
        assert layer.packed_weight is None and dtype == torch.bfloat16
    for rows in (1, 2, 7, 64, 300):
        x = torch.randn(rows, 96, dtype=dtype)
        ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
        assert (layer(x).float() - ref).abs().max().item() <= tol
    strided = torch.randn(5, 192, dtype=dtype)[:, ::2]  # attention output views reach it non-contiguous
    ref = torch.nn.functional.linear(strided.float(), layer.weight.float(), layer.bias.float())
    assert (layer(strided).float() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("overlap", [False, True], ids=["in-order", "overlapped"])
def test_the_engine_keeps_nothing_of_requests_that_ended(tiny_model_dir, overlap):
    """Each part keeps its own per-request state (the output commit the text, the structured outputs the grammar,
    the speculator the drafts' scope and state): finished, stopped, grammar-bound and aborted
    requests, in order or overlapped, leave nothing behind (a disconnect frees its memory)."""
    from motet.grammar.specs import RegexSpec
    from tests.engine.test_overlap_output import engine as overlap_engine

    engine = overlap_engine(tiny_model_dir, overlap, num_kv_blocks=256, speculative="ngram")
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request([5, 6, 7, 8] * 4, plain) for _ in range(3)]
    ids.append(
        engine.add_request([9, 10], SamplingParams(temperature=0, max_tokens=12, stop=["a", "b", "c"]))
    )
    ids.append(
        engine.add_request([9, 11], SamplingParams(temperature=0, max_tokens=6, grammar=RegexSpec("[a-z]+")))
    )
    aborted = engine.add_request([12, 13, 14], plain)
    answers, steps = RequestOutputs(), 0
    while engine.has_unfinished():
        answers.step(engine)
        steps += 1
        if steps == 3:
            assert engine.abort(aborted)
    assert all(answers.answers[i].finished for i in ids)
    assert engine.requests == {}
    assert engine.output_commit.texts == {} and engine.structured_output.grammars == {}
    assert engine.speculator.scopes == {} and engine.speculator.states == {}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
