"""The step's token budget: small while prompts keep up; while they wait, large enough that the decode rows take
at most an eighth of it (issue 67).

A small step bounds how long a request arriving during it waits, and on a CPU a prompt token costs no more in it
than in a large one. But every decoding row takes its token from the step first: at 64 rows a 256-token step
leaves prompts three quarters, and with clients that send their next request as soon as an answer ends (a
closed loop), prompts then arrive as fast as they are prefilled and queue: on the 2-core Zen 1 (fp32, 64
clients, 64-word prompts) the second round's median prompt waited 5.0-5.9 s for its first token. So after a step
that left prompt tokens waiting (a running row's chunk cut short, or a waiting sequence with a free slot to start
in), the next step's budget is `DECODE_SHARE` tokens for each running row (between `base` and `most`): the
prompts' share stays seven eighths whatever the number of rows, and a step's length grows with the rows, which
already set every row's TPOT. Up to 32 rows on a CPU nothing changes (8 x 32 = 256). A step that leaves no prompt
tokens waiting, or one sized down for a latency-bound tenant (motet/engine/core/latency.py: its steps stay within
the TPOT target), sets it back to `base`. Measured against a fixed 256 in two runs, roles swapped
(benchmarks/reports/vllm_cpu/2026-11-28c-zen1-fp32-step-budget-ab): at 64 clients the TTFT p99 27.95 / 27.10 s
against 33.23 / 28.72; tokens/s 2-4% lower and the p50 either way, both within the load's 3-4% swing (at 32
clients, where the two are the same step).

A budget that doubled each step while prompts waited, up to 1,024, was tried first: its 1,024-token steps (3.5 s
each here) prefilled a wave's prompts together, so their answers ended together, the next round arrived bunched,
and each of its prompts waited for a whole long step: the p99 fell but the p50 doubled.
"""

from __future__ import annotations

# While prompts wait, a step holds this many tokens for each running row: decode rows at most an eighth of it.
DECODE_SHARE = 8


class StepBudget:
    """The next step's budget (`tokens`), told after each step what it saw."""

    def __init__(self, base: int, most: int | None = None):
        self.base = base
        self.most = max(base, most or base)
        self.tokens = base

    def after_step(self, running: int, prompts_waiting: bool, capped: bool) -> None:
        """`running`: the rows running after the step; `prompts_waiting`: it left prompt tokens it had no budget
        for; `capped`: it was sized down for a latency-bound tenant."""
        grown = min(self.most, max(self.base, DECODE_SHARE * running))
        self.tokens = grown if prompts_waiting and not capped else self.base
