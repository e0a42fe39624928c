"""Sampler vs references: HF logits processors, the OpenAI penalty formula, seeds, frequencies."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from motet.engine.core.scheduler import ScheduledBatch
from motet.engine.core.sequence import Sequence
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker.rows import RunnerRows, SampleView, position_views
from motet.engine.worker.sampler import Sampler, apply_processing, compute_prompt_logprobs

EOS = 1


def seq(output=(), prompt=(5, 6, 7), **params) -> SampleView:
    """The sampler's view of a sequence's next token, made as the runner makes it from a step's plan."""
    s = Sequence(list(prompt), SamplingParams(**params))
    for t in output:
        s.append_token(t)
    batch = ScheduledBatch([s], [1])
    return position_views(batch.plan()[0], RunnerRows().update(batch.plan())[0])[0]


def hf_reference(logits: torch.Tensor, p: SamplingParams, input_ids: list[int]) -> torch.Tensor:
    """One row through the HF processors, in the order the sampler applies them."""
    ids, x = torch.tensor([input_ids]), logits[None].clone()
    if p.repetition_penalty != 1:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    if p.greedy:
        return x[0]
    warpers = [TemperatureLogitsWarper(p.temperature)]
    warpers += [TopKLogitsWarper(p.top_k)] if p.top_k else []
    warpers += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
    warpers += [MinPLogitsWarper(p.min_p)] if p.min_p else []
    for w in warpers:
        x = w(ids, x)
    return x[0]


PARAMS = [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.5, top_k=10, top_p=0.6),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),
    dict(temperature=1.0, top_p=0.05),  # nucleus of one token
    dict(temperature=0.8, repetition_penalty=1.5, top_k=8),
    dict(temperature=0, repetition_penalty=0.7),
    dict(temperature=0),
    dict(temperature=1.0, top_k=1000),  # k > V: no-op
]


@pytest.mark.parametrize(
    "V, scale",
    [(64, 3.0), (1000, 4.0), (1000, 0.3)],  # small vocab; nucleus among the candidates; beyond them
)
def test_processing_matches_hf_processors(V, scale):
    torch.manual_seed(0)
    seqs = [seq(output=[3, 9, 9, 40], prompt=[2, 50, 3], **p) for p in PARAMS]
    logits = torch.randn(len(seqs), V) * scale
    got = apply_processing(logits, seqs, [EOS])
    for i, s in enumerate(seqs):
        want = hf_reference(logits[i], s.params, s.token_ids)
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want)), PARAMS[i]
        kept = torch.isfinite(want)
        torch.testing.assert_close(got[i][kept], want[kept], rtol=1e-5, atol=1e-5)
        # alone in its batch (other candidate counts, other paths) the row comes out the same
        assert torch.equal(apply_processing(logits[i : i + 1], [s], [EOS])[0], got[i])
    # the filters removed something where asked to
    assert torch.isinf(got[1]).sum() == V - 5 and torch.isfinite(got[6]).sum() < 30
    if V == 1000:  # top_p=0.8 row: make sure both the candidate search and the full sort are exercised
        assert (torch.isfinite(got[2]).sum() > 256) == (scale < 1)


def test_processing_does_not_modify_input():
    logits = torch.randn(3, 32)
    before = logits.clone()
    apply_processing(logits, [seq(temperature=0.5, top_p=0.5, repetition_penalty=2.0) for _ in range(3)])
    assert torch.equal(logits, before)


def test_frequency_presence_penalty_formula():
    torch.manual_seed(1)
    V = 32
    out = [4, 4, 4, 9, 30, 9, 5]
    s = seq(output=out, prompt=[7, 8], temperature=0, frequency_penalty=0.6, presence_penalty=-0.4)
    logits = torch.randn(1, V)
    want = logits[0].clone()
    for t in set(out):  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        want[t] -= out.count(t) * 0.6 + 1 * -0.4
    torch.testing.assert_close(apply_processing(logits, [s])[0], want)
    # prompt tokens (7, 8) are not penalized by these two
    assert apply_processing(logits, [s])[0][7] == logits[0][7]


def test_greedy_is_argmax_in_any_dtype():
    torch.manual_seed(2)
    sampler = Sampler(vocab_size=1000, eos_token_ids=[EOS])
    logits = torch.randn(64, 1000)
    seqs = [seq(temperature=0) for _ in range(64)]
    assert sampler(logits, seqs).token_ids == logits.argmax(-1).tolist()
    lb = logits.bfloat16()
    assert sampler(lb, seqs).token_ids == lb.float().argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [5e-232, 1e-300, 1e-6])
