"""Speculative decoding on tiny random models: the output is the non-speculative engine's, token for token
(and HF transformers' / PEFT's greedy continuation), across adapters, sampling settings, stops and
preemption; the KV and prefix cache hold no rejected draft; sampling keeps the target distribution."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from motet.engine.core.block_manager import block_hash
from motet.engine.core.sequence import Sequence
from motet.engine.llm import LLM
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.engine.speculative.ngram import NgramIndex
from motet.engine.speculative.proposer import DraftState, SpeculativeConfig, Speculator
from tests.engine.test_engine import hf_greedy
from tests.peft_adapters import peft_reference, tiny_llm, tiny_requests
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# Prompts that repeat themselves, so that prompt lookup has something to propose.
PROMPTS = [[5, 6, 7, 8, 9] * 6, [11, 12, 13] * 10, [100, 101, 102, 103] * 5 + [7, 8], list(range(3, 40)) * 2]


def speculating(model_dir, **options) -> LLM:
    """An engine with n-gram drafts in every step, whatever the batch."""
    return LLM(str(model_dir), block_size=4, speculative="ngram", speculative_overhead_tokens=1e6, **options)


def pair(model_dir, **options) -> tuple[LLM, LLM]:
    """The same engine without and with speculation."""
    off = LLM(str(model_dir), num_kv_blocks=256, block_size=4, speculative="off", **options)
    return off, speculating(model_dir, num_kv_blocks=256, **options)


def failed_steps(llm: LLM) -> list[BaseException]:
    """What the engine's steps raise from now on: a step that raises is re-run in halves until the failing rows
    are alone, so its outputs may still be right while every step with drafts fails and runs row by row."""
    raised, execute = [], llm.engine.runner.execute

    def recording(*args, **kwargs):
        try:
            return execute(*args, **kwargs)
        except Exception as e:
            raised.append(e)
            raise

    llm.engine.runner.execute = recording
    return raised


def accepted(llm: LLM) -> int:
    return llm.engine.stats().speculative.accepted_tokens


def brute_force_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_prompt_lookup_matches_a_brute_force_search():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        tokens = torch.randint(0, 6, (80,), generator=g).tolist()
        min_n = 1 + trial % 2
        index = NgramIndex(min_n, 4)
        for length in range(1, len(tokens) + 1):  # the index grows with the sequence, as in the engine
            want = brute_force_lookup(tokens[:length], 5, min_n, 4)
            assert index.propose(tokens[:length], 5) == want, trial


def test_greedy_is_the_plain_engines_and_hfs(tiny_model_dir, tiny_hf_model):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    off, on = pair(tiny_model_dir)
    raised = failed_steps(on)
    plain, spec = off.generate(PROMPTS, params), on.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert accepted(on) > 0 and on.engine.num_steps < off.engine.num_steps
    assert raised == []  # every step ran whole, its drafting rows beside the others
    for prompt, out in zip(PROMPTS, spec, strict=True):
        assert out.token_ids == hf_greedy(tiny_hf_model, prompt, 40)
    bm = on.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # rejected drafts' blocks came back too


def test_eager_and_compiled_verify_alike(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, compiled = pair(tiny_model_dir)
    _, eager = pair(tiny_model_dir, compile_step=False)
    assert compiled.engine.runner.native is not None and eager.engine.runner.native is None
    a, b = compiled.generate(PROMPTS, params), eager.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b] and accepted(compiled) > 0


def test_mixed_adapter_batch_matches_peft(tiny_model_dir, tiny_loras):
    peft, paths = tiny_loras
    prompts, names = tiny_requests()
    prompts = [p * 3 for p in prompts]  # repeated: drafts to verify under each row's own adapter
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    on = tiny_llm(
        tiny_model_dir, paths, speculative="ngram", speculative_overhead_tokens=1e6, max_num_batched_tokens=64
    )
    outs = on.generate(prompts, params, names)
    assert accepted(on) > 0
    for p, n, out in zip(prompts, names, outs, strict=True):
        tokens, _ = peft_reference(peft, n, p, 16)
        assert out.token_ids == tokens[len(p) :], n


@pytest.mark.parametrize(
    "options, drafts",
    [
        # penalties and temperature 1 steer the tiny model away from repeats: few or no drafts there
        (dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2), False),
        (dict(temperature=0.8, top_p=0.9, top_k=50, seed=7), True),  # seeded draws: per output position
        (dict(temperature=1.0, min_p=0.05, seed=123, logprobs=3), False),
        (dict(logprobs=2), True),
    ],
)
def test_sampling_settings_give_the_plain_output(tiny_model_dir, options, drafts):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 32, "ignore_eos": True, **options})
    off, on = pair(tiny_model_dir)
    plain, spec = off.generate(PROMPTS, params), on.generate(PROMPTS, params)
    assert on.engine.stats().speculative.drafted_tokens > 0 or not drafts
    for a, b in zip(plain, spec, strict=True):
        assert b.token_ids == a.token_ids and b.text == a.text
        if params.logprobs is not None:
            assert [lp.token_id for lp in b.logprobs] == a.token_ids
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_stops_and_lengths_end_where_the_plain_engine_ends(tiny_model_dir):
    off, on = pair(tiny_model_dir)
    free = off.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    params = []
    for i, out in enumerate(free):  # stops taken from the plain output, to land inside draft windows
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=40, stop=[out.text[12:15]]))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[out.token_ids[9]]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=13, min_tokens=13))
    eos = off.engine.tokenizer.hf.eos_token_id
    params.append(SamplingParams(temperature=0, max_tokens=40, min_tokens=20, stop_token_ids=[eos]))
    prompts = PROMPTS + [PROMPTS[0]]
    plain, spec = off.generate(prompts, params), on.generate(prompts, params)
    for a, b in zip(plain, spec, strict=True):
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
            a.token_ids,
            a.text,
            a.finish_reason,
            a.stop_reason,
        )
    assert accepted(on) > 0


def test_preemption_and_the_prefix_cache_keep_no_rejected_draft(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[3 + i, 40 + i, 90 + (i * 13) % 200] * (2 + i % 5) for i in range(24)]
    ample = LLM(str(tiny_model_dir), num_kv_blocks=512, block_size=4, speculative="off").generate(
        prompts, params
    )
    tight = speculating(tiny_model_dir, num_kv_blocks=40)
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]
    engine = tight.engine
    assert engine.scheduler.num_preemptions > 0 and accepted(tight) > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # Every block in the prefix cache holds tokens some sequence really has (never a rejected draft).
    real = set()
    for p, out in zip(prompts, outs, strict=True):
        tokens, h = p + out.token_ids, None
        for i in range(len(tokens) // 4):
            h = block_hash(h, 0, 0, tuple(tokens[4 * i : 4 * i + 4]))  # offline: no salt
            real.add(h)
    assert bm.cached and set(bm.cached) <= real


def test_opt_out(tiny_model_dir):
    _, on = pair(tiny_model_dir)
    on.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False))
    assert on.engine.stats().speculative.proposals == 0


def run_as(llm: LLM, tenant: str, prompts: list[list[int]], params: SamplingParams) -> list:
    ids = [llm.engine.add_request(p, params, tenant=tenant) for p in prompts]
    done, answers = {}, RequestOutputs()
    while len(done) < len(ids):
        done.update((o.request_id, o) for o in answers.step(llm.engine) if o.finished)
    return [done[i] for i in ids]


def test_drafts_from_the_tenants_history_keep_the_plain_output(tiny_model_dir):
    """Finished outputs feed later requests' drafts, of the same tenant (and adapter, grammar) only."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    off, on = pair(tiny_model_dir)
    prompts = [[7, 3, 9, 200 + i] for i in range(3)]
    plain = [o.token_ids for o in off.generate(prompts, params)]
    hits = lambda: on.engine.stats().speculative.history_hits  # noqa: E731
    assert [o.token_ids for o in run_as(on, "a", prompts[:2], params)] == plain[:2]
    assert hits() == 0  # both ran side by side: no history yet
    assert [o.token_ids for o in run_as(on, "b", prompts[:1], params)] == plain[:1]
    assert hits() == 0  # a's outputs are not b's
    before = accepted(on)
    assert [o.token_ids for o in run_as(on, "a", prompts, params)] == plain
    assert hits() > 0 and accepted(on) > before


