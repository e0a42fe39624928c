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
    banned = []
    for seq in sequences:
        n = len(seq) - 1
        if n > len(output):
            continue
        if n == 0 or output[-n:] == seq[:-1]:
            banned.append(seq[-1])
    return banned


def apply_token_masks(x: Tensor, seqs: list, rows: list[int]) -> None:
    """Mask x[rows] (one row per seq, whose `params` and `output_token_ids` are read) in place."""
    V = x.shape[1]
    for r, s in zip(rows, seqs, strict=True):
        p = s.params
        if p.allowed_token_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool, device=x.device)
            keep[
                torch.tensor([t for t in p.allowed_token_ids if t < V], dtype=torch.long, device=x.device)
            ] = True
            x[r].masked_fill_(~keep, _NEG_INF)
        if p.bad_words_token_ids:
            banned = [t for t in banned_tokens(p.bad_words_token_ids, s.output_token_ids) if t < V]
            if banned:
                x[r, banned] = _NEG_INF
