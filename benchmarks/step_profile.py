"""Where a step's time goes, per batch size: the engine's phases offline, then the serving path around it.

    python -m benchmarks.step_profile [--dtype bfloat16] [--batches 1 8 32 64] [--adapters 8] [--steps 24]
                                 [--serve-levels 1 32] [--threads 2] [--overlap-output on]
                                 [--no-async-scheduling] [--out DIR]

Offline, for each batch size and each load (the base model; requests spread over --adapters distinct
random rank-16 adapters; every request constrained by a JSON schema), a batch decodes and --steps decode
steps are timed phase by phase (median step and mean shares): scheduling; building the step's input
tensors; the forward pass, split by the native kernels' own clocks into linear layers, attention, LoRA
deltas and the rest (norms, rotary, KV writes, SiLU); logits; grammar masks (the wait for the side
thread's bitmask and applying it); sampling; and the commit (appending, detokenizing, stop checks, grammar
advance). The eager model (`--no-compile`) runs the base load too: its forward time minus the compiled
one's is Python and per-op dispatch.

Serving, for each of --serve-levels C: a `motet serve` on loopback takes 2 x C streamed chat requests, C at
once (--max-tokens each, EOS ignored), and the offline engine (max_num_seqs C) runs the same prompts: the
served share of the offline tokens/s is what the serving path (actors, reply streams, detokenized SSE,
HTTP) costs; the client-side TPOT p50 sits beside the offline step time at batch C. Writes results.json
and summary.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks import write_report
from motet.engine.llm import LLM
from motet.engine.model_store import resolve_model
from motet.engine.sampling_params import SamplingParams
from motet.evals.lora_reference import write_random_adapter
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import machine, make_prompts, run_level, summarize
from motet.evals.throughput import chat_prompts

PHASES = ("schedule", "inputs", "linear", "attention", "lora", "other", "forward", "logits", "grammar",
          "sampling", "execute_rest", "commit", "host")  # fmt: skip
# The host's share of a step: everything but the forward pass and the logits (the device's work on a GPU).
HOST = ("schedule", "inputs", "grammar", "sampling", "execute_rest", "commit")
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "words": {"type": "array",
          "items": {"type": "string"}, "minItems": 40}}, "required": ["title", "words"]}  # long: all rows stay  # fmt: skip


class Timers:
    """Wraps the engine's and runner's methods with accumulating clocks (an eval only: production has none)."""

    def __init__(self, llm: LLM):
        self.engine, self.runner = llm.engine, llm.engine.runner
        self.t: dict[str, float] = defaultdict(float)
        for obj, name, phase in ((self.runner, "_prepare", "inputs"), (self.runner, "forward", "forward"),
                                 (self.runner, "_logits", "logits"), (self.runner, "sampler", "sampling"),
                                 (self.runner, "_apply_grammar", "grammar")):  # fmt: skip
            self._wrap(obj, name, phase)

    def _wrap(self, obj, name, phase):
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t[phase] += time.perf_counter() - t0

        setattr(obj, name, timed)

    def step(self) -> dict[str, float]:
        """One timed step: its phases in seconds."""
        self.t.clear()
        native = self.runner.native
        if native is not None:
            native.profile()
        t0 = time.perf_counter()
        batch = self.engine.schedule()
        t1 = time.perf_counter()
        result = self.engine.execute(batch)
        t2 = time.perf_counter()
        self.engine.commit(batch, result)
        t3 = time.perf_counter()
        out = dict(self.t)
        out["schedule"], out["commit"] = t1 - t0, t3 - t2
        out["forward"] = out.get("forward", 0.0) - out.get("inputs", 0.0)  # forward() builds the inputs
        if native is not None:
            out.update(native.phase_seconds())
            out["forward"] -= sum(native.phase_seconds().values())  # what is left: ctypes, embedding lookup
        inside = (
            "inputs",
            "forward",
            "linear",
            "attention",
            "lora",
            "other",
            "logits",
            "grammar",
            "sampling",
        )
        out["execute_rest"] = (t2 - t1) - sum(out.get(k, 0.0) for k in inside)
        out["total"] = t3 - t0
        out["rows"] = len(batch)
        out["host"] = sum(out.get(k, 0.0) for k in HOST)
        return out


def device_idle(engine, steps: int) -> dict:
    """`engine.step()` as the engine runs it (overlapped or not): per step, how long the forward pass waits for
    the host (from one step's end, sampled tokens in hand, to the next forward's start: the host's work in the
    device's way), and the step's period. Instruments only methods both the sequential and the overlapped
    engine have, so an older engine is measured the same way."""
    runner, execute, forward = engine.runner, engine.execute, engine.runner._forward
    starts, ends = [], []

    def timed_forward(*a, **kw):
        starts.append(time.perf_counter())
        return forward(*a, **kw)

    def timed_execute(*a, **kw):
        try:
            return execute(*a, **kw)
        finally:
            ends.append(time.perf_counter())

    runner._forward, engine.execute = timed_forward, timed_execute
    try:
        for _ in range(steps + 1):
            engine.step()
    finally:
        del runner._forward, engine.execute
    n = min(len(starts), len(ends))
    idle = [starts[k + 1] - ends[k] for k in range(n - 1)]
    period = [ends[k + 1] - ends[k] for k in range(n - 1)]
    return {"idle_ms": 1e3 * statistics.median(idle), "period_ms": 1e3 * statistics.median(period)}


def profile(llm: LLM, prompts, adapters, params: SamplingParams, steps: int) -> dict:
    """Median step time and mean phase shares over `steps` decode steps of the whole batch."""
    engine = llm.engine
    for p, a in zip(prompts, adapters, strict=True):
        engine.add_request(p, params, adapter=a)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()  # prefill
    timers = Timers(llm)
    for _ in range(2):
        engine.step()
    # an overlapped engine's launched step is committed: the timed steps below are driven by hand
    getattr(engine, "flush", list)()
    samples = []
    while len(samples) < steps and engine.scheduler.running:  # a constrained output may end early
        samples.append(timers.step())
    idle = device_idle(engine, steps) if len(engine.scheduler.running) == len(prompts) else {}
    getattr(engine, "flush", list)()
    while engine.has_unfinished():
        engine.step()
    total = statistics.median(s["total"] for s in samples)
    mean = {k: statistics.fmean(s.get(k, 0.0) for s in samples) for k in PHASES}
    return {"step_ms": 1e3 * total, "tokens_per_s": statistics.fmean(s["rows"] for s in samples) / total,
            "host_ms": 1e3 * statistics.median(s["host"] for s in samples),
            "rows": statistics.fmean(s["rows"] for s in samples),
            "phases_ms": {k: 1e3 * v for k, v in mean.items()}, **idle}  # fmt: skip


def offline(args, model_dir: Path, tmp: Path) -> list[dict]:
    rows = []
    for compiled in (True, False)[: 1 if args.no_eager else 2]:
        for b in args.batches:
            llm = LLM(str(model_dir), dtype=args.dtype, max_num_seqs=b, num_threads=args.threads,
                      quantization=args.quantization,
                      num_kv_blocks=b * 24 + 16, max_loras=max(1, args.adapters), max_lora_rank=16,
                      compile_step=compiled, speculative="off",
                      **({"overlap_output": args.overlap_output} if args.overlap_output else {}),
                      **({"async_scheduling": args.async_scheduling} if args.async_scheduling is not None else {}))  # fmt: skip
            prompts = chat_prompts(llm.tokenizer, b)  # (speculation off above: plain steps, one token a row)
            # long enough that no row ends before the last of the batch has its prompt in and --steps are timed
            length = args.steps + 8 + b
            free = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
            loads = {"base": (free, [None] * b)}
            if compiled and args.adapters:
                refs = [llm.add_lora(f"a{i}", write_random_adapter(tmp / f"a{i}", llm.engine.model_config, 16, i))
                        for i in range(args.adapters)]  # fmt: skip
                loads[f"{args.adapters} adapters"] = (free, [refs[i % len(refs)] for i in range(b)])
            if compiled:
                from motet.grammar.specs import JsonSchemaSpec

                guided = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True,
                                        grammar=JsonSchemaSpec(SCHEMA))  # fmt: skip
                loads["JSON schema"] = (guided, [None] * b)
            for load, (params, adapters) in loads.items():
                res = profile(llm, prompts, adapters, params, args.steps)
                res.update(batch=b, load=load, compiled=compiled)
                rows.append(res)
                print(f"{'compiled' if compiled else 'eager':8s} batch {b:3d} {load:12s} {res['step_ms']:8.2f} ms/step "
                      f"{res['tokens_per_s']:7.1f} tok/s, host {res['host_ms']:.2f} ms, {res['rows']:.0f} rows, "
                      f"device idle {res.get('idle_ms', float('nan')):.2f} ms", flush=True)  # fmt: skip
            del llm
    return rows


def serving(args, model_dir: Path, offline_rows: list[dict]) -> list[dict]:
    """Per level C: 2C streamed chat requests at once through the server, then the same prompts through the
    offline engine (max_num_seqs C): output tokens/s of each, and TPOT against the offline step time."""
    step_ms = {r["batch"]: r["step_ms"] for r in offline_rows if r["compiled"] and r["load"] == "base"}
    rows, loads = [], {}
    for c in args.serve_levels:
        texts = [f"Continue this text: {p}" for p in make_prompts(2 * c, 40, c)]
        loads[c] = texts
    server_args = [
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--max-num-seqs",
        str(max(args.serve_levels)),
        "--speculative",
        "off",
        *(["--quantization", args.quantization] if args.quantization else []),
    ]
    with ManagedServer(server_args, model=str(model_dir)) as server:
        for c, texts in loads.items():
            reqs = [("/chat/completions", {"model": model_dir.name, "max_tokens": args.max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                     "messages": [{"role": "user", "content": t}]}) for t in texts]  # fmt: skip
            records, duration = asyncio.run(run_level(server.base_url, reqs, c))
            res = summarize(records, duration, c)
            rows.append({"clients": c, "served_tokens_per_s": res["output_token_throughput"],
                         "tpot_p50_ms": 1e3 * res["tpot_s"]["p50"], "offline_step_ms": step_ms.get(c)})  # fmt: skip
    for row in rows:
        c = row["clients"]
        llm = LLM(
            str(model_dir),
            dtype=args.dtype,
            max_num_seqs=c,
            num_threads=args.threads,
            quantization=args.quantization,
            speculative="off",
        )
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.chat([[{"role": "user", "content": t}] for t in loads[c]], params)
        row["offline_tokens_per_s"] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
        row["served_share"] = row["served_tokens_per_s"] / row["offline_tokens_per_s"]
        del llm
        print(f"serving {c:3d} clients: {row['served_tokens_per_s']:.1f} tok/s served, "
              f"{row['offline_tokens_per_s']:.1f} offline on the same load ({100 * row['served_share']:.0f}%); "
              f"TPOT p50 {row['tpot_p50_ms']:.2f} ms", flush=True)  # fmt: skip
    return rows


def summary_md(report: dict) -> str:
    cols = [p for p in PHASES if any(r["phases_ms"].get(p, 0) > 0.005 for r in report["offline"])]
    lines = [f"# Where a step's time goes ({report['dtype']}, {report['threads']} threads)", "",
             "Mean ms per decode step by phase (median step in `step ms`).", "",
             "| step | batch | load | step ms | tok/s | " + " | ".join(cols) + " |",
             "|---|---:|---|---:|---:|" + "---:|" * len(cols)]  # fmt: skip
    for r in report["offline"]:
        ph = " | ".join(f"{r['phases_ms'].get(p, 0):.2f}" for p in cols)
        lines.append(f"| {'compiled' if r['compiled'] else 'eager'} | {r['batch']} | {r['load']} | "
                     f"{r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | {ph} |")  # fmt: skip
    if report["serving"]:
        lines += ["", "The same load served over HTTP and run offline (2 x C requests, C at once):", "",
                  "| clients | served tok/s | offline tok/s | served / offline | TPOT p50 ms | offline step ms |",
                  "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in report["serving"]:
            off = "" if r["offline_step_ms"] is None else f"{r['offline_step_ms']:.2f}"
            lines.append(f"| {r['clients']} | {r['served_tokens_per_s']:.1f} | {r['offline_tokens_per_s']:.1f} | "
                         f"{100 * r['served_share']:.0f}% | {r['tpot_p50_ms']:.2f} | {off} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="as `motet serve --quantization`")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager model's rows")
    ap.add_argument("--overlap-output", default=None, choices=["auto", "on", "off"],
                    help="as `motet serve --overlap-output` (default: the engine's)")  # fmt: skip
    ap.add_argument("--async-scheduling", default=None, action=argparse.BooleanOptionalAction,
                    help="as `motet serve --async-scheduling` (default: the engine's)")  # fmt: skip
    ap.add_argument("--serve-levels", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model_dir = Path(resolve_model(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        off = offline(args, model_dir, Path(tmp))
    report = {"dtype": args.dtype, "threads": args.threads, "machine": machine(), "offline": off,
              "serving": serving(args, model_dir, off) if args.serve_levels else []}  # fmt: skip
    out = Path(args.out or f"reports/step_profile/{time.strftime('%Y%m%d-%H%M%S')}")
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    main()
