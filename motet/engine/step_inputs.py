"""A step's input tokens where some are still pending: async scheduling launches step N+1 before step N's
sampled tokens reach the host (motet/engine/llm_engine.py), so N+1 takes those inputs from N's sampled tokens
on the device. Used by the eager inputs (motet/engine/model_runner.py) and the CUDA graphs' static buffers
(motet/engine/cuda_graphs.py) alike."""

from __future__ import annotations

import torch

from motet.engine.sequence import Sequence


def decode_inputs(seqs: list[Sequence], positions: list[int]) -> tuple[list[int], list[tuple[int, Sequence]]]:
    """Each row's input token, at its position, and the feeds: (the input's index, the row) for the rows whose
    token is still pending (sampled by the step before, not on the host yet: 0 in the list until `feed_tokens`
    writes it)."""
    ids, feeds = [], []
    for i, (seq, p) in enumerate(zip(seqs, positions, strict=True)):
        tokens = seq.token_ids
        if p < len(tokens):
            ids.append(tokens[p])
        else:
            ids.append(0)
            feeds.append((i, seq))
    return ids, feeds


def feed_tokens(ids: torch.Tensor, feeds: list[tuple[int, Sequence]], pinned: bool) -> None:
    """Write the pending tokens into a step's input ids on the device, from the steps that sampled them (each
    row's `last_sampled`; the device thread's, read once the step before has run): no host wait (the indices go
    from pinned memory). Usually they all come from the step before: one gather."""
    sources: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for dst, seq in feeds:
        tokens, src = seq.last_sampled
        entry = sources.get(id(tokens))
        if entry is None:
            entry = sources[id(tokens)] = (tokens, [], [])
        entry[1].append(dst)
        entry[2].append(src)
    for tokens, dsts, srcs in sources.values():
        if (
            ids.device.type == "cpu" and tokens.device.type == "cpu"
        ):  # plain host memory: no tensor ops needed
            ids.numpy()[dsts] = tokens.numpy()[srcs]
            continue
        index = torch.tensor([dsts, srcs], dtype=torch.int64, pin_memory=pinned).to(
            ids.device, non_blocking=True
        )
        ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))
