"""Logits -> next tokens, with vLLM's semantics.

Order per row: logprobs of the raw distribution; allowed_token_ids and bad_words masking
(motet/engine/worker/token_masks.py); repetition, frequency and presence penalties; min_tokens masking of EOS
and stop token ids; then greedy argmax (temperature 0) or temperature,
top-k, top-p, min-p and a draw. A draw is inverse-CDF sampling with one uniform per row; a seeded row
takes its uniform from (seed, output position) alone, so it reproduces whatever its neighbours, its
batch position, its device, or a preemption and recompute.

A row with no distribution to sample from samples nothing and fails alone (`SamplingError`): logits the model
made NaN or infinite (corrupt weights), logits its parameters made so, or every token masked. Its token on the
device is 0, a valid input for a step launched before its failure is known; what the host reads
(`SamplerOutput.outcomes`) is the failure's negative code, in the same transfer as the other rows' tokens.
"""

from __future__ import annotations

import enum
import functools
import random
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from motet.engine.outputs import TokenLogprob
from motet.engine.worker.rows import PENDING, SampleView
from motet.engine.worker.step_inputs import pending_tokens
from motet.engine.worker.token_masks import apply_token_masks

_NEG_INF = float("-inf")
_INF = float("inf")
_CANDIDATES = 256  # top-p first looks for the nucleus among this many best tokens (a full sort is slow)


class SamplingFailure(enum.IntEnum):
    """Why a row sampled no token; its negative is the row's outcome."""

    MODEL_NOT_FINITE = 1
    PARAMS_NOT_FINITE = 2
    ALL_MASKED = 3

    @property
    def message(self) -> str:
        return {
            SamplingFailure.MODEL_NOT_FINITE: "the model's logits for this request are not finite (NaN or infinity): "
            "its weights (or its adapter's) are likely corrupt",
            SamplingFailure.PARAMS_NOT_FINITE: "this request's sampling parameters (repetition_penalty, "
            "frequency_penalty, presence_penalty, temperature) made its logits overflow",
            SamplingFailure.ALL_MASKED: "every token is masked for this request: allowed_token_ids, bad_words, "
            "its grammar and min_tokens (which bans EOS and stop_token_ids until then) leave none to sample",
        }[self]


class SamplingError(RuntimeError):
    """A row that sampled no token (the others in its step did)."""

    def __init__(self, failure: SamplingFailure):
        super().__init__(failure.message)
        self.failure = failure


def outcome_error(outcome: int) -> SamplingError | None:
    """The error a row's outcome (`SamplerOutput.outcomes`) stands for; None for a token."""
    return SamplingError(SamplingFailure(-outcome)) if outcome < 0 else None


@dataclass
class SamplerOutput:
    # [rows] int64 on the logits' device, always in the vocabulary: the next step may take its inputs from it there
    tokens: Tensor
    # [rows] int64: the row's token, or where it sampled none, -SamplingFailure (the host reads this one)
    outcomes: Tensor
    logprobs: list[TokenLogprob | None]  # per row; None where params.logprobs is None

    @functools.cached_property
    def token_ids(self) -> list[int]:
        """The outcomes on the host (on a GPU: waits for the sampling to finish): tokens, or negative failures."""
        return self.outcomes.tolist()


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Seq[int]):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._generators: dict[torch.device, torch.Generator] = {}  # for unseeded rows, one per device

    def __call__(self, logits: Tensor, seqs: list[SampleView]) -> SamplerOutput:
        logits = logits[:, : self.vocab_size]  # the lm_head may pad the vocabulary
        lp_rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(_rows(logits, lp_rows).float(), dim=-1) if lp_rows else None

        x = apply_processing(logits, seqs, self.eos_token_ids)
        rand = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if len(rand) < len(seqs):
            tokens = x.argmax(dim=-1)  # final for greedy rows
        else:
            tokens = torch.empty(len(seqs), dtype=torch.long, device=x.device)
        if rand:
            tokens[rand] = self._draw(torch.softmax(_rows(x, rand), dim=-1), [seqs[i] for i in rand])
        failures = _failures(logits, x)
        ok = failures == 0
        tokens = torch.where(ok, tokens, 0)
        outcomes = torch.where(ok, tokens, -failures)

        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if lp_rows:
            ks = [seqs[i].params.logprobs for i in lp_rows]
            for i, lp in zip(lp_rows, _token_logprobs(raw_logprobs, tokens[lp_rows], ks), strict=True):
                logprobs[i] = lp
        return SamplerOutput(tokens, outcomes, logprobs)

    def _draw(self, probs: Tensor, seqs: list[SampleView]) -> Tensor:
        """One token per row by inverse CDF: the first token whose cumulative probability exceeds u ~ U[0, 1)."""
        dev = probs.device
        if dev not in self._generators:
            self._generators[dev] = torch.Generator(dev).manual_seed(torch.initial_seed())
        u = torch.rand(len(seqs), 1, device=dev, generator=self._generators[dev])
        seeded = [j for j, s in enumerate(seqs) if s.params.seed is not None]
        if seeded:  # str seeds are hashed with SHA-512: stable across processes and platforms
            own = [
                random.Random(f"{seqs[j].params.seed}/{seqs[j].num_output_tokens}").random() for j in seeded
            ]
            u[seeded] = torch.tensor(own, device=dev)[:, None]
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        # a target strictly below the total lands on a token whose cdf steps up, i.e. with p > 0
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True)[:, 0]