def test_vanishing_temperature_is_greedy(temperature):
    # Dividing by such a temperature overflows the logits; the limit of the distribution is the argmax
    # (vLLM treats temperatures below 1e-5 as greedy). The fuzz test found 5e-232 answering 500.
    torch.manual_seed(3)
    sampler = Sampler(vocab_size=1000, eos_token_ids=[EOS])
    logits = torch.randn(8, 1000) * 30
    seqs = [seq(temperature=temperature) for _ in range(8)]
    assert sampler(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_padded_vocab_is_cut_off():
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 100  # padding columns of the lm_head
    out = Sampler(vocab_size=10, eos_token_ids=[EOS])(logits, [seq(temperature=0), seq(seed=3)])
    assert all(t < 10 for t in out.token_ids)


def test_min_tokens_blocks_eos_and_stop_token_ids():
    V = 16
    sampler = Sampler(vocab_size=V, eos_token_ids=[EOS, 2])
    logits = torch.zeros(1, V)
    logits[0, [EOS, 2, 3]] = torch.tensor([10.0, 9.0, 8.0])  # EOS best, then another EOS, then a stop id
    for greedy in (True, False):
        p = dict(temperature=0) if greedy else dict(temperature=1.0, top_k=3)
        for n_out, ignore_eos in [(0, False), (2, True)]:
            s = seq(output=[4] * n_out, min_tokens=3, stop_token_ids=[3], ignore_eos=ignore_eos, **p)
            processed = apply_processing(logits, [s], [EOS, 2])[0]
            assert torch.isinf(processed[[EOS, 2, 3]]).all()
            assert sampler(logits, [s]).token_ids[0] not in (EOS, 2, 3)
        s = seq(output=[4] * 3, min_tokens=3, stop_token_ids=[3], temperature=0)
        assert sampler(logits, [s]).token_ids == [EOS]  # the minimum is reached


def test_seeded_rows_ignore_batch_and_position():
    torch.manual_seed(3)
    V = 500
    sampler = Sampler(vocab_size=V, eos_token_ids=[EOS])
    row = torch.randn(V)

    def sample(seed, n_out, neighbours, pos):
        target = seq(output=[0] * n_out, seed=seed, temperature=1.0, top_p=0.95)
        others = [seq(temperature=t, seed=7 if t == 2.0 else None, top_k=k) for t, k in neighbours]
        seqs = others[:pos] + [target] + others[pos:]
        logits = torch.randn(len(seqs), V)
        logits[pos] = row
        return sampler(logits, seqs).token_ids[pos]

    for n_out in range(4):
        draws = {
            sample(42, n_out, [], 0),
            sample(42, n_out, [(1.0, 0)] * 5, 2),
            sample(42, n_out, [(0.0, 0), (0.5, 3), (1.0, 0)], 3),
            sample(42, n_out, [(2.0, 50)] * 9, 9),
        }
        assert len(draws) == 1  # and the same after a preemption, which restarts from the same n_out
    # another seed, or another step, gives another stream
    stream = lambda seed: [sample(seed, n, [], 0) for n in range(8)]
    assert stream(42) == stream(42) and stream(42) != stream(43)
    assert len(set(stream(42))) > 1


def test_unseeded_rows_vary():
    sampler = Sampler(vocab_size=100, eos_token_ids=[EOS])
    logits = torch.zeros(64, 100)
    assert len(set(sampler(logits, [seq() for _ in range(64)]).token_ids)) > 10


def chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, n: int) -> bool:
    expected = probs * n
    support = expected > 0
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
    dof = int(support.sum()) - 1
    return stat < dof + 6 * math.sqrt(2 * dof)  # ~6 sigma of a chi-square with dof degrees of freedom


@pytest.mark.parametrize("seeded", [False, True])
def test_sampling_frequencies_match_processed_distribution(seeded):
    torch.manual_seed(4)
    V, rows, rounds = 12, 500, 10
    sampler = Sampler(vocab_size=V, eos_token_ids=[EOS])
    logits = torch.randn(1, V).expand(rows, V)
    params = dict(temperature=0.8, top_k=9, top_p=0.9, repetition_penalty=1.3)
    counts = torch.zeros(V)
    for r in range(rounds):
        seqs = [seq(output=[2, 3], seed=(r * rows + i) if seeded else None, **params) for i in range(rows)]
        counts += torch.bincount(torch.tensor(sampler(logits, seqs).token_ids), minlength=V)
    probs = torch.softmax(apply_processing(logits[:1], seqs[:1])[0], -1)
    assert (counts[probs == 0] == 0).all()
    assert chi_square_ok(counts, probs, rows * rounds)


def test_logprobs_are_raw_log_softmax_with_sorted_top():
    torch.manual_seed(5)
    V = 50
    sampler = Sampler(vocab_size=V, eos_token_ids=[EOS])
    logits = torch.randn(4, V)
    seqs = [
        seq(temperature=0, logprobs=3),
        seq(temperature=0.3, top_k=2, repetition_penalty=2.0, logprobs=5, output=[1, 2]),
        seq(temperature=1.0),
        seq(temperature=0, logprobs=0),
    ]
    out = sampler(logits, seqs)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i, k in [(0, 3), (1, 5), (3, 0)]:
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(raw[i, lp.token_id].item(), abs=1e-6)
        vals, ids = raw[i].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-6)
        assert len(lp.top) == k and all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))


def test_prompt_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(5, 30)
    target = [3, 1, 4, 1, 5]
    out = compute_prompt_logprobs(logits, target, 2)
    raw = torch.log_softmax(logits, -1)
    assert [o.token_id for o in out] == target
    for t, o in enumerate(out):
        assert o.logprob == pytest.approx(raw[t, target[t]].item(), abs=1e-6)
        assert [i for i, _ in o.top] == raw[t].topk(2).indices.tolist()
