"""What a step's attention layers read besides their inputs: the paged context of every sequence in the step and
where its new tokens' K/V are written (`AttentionMetadata`), with what the first layer of a kind derives from it
for the others (the sliding-window layers' own metadata; what a kind of layer derives once a step, `derive`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from motet.kernels.attention_args import PagedContext


@dataclass(kw_only=True)
class AttentionMetadata(PagedContext):
    """A step's paged context (what attention reads) and where its new tokens' K/V are written."""

    slot_mapping: torch.Tensor  # [T] int64
    # The sliding-window layers' own: their slots and tables in the window pool (motet/engine/core/kv_window.py)
    window: AttentionMetadata | None = None
    # What the first layer of a kind derives from the step for the others, by key (`derive`)
    derived: dict[str, object] | None = None

    def derive(self, key: str, make):
        """`make()`, made by the first layer that asks for `key` this step and kept for the others (the latent
        attention's split of the rows: motet/engine/worker/latent_attention.py)."""
        if self.derived is None:
            self.derived = {}
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]

    def for_window(self) -> AttentionMetadata:
        """The metadata of the sliding-window layers: `window`, or where they keep their KV in the same blocks
        as the others (a context within the window), the same with a CPU plan of their own."""
        if self.window is None:
            self.window = dataclasses.replace(self, cpu_plan=None, derived=None)
        return self.window
