"""One choice of an API request's answer, accumulated from the engine's deltas, with its timings for the metrics.

The reply streams' readers (motet/api/streams.py) fill it, the bill (motet/api/billing.py) counts it, and the routes
render it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from motet.engine.outputs import OutputDelta, RequestOutput


@dataclass
class Choice(RequestOutput):
    """One choice's output, accumulated from its deltas as the engine's answers are (`RequestOutput.add`), with its
    timings for the metrics. Its `error` is the ServingError its client is told."""

    index: int
    prompt_ids: list[int]
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    token_gaps: list[tuple[float, int]] = field(
        default_factory=list
    )  # after the first delta: (s/token, tokens)
    prompt_index: int = 0  # which prompt of the request it answers (completions take several)
    observed: bool = False  # counted in the metrics

    def __post_init__(self) -> None:
        self.prompt_token_ids = self.prompt_ids

    def add(self, d: OutputDelta) -> None:
        if d.token_ids:
            now = time.perf_counter()
            if self.first_token is None:
                self.first_token = now
            else:
                self.token_gaps.append(((now - self.last_token) / len(d.token_ids), len(d.token_ids)))
            self.last_token = now
        super().add(d)