def decode_row(spec: Speculator, prompt: list[int], accepted: float, tried: float) -> Sequence:
    seq = Sequence(prompt, SamplingParams(temperature=0, max_tokens=100))
    seq.num_computed_tokens = seq.num_tokens - 1
    state = spec.states[seq.seq_id] = DraftState(SpeculativeConfig())
    for estimate in state.estimates.values():
        estimate.accepted, estimate.tried = accepted, tried
    return seq


@pytest.mark.parametrize("rows", [1, 3, 8, 30])
def test_drafts_are_kept_while_worth_their_cost(rows):
    """Per row, the number of drafts that maximizes the step's expected tokens per token-time, found by
    trying every combination: speculation follows each row's acceptance and backs off as rows add up."""
    cfg = SpeculativeConfig(num_tokens=3, overhead_tokens=10.0)
    spec = Speculator(cfg, encode=None, max_model_len=4096)
    estimates = [(9, 10), (6, 10), (2, 10), (1, 2)]
    seqs = [decode_row(spec, [5 + i, 6, 7, 8] * 4 + [5 + i, 6], *estimates[i % 4]) for i in range(rows)]
    spec.propose(seqs)
    got = tuple(len(s.draft_token_ids) for s in seqs)
    p = [min(0.95, a / t) for a, t in (estimates[i % 4] for i in range(rows))]

    def rate(ks):
        return (rows + sum(p[i] ** j for i, k in enumerate(ks) for j in range(1, k + 1))) / (
            rows + cfg.overhead_tokens + sum(ks)
        )

    if rows <= 8:
        best = max(itertools.product(range(cfg.num_tokens + 1), repeat=rows), key=rate)
        assert got == best
    else:  # 30 rows: too many combinations; the rows are compute-bound and only likely drafts pay
        assert rate(got) >= rate((0,) * rows) and sum(got) < rows
    assert all(len(s.draft_token_ids) <= 3 for s in seqs)


