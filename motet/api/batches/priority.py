"""When a batch line may go (`LowPriority`): live requests first. Plain values, read by `motet serve`'s parser
(`--batch-max-in-flight`'s default) before the API's modules are imported; runner.py sends the lines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from motet.actors.front import Stats

DEFAULT_MAX_IN_FLIGHT = 4


@dataclass
class LowPriority:
    """The scheduling hook: whether one more batch line may be sent now. Live requests first: a line goes
    only while nothing waits (queued, or admitted and not running), every line sent before is seen running
    (one on its way from the queue to the engine shows in neither count yet), and fewer than `max_in_flight`
    lines are out."""

    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT

    def __post_init__(self):
        if self.max_in_flight < 1:
            raise ValueError("--batch-max-in-flight must be at least 1")

    def admits(self, stats: Stats, in_flight: int) -> bool:
        nothing_waits = stats.queued == 0 and stats.num_waiting == 0
        return in_flight < self.max_in_flight and nothing_waits and stats.num_running >= in_flight
