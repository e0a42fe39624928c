"""What a step's attention layers read besides their inputs: the paged context of every sequence in the step and
where its new tokens' K/V are written (`AttentionMetadata`), with what the first layer of a kind derives from it
for the others (the sliding-window layers' own metadata, the latent attention's `LatentSplit` of the rows)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from motet.kernels.attention_args import PagedContext


@dataclass
class LatentSplit:
    """A step's rows by the form that computes them: made by the first latent layer, kept on the step's
    metadata for the others."""

    # [n] the rows of one-token sequences (every row: slice(None)), None: there are none
    decode_rows: torch.Tensor | slice | None
    decode_ctx: PagedContext | None  # their paged context (the step's, those sequences only; or the step's)
    # each sequence with several new tokens: (first row, end row, context length incl. the new tokens, blocks)
    prefills: list[tuple[int, int, int, list[int]]]


@dataclass(kw_only=True)
class AttentionMetadata(PagedContext):
    """A step's paged context (what attention reads) and where its new tokens' K/V are written."""

    slot_mapping: torch.Tensor  # [T] int64
    # The sliding-window layers' own: their slots and tables in the window pool (motet/engine/core/kv_window.py)
    window: AttentionMetadata | None = None
    # The latent attention's split of the step's rows (made by its first layer, motet/engine/worker/latent_attention.py)
    latent: LatentSplit | None = None

    def for_window(self) -> AttentionMetadata:
        """The metadata of the sliding-window layers: `window`, or where they keep their KV in the same blocks
        as the others (a context within the window), the same with a CPU plan of their own."""
        if self.window is None:
            self.window = dataclasses.replace(self, cpu_plan=None)
        return self.window
