"""The step's token budget: small while prompts keep up; while they wait, large enough that the decode rows take
at most an eighth of it (issue 67).

A small step bounds how long a request arriving during it waits, and on a CPU a prompt token costs no more in it
than in a large one. But every decoding row takes its token from the step first: at 64 rows a 256-token step
leaves prompts three quarters, and with clients that send their next request as soon as an answer ends (a
closed loop), the next round's prompts arrive about as fast as they are prefilled, and queue. So after a step
that left prompt tokens waiting (a running row's chunk cut short, or a waiting sequence with a free slot to start
in), the next step's budget is `DECODE_SHARE` tokens for each running row (between `base` and `most`): the
prompts' share stays seven eighths whatever the number of rows, and a step's length grows with the rows, which
already set every row's TPOT. Up to 32 rows on a CPU nothing changes (8 x 32 = 256). A step that leaves no prompt
tokens waiting, or one sized down for a latency-bound tenant (motet/engine/core/latency.py: its steps stay within
the TPOT target), sets it back to `base`.

Measured at 64 clients on the 2-core Zen 1 (fp32, 64-word prompts, 64-token answers, two rounds): against a
fixed 256 in one run of benchmarks/vllm_cpu.py (--peer-url; reports/vllm_cpu/2026-11-28-zen1-fp32-step-budget)
TTFT p50 4.3 vs 4.5 s, p99 28.5 vs 28.6 s, 86.7 vs 86.1 tokens/s; in four runs of a fresh server at that one level
(two each) p50 3.6 vs 6.3-6.4 s, p99 24.0-24.9 vs 26.4-26.6 s, 95 vs 89-91 tokens/s. The second round's queue is
near saturation and swings from run to run (at 32 clients, where the two are one policy, the p50s differed by
0.8 s); at 64 the change never measured worse.

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
