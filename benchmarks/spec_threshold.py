"""What verifying drafts costs: step time of B decode rows carrying k drafts each, against the same rows
without drafts, offline on one engine (no server). `EngineConfig.speculative_overhead_tokens` comes from here.

A row that verifies k drafts and keeps a of them gains a tokens for the step's extra cost, so at batch B
speculation pays while the mean accepted length 1 + a exceeds T(B, k) / T(B, 0). At small B a step reads
the weights once whatever its rows' lengths (bandwidth-bound) and the ratio stays near 1; past the point
where it is compute-bound the ratio approaches k + 1 and drafts must nearly always be accepted. A line
T = c (overhead + tokens) fitted over all points gives the overhead in token-times that the engine's cost
model prices drafts against (motet/engine/speculative/proposer.py).

    python -m benchmarks.spec_threshold --batches 1 2 4 8 16 32 --drafts 1 2 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams


def step_ms(llm: LLM, k: int, reps: int) -> float:
    """Median ms of one step of the running rows with k drafts each (its execute: the forward pass, verifying
    and sampling); each step is committed as the engine commits it (the rows keep what they accept), so the next
    one starts from a consistent state."""
    engine, times = llm.engine, []
    engine.flush()  # an overlapped engine's launched step lands first: the steps below are driven by hand
    for _ in range(reps):
        for seq in engine.scheduler.running:
            seq.draft_token_ids = (
                seq.token_ids[-k:] if k else []
            )  # any tokens: the cost does not depend on them
        batch = engine.scheduler.schedule()
        assert all(n == 1 + k for n in batch.num_new_tokens), batch.num_new_tokens
        t0 = time.perf_counter()
        result = engine.execute(batch)
        result.resolve()
        times.append(time.perf_counter() - t0)
        assert not any(result.errors), result.errors
        engine.commit(batch, result)
    return 1e3 * statistics.median(times)


def measure(
    model: str, batches: list[int], drafts: list[int], prompt_tokens: int, reps: int, threads
) -> list:
    rows = []
    for b in batches:
        llm = LLM(model, max_num_seqs=b, max_num_batched_tokens=max(2048, b * (prompt_tokens + 1)),
                  num_threads=threads)  # fmt: skip
        words = [
            "the",
            "quick",
            "brown",
            "fox",
            "jumps",
            "over",
            "the",
            "lazy",
            "dog",
            "and",
            "runs",
            "away",
            "into",
            "the",
            "forest",
        ]
        for i in range(b):
            text = " ".join(words[(i + j) % len(words)] for j in range(prompt_tokens))
            llm.engine.add_request(text, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
        while llm.engine.scheduler.waiting or any(
            s.num_computed_tokens < s.num_tokens - 1 for s in llm.engine.scheduler.running
        ):
            llm.engine.step()
        base = step_ms(llm, 0, reps)
        row = {"batch": b, "step_ms": {0: base}, "ratio": {}}
        for k in drafts:
            row["step_ms"][k] = step_ms(llm, k, reps)
            row["ratio"][k] = row["step_ms"][k] / base
        rows.append(row)
        print(f"batch {b:3d}: plain {base:7.2f} ms; "
              + ", ".join(f"k={k}: {row['step_ms'][k]:7.2f} ms ({row['ratio'][k]:.2f}x)" for k in drafts),
              flush=True)  # fmt: skip
        del llm
    return rows


def overhead_tokens(rows: list[dict]) -> float:
    """The intercept over the slope of step ms against tokens in the step (least squares)."""
    points = [(r["batch"] * (1 + k), ms) for r in rows for k, ms in r["step_ms"].items()]
    slope, intercept = statistics.linear_regression(*zip(*points, strict=True))
    return intercept / slope


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = measure(args.model, args.batches, args.drafts, args.prompt_tokens, args.reps, args.threads)
    report = {"rows": rows, "overhead_tokens": overhead_tokens(rows)}
    print(f"a step costs about {report['overhead_tokens']:.1f} + its tokens, in token-times "
          "(--speculative-overhead-tokens)")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
