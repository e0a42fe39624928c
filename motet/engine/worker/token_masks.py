"""vLLM's logits masks: `bad_words` and `allowed_token_ids`, with vLLM's semantics.

A bad word is banned as token sequences: the word as it starts a text and, where that tokenizes differently,
after a space (as it appears mid-text). At each position the last token of a sequence is masked when the
tokens just generated equal the rest of it (only the output is looked at, never the prompt), so the sequence
never appears in the output. `allowed_token_ids` masks every other token. The sampler applies both before
penalties and temperature, at every position it samples, draft positions included
(motet/engine/speculative/verify.py), so speculation never changes what they allow.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from motet.engine.worker.rows import PENDING
from motet.engine.worker.step_inputs import pending_tokens

_NEG_INF = float("-inf")


def bad_words_token_ids(bad_words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each bad word's token sequences: as it starts a text, and after a space where that is another
    sequence of as many tokens starting with another token (vLLM's `update_from_tokenizer`).
    `encode` tokenizes without special tokens."""
    out: list[list[int]] = []
    for word in bad_words:
        alone = encode(word.lstrip())
        if not alone:
            continue
        out.append(alone)
        spaced = encode(" " + word.lstrip())
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            out.append(spaced)
    return out


def banned_tokens(sequences: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete a bad word's sequence after `output` (the tokens generated so far)."""
    return [t for t, pending in banned_after(sequences, output) if pending is None]


def banned_after(sequences: list[list[int]], output: list[int]) -> list[tuple[int, int | None]]:
    """(token, needs): the tokens that would complete a bad word's sequence after `output`, where a token of it
    may be pending (`PENDING`, motet/engine/worker/rows.py: sampled by the step before, not on the host yet):
    `needs` None where the rest matches, else the token the pending one must be for it to match."""
    banned = []
    for seq in sequences:
        n = len(seq) - 1
        if n > len(output):
            continue
        needs = None
        tail = output[len(output) - n :] if n else []
        for got, want in zip(tail, seq, strict=False):
            if got == PENDING and needs is None:
                needs = want
            elif got != want:
                break
        else:
            banned.append((seq[-1], needs))
    return banned


def apply_token_masks(x: Tensor, seqs: list, rows: list[int]) -> None:
    """Mask x[rows] (one row per seq, the sampler's views: their `params`, `output_token_ids` and `pending` are
    read) in place. A ban that depends on a pending token is applied on the device, where the token is."""
    V = x.shape[1]
    held = []  # (row, token, the pending token that bans it, the view)
    for r, s in zip(rows, seqs, strict=True):
        p = s.params
        if p.allowed_token_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool, device=x.device)
            keep[
                torch.tensor([t for t in p.allowed_token_ids if t < V], dtype=torch.long, device=x.device)
            ] = True
            x[r].masked_fill_(~keep, _NEG_INF)
        if p.bad_words_token_ids:
            bans = [
                (t, needs) for t, needs in banned_after(p.bad_words_token_ids, s.output_token_ids) if t < V
            ]
            banned = [t for t, needs in bans if needs is None]
            if banned:
                x[r, banned] = _NEG_INF
            held.extend((r, t, needs, s) for t, needs in bans if needs is not None)
    if (
        held
    ):  # -inf added where the pending token is the one the ban needs, 0 elsewhere (bans may repeat a token)
        dev = x.device
        pending = pending_tokens([s for *_, s in held], dev)
        needs = torch.tensor([needs for _, _, needs, _ in held], device=dev)
        where = (
            torch.tensor([r for r, *_ in held], device=dev),
            torch.tensor([t for _, t, *_ in held], device=dev),
        )
        x.index_put_(where, torch.where(pending == needs, _NEG_INF, 0.0).to(x.dtype), accumulate=True)