def apply_processing(logits: Tensor, seqs: list[SampleView], eos_token_ids: Seq[int] = ()) -> Tensor:
    """The distribution a row is sampled from, as fp32 logits with -inf for removed tokens.

    Greedy rows get the token masks, penalties and min_tokens only (their argmax is the token). The input is not modified;
    when there is nothing to do the result may be the input itself.
    """
    ps = [s.params for s in seqs]
    masks = [i for i, p in enumerate(ps) if p.allowed_token_ids is not None or p.bad_words_token_ids]
    pen = [
        i for i, p in enumerate(ps) if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
    ]
    min_tok = [i for i, s in enumerate(seqs) if _holds_stop(s)]
    temp = [i for i, p in enumerate(ps) if not p.greedy and p.temperature != 1]
    topkp = [i for i, p in enumerate(ps) if not p.greedy and (p.top_k or p.top_p < 1)]
    minp = [i for i, p in enumerate(ps) if not p.greedy and p.min_p > 0]
    if not (masks or pen or min_tok or temp or topkp or minp):
        return logits.float()

    x, dev = logits.to(torch.float32, copy=True), logits.device
    vec = lambda rows, attr: torch.tensor([getattr(ps[i], attr) for i in rows], device=dev)[:, None]
    if masks:
        apply_token_masks(x, [seqs[i] for i in masks], masks)
    if pen:
        x = _on_rows(x, pen, lambda sub: _apply_penalties(sub, [seqs[i] for i in pen]))
    if min_tok:
        _mask_stop_tokens(x, [seqs[i] for i in min_tok], min_tok, eos_token_ids)
    if temp:
        x = _on_rows(x, temp, lambda sub: sub.div_(vec(temp, "temperature")))
    if topkp:
        x = _on_rows(x, topkp, lambda sub: apply_top_k_top_p(sub, vec(topkp, "top_k"), vec(topkp, "top_p")))
    if minp:
        x = _on_rows(x, minp, lambda sub: apply_min_p(sub, vec(minp, "min_p")))
    return x


def _failures(logits: Tensor, x: Tensor) -> Tensor:
    """[rows] int64: each row's SamplingFailure, 0 where it has a distribution to sample from. One reduction per
    tensor: a row's max is NaN where it holds a NaN, +inf where it holds one, -inf where every token is masked."""
    x_max = x.amax(dim=-1)
    raw_max = logits.amax(dim=-1) if x is not logits else x_max
    codes = torch.where(x_max == _NEG_INF, int(SamplingFailure.ALL_MASKED), 0)
    codes = torch.where(_not_finite(x_max), int(SamplingFailure.PARAMS_NOT_FINITE), codes)
    return torch.where(_not_finite(raw_max), int(SamplingFailure.MODEL_NOT_FINITE), codes)


def _not_finite(row_max: Tensor) -> Tensor:
    return row_max.isnan() | (row_max == _INF)


def _rows(x: Tensor, rows: list[int]) -> Tensor:
    return x if len(rows) == len(x) else x[rows]  # no gather when every row is wanted


def _on_rows(x: Tensor, rows: list[int], fn) -> Tensor:
    """x with x[rows] replaced by fn(x[rows]); fn may work in place."""
    if len(rows) == len(x):
        return fn(x)
    x[rows] = fn(x[rows])
    return x


def apply_top_k_top_p(x: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """Keep each row's top k (0: all), then the fewest best tokens whose mass reaches p (HF semantics).

    k and p are [n, 1]; tokens tied with the last kept one stay; x is modified in place. The kept set is
    usually small, so it is looked for among the _CANDIDATES best tokens, and a row whose nucleus may
    reach further is redone with a full sort.
    """
    V = x.shape[1]
    k = torch.where(k > 0, k.clamp(max=V), V)
    kmax = int(torch.where(k < V, k, 0).max())
    c = min(V, kmax if (k < V).all() else max(_CANDIDATES, kmax))
    thresh, complete = _kept_threshold(x, k, p, c)
    if not complete.all():
        rows = (~complete).nonzero()[:, 0]
        thresh[rows] = _kept_threshold(x[rows], k[rows], p[rows], V)[0]
    return x.masked_fill_(x < thresh, _NEG_INF)


def _kept_threshold(x: Tensor, k: Tensor, p: Tensor, c: int) -> tuple[Tensor, Tensor]:
    """The lowest kept logit of each row, found among its c best tokens, and whether those sufficed."""
    vals = x.sort(dim=-1, descending=True).values if c == x.shape[1] else x.topk(c, dim=-1).values
    kth = torch.where(k <= c, vals.gather(1, k.clamp(max=c) - 1), _NEG_INF)
    if (p >= 1).all():  # top-k only
        return kth, k <= c
    # top-p over the top-k distribution: a token stays while the mass of the better ones is < p
    z = torch.where(x >= kth, x, _NEG_INF).logsumexp(dim=-1, keepdim=True)
    probs = (vals - z).exp_().masked_fill_(vals < kth, 0)
    kept = ((probs.cumsum(dim=-1) - probs < p) | (p >= 1)) & (vals >= kth)
    thresh = vals.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True)
    # a top-k row keeps nothing below its k-th value; otherwise the last candidate must have been cut
    return thresh, (k <= c) | ~kept[:, -1:]


