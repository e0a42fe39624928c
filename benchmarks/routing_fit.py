"""The service-time model of the routing simulation, fitted to step times measured on the real engine.

    step_s = overhead_s + token_s * tokens + row_s * rows + attention_s * pairs

`tokens` are the step's tokens (prefill chunks and one per decoding row), `rows` its sequences, `pairs` the
attention's query-key pairs (each new token attends to the tokens before it: a long prefill costs more per
token than a short one, and a prefix-cache hit saves that too). Measured on
SmolLM2-135M-Instruct (fp32, one thread, as one replica of `motet serve --replicas N --threads 1` runs it):
prefill steps of several prompt lengths and decode steps of several batch sizes; plus the time to read and
validate a LoRA adapter (the trained `upper` fixture, rank 8). Run it to refit:

    python -m benchmarks.routing_fit [--threads 1] [--out benchmarks/reports/routing_fit.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "tests" / "fixtures" / "adapters" / "upper"


@dataclass(frozen=True)
class ServiceModel:
    """Seconds. The defaults: `python -m benchmarks.routing_fit --threads 1` on this 2-core machine."""

    overhead_s: float = 0.0093
    token_s: float = 0.00128
    row_s: float = 0.00047
    attention_s: float = 0.0
    adapter_load_s: float = 0.045
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64

    def step_s(self, tokens: float, rows: float, pairs: float = 0.0) -> float:
        return self.overhead_s + self.token_s * tokens + self.row_s * rows + self.attention_s * pairs


def attention_pairs(new_tokens: int, context_before: int) -> float:
    """Query-key pairs of `new_tokens` computed after `context_before` tokens (causal)."""
    return new_tokens * (context_before + (new_tokens + 1) / 2)


def _timed_steps(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int, float, float]]:
    """(tokens, rows, attention pairs, seconds) of each engine step running these prompts to the end."""
    from motet.engine.sampling_params import SamplingParams

    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        batch = engine.schedule()
        pairs = sum(
            attention_pairs(n, s.num_computed_tokens)
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )
        t0 = time.perf_counter()
        engine.commit(batch, engine.execute(batch))
        out.append((sum(batch.num_new_tokens), len(batch), pairs, time.perf_counter() - t0))
    return out


# The steps measured: prefill prompts' lengths and how many of each, decode batches' rows and their steps; with
# --smoke a few short ones (a run that checks the script, not a fit to keep).
STEPS = {
    "prefill": (32, 128, 256, 512, 1024),
    "prefill_repeats": 3,
    "decode": (1, 4, 16, 32, 64),
    "decode_steps": 12,
}
SMOKE_STEPS = {"prefill": (32, 64), "prefill_repeats": 1, "decode": (1, 4), "decode_steps": 5}


def measure(
    threads: int, model: str | None = None, adapter: Path = ADAPTER, steps: dict = STEPS
) -> tuple[list[tuple[int, int, float, float]], float]:
    import random

    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from motet.lora.adapter import load_adapter

    model_options = {"model": model} if model else {}
    engine = LLMEngine(EngineConfig(num_threads=threads, enable_prefix_caching=False, **model_options))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    _timed_steps(engine, [prompt(64)], 4)  # warm up
    samples = []
    for n in steps["prefill"]:  # prefill steps (the first step of each, one sequence)
        for _ in range(steps["prefill_repeats"]):
            samples += _timed_steps(engine, [prompt(n)], 1)
    for rows in steps["decode"]:  # decode steps: skip the prefill, keep the steady decode
        timed = _timed_steps(engine, [prompt(16) for _ in range(rows)], steps["decode_steps"])
        samples += [s for s in timed if s[0] == s[1]][2:]  # (the first steps are the prompts' prefill)
    loads = []
    for _ in range(5):
        t0 = time.perf_counter()
        load_adapter(adapter, engine.model_config, max_rank=64, name="fit")
        loads.append(time.perf_counter() - t0)
    return samples, statistics.median(loads)


def fit(samples: list[tuple[int, int, float, float]], adapter_load_s: float) -> ServiceModel:
    """Least squares of seconds on (1, tokens, rows, pairs), relative to each step's time (short steps count as
    much as long ones), coefficients kept non-negative."""
    import numpy as np

    x = np.array([[1.0, t, r, p] for t, r, p, _ in samples])
    y = np.array([s for *_, s in samples])
    keep = [0, 1, 2, 3]
    while True:  # least squares; a feature that comes out negative is dropped and the rest refitted
        sol, *_ = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones_like(y), rcond=None)
        if (sol >= 0).all():
            break
        keep.pop(int(np.argmin(sol)))
    coef = dict.fromkeys(range(4), 0.0) | dict(zip(keep, sol, strict=True))
    a, b, c, d = (coef[i] for i in range(4))
    return ServiceModel(
        overhead_s=float(f"{a:.3g}"),
        token_s=float(f"{b:.3g}"),
        row_s=float(f"{c:.3g}"),
        attention_s=float(f"{d:.3g}"),
        adapter_load_s=float(f"{adapter_load_s:.3g}"),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default=None, help="default: the engine's default model")
    p.add_argument(
        "--adapter", type=Path, default=ADAPTER, help="a LoRA adapter of the model's (its read time)"
    )
    p.add_argument("--smoke", action="store_true", help="a few short steps: checks the script, fits nothing")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "reports" / "routing_fit.json")
    args = p.parse_args(argv)
    steps = SMOKE_STEPS if args.smoke else STEPS
    samples, adapter_load_s = measure(args.threads, args.model, args.adapter, steps)
    model = fit(samples, adapter_load_s)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": asdict(model), "samples": samples}, indent=1))
    print(json.dumps(asdict(model)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