def exact_distribution(model_dir, prompt: list[int], vocab: int) -> torch.Tensor:
    """p(t1, t2, t3 | prompt) from HF transformers, [vocab, vocab, vocab]."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    grid = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    ids = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], dim=1)
    with torch.no_grad():
        logp = hf(ids).logits.log_softmax(-1)
    n = len(prompt)
    p1 = logp[0, n - 1].exp()
    p2 = logp[:, n, :].exp().view(vocab, vocab, vocab)[:, 0, :]  # p(t2 | t1): any t2 row of the grid
    p3 = logp[:, n + 1, :].exp().view(vocab, vocab, vocab)  # p(t3 | t1, t2)
    return p1[:, None, None] * p2[:, :, None] * p3


def test_sampling_at_temperature_1_keeps_the_target_distribution(tmp_path):
    vocab, samples = 16, 3000
    model_dir = build_tiny_model(tmp_path, vocab_size=vocab)
    # Every (4, t) pair occurs in the prompt, which ends in 4: whatever t1 is, prompt lookup drafts [4, t+1].
    prompt = [x for t in range(vocab) for x in (4, t)] + [4]
    exact = exact_distribution(model_dir, prompt, vocab)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    for mode in ("off", "ngram"):
        llm = LLM(
            str(model_dir), num_kv_blocks=2048, block_size=4, max_num_seqs=256, max_num_batched_tokens=8192,
            speculative=mode, speculative_overhead_tokens=1e6, enable_prefix_caching=True,
        )  # fmt: skip
        outs = llm.generate([prompt] * samples, params)
        got = torch.tensor([o.token_ids for o in outs])
        if mode == "ngram":
            assert accepted(llm) > samples // 20  # the drafts' positions were sampled, often accepted
        # The marginals of t2 and t3 (the verified positions), and the joint of (t1, t2).
        for observed, expected in (
            (got[:, 1], exact.sum((0, 2))),
            (got[:, 2], exact.sum((0, 1))),
            (got[:, 0] * vocab + got[:, 1], exact.sum(2).flatten()),
        ):
            counts = torch.bincount(observed, minlength=len(expected)).double()
            e = expected.double() * samples
            big = e >= 5  # cells expected to be rare are left out: the test is on the others' shares
            obs, exp = counts[big], e[big] * counts[big].sum() / e[big].sum()
            assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3, mode