def apply_min_p(x: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below min_p [n, 1] times the top token's; in place."""
    probs = x.softmax(dim=-1)
    return x.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), _NEG_INF)


def compute_prompt_logprobs(logits: Tensor, target_ids: Tensor | list[int], k: int) -> list[TokenLogprob]:
    """Row t of logits predicts target_ids[t]: its logprob under the model and its rank (1: the likeliest),
    plus the top k."""
    target = torch.as_tensor(target_ids, device=logits.device)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out = _token_logprobs(logprobs, target, [k] * len(target))
    chosen = logprobs.gather(1, target[:, None].long())
    for lp, rank in zip(out, ((logprobs > chosen).sum(dim=-1) + 1).tolist(), strict=True):
        lp.rank = rank
    return out


def _apply_penalties(x: Tensor, seqs: list[SampleView]) -> Tensor:
    """Penalties on x (one row per seq), in place."""
    V, dev = x.shape[1], x.device
    rep = [j for j, s in enumerate(seqs) if s.params.repetition_penalty != 1]
    if rep:  # HF: over prompt and output ids, divide positive logits, multiply negative ones
        seen = _id_counts([seqs[j] for j in rep], V, dev, outputs=False) > 0
        r = torch.tensor([seqs[j].params.repetition_penalty for j in rep], device=dev)[:, None]
        x = _on_rows(x, rep, lambda sub: torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub))
    fp = [j for j, s in enumerate(seqs) if s.params.frequency_penalty or s.params.presence_penalty]
    if fp:  # OpenAI: logit -= count * frequency_penalty + (count > 0) * presence_penalty, over output ids
        counts = _id_counts([seqs[j] for j in fp], V, dev, outputs=True)
        f = torch.tensor([seqs[j].params.frequency_penalty for j in fp], device=dev)[:, None]
        pr = torch.tensor([seqs[j].params.presence_penalty for j in fp], device=dev)[:, None]
        x = _on_rows(x, fp, lambda sub: sub.sub_(counts * f + (counts > 0) * pr))
    return x


def _id_counts(seqs: list[SampleView], V: int, device: torch.device, outputs: bool) -> Tensor:
    """[n, V] float counts of each id per row, over its output's ids (`outputs`) or all of them: those on the host
    (padded with the out-of-range id V, which a pending token's place reads as too, then cut off), and a row's
    pending token counted on the device, where it is (no host wait)."""
    id_lists = [s.output_token_ids if outputs else s.token_ids for s in seqs]
    width = max(1, max(len(ids) for ids in id_lists))
    ids = torch.tensor([ids + [V] * (width - len(ids)) for ids in id_lists], device=device)
    ids = torch.where(ids == PENDING, V, ids)
    counts = torch.zeros(len(id_lists), V + 1, device=device)
    if any(s.pending is not None for s in seqs):
        rows = torch.tensor([k for k, s in enumerate(seqs) if s.pending is not None], device=device)
        tokens = pending_tokens([s for s in seqs if s.pending is not None], device)
        counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=counts.dtype), accumulate=True)
    return counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))[:, :V]


def _holds_stop(seq: SampleView) -> bool:
    """The output may not end yet: min_tokens not reached, or a reasoning bounded for a grammar that must come
    (motet/engine/guided.py) is open."""
    return seq.num_output_tokens < seq.params.min_tokens or seq.grammar_holds_stop


def _mask_stop_tokens(x: Tensor, seqs: list[SampleView], rows: list[int], eos_token_ids: Seq[int]) -> None:
    """min_tokens (or a bounded reasoning): no EOS (even with ignore_eos) and no stop token ids before the minimum."""
    V = x.shape[1]
    pairs = [
        (r, t) for r, s in zip(rows, seqs, strict=True) for t in {*eos_token_ids, *s.params.stop_token_ids}
    ]
    pairs = [(r, t) for r, t in pairs if 0 <= t < V]
    if pairs:
        r, t = zip(*pairs, strict=True)
        x[list(r), list(t)] = _NEG_INF


def _token_logprobs(logprobs: Tensor, token_ids: Tensor, ks: list[int]) -> list[TokenLogprob]:
    chosen = logprobs.gather(1, token_ids[:, None].long())[:, 0].tolist()
    top_v, top_i = logprobs.topk(max(ks, default=0), dim=-1)  # best first
    return [
        TokenLogprob(t, lp, list(zip(ti[:k], tv[:k], strict=True)))
        for t, lp, ti, tv, k in zip(
            token_ids.tolist(), chosen, top_i.tolist(), top_v.tolist(), ks, strict=True
        )
    ]
