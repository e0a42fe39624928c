"""Where a step's time goes, per batch size: the engine's phases offline, then the serving path around it.

    python -m benchmarks.step_profile [--dtype bfloat16] [--batches 1 8 32 64] [--adapters 8] [--steps 24]
                                 [--serve-levels 1 32] [--threads 2] [--overlap-output on]
                                 [--no-async-scheduling] [--out DIR]

Offline, for each batch size and each load (the base model; requests spread over --adapters distinct
random rank-16 adapters; every request constrained by a JSON schema), a batch decodes and --steps decode
steps are timed stage by stage (median step and mean shares), the engine's schedule -> execute -> commit
driven by hand: scheduling; inside execute, the step's LoRA segments (`adapters`), building and sending the
step's input tensors (`inputs`), the forward pass split by the native kernels' own clocks into linear layers,
attention, LoRA deltas and the rest (norms, rotary, KV writes, SiLU; `forward` is what is left outside them:
the embedding lookup and the call), logits, grammar masks (starting the side thread's bitmask, waiting for
it, applying it), sampling and the rest of execute (verify, prompt logprobs); then the commit's two halves:
`commit_tokens` (appending, stop checks, grammar advance) and `commit_text` (detokenizing, the outputs). The
eager model (`--no-compile`) runs the base load too: its forward time minus the compiled one's is Python and
per-op dispatch.

Against this CPU's real peak: before the engines load, torch's linear runs the model's own projection shapes
(q, k, v, o, gate, up, down and the lm_head) at each batch's rows in bfloat16 and float32; per row of the
report, the forward's and its linear phase's achieved GFLOPS (2 x the projections' parameters x tokens / the
phase's time) are set against the forward's shapes at their faster dtype, the logits' against the lm_head's.

Serving, for each of --serve-levels C: a `motet serve` on loopback takes R x C streamed chat requests (R: --serve-rounds, 2 by default), C at
once (--max-tokens each, EOS ignored), and the offline engine (max_num_seqs C) runs the same prompts: the
served share of the offline tokens/s is what the serving path (actors, reply streams, detokenized SSE,
HTTP) costs; the client-side TPOT p50 (first token to last over the tokens after the first) sits beside the
offline one taken alike from the engine's stamps (RequestTimings.decode_s) and the offline step time at batch
C. Writes results.json and summary.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks import cpu_info, cpu_line, write_report
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.model_store import resolve_model
from motet.evals.lora_reference import write_random_adapter
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import GREEDY, machine, make_prompts, run_level, summarize
from motet.evals.throughput import chat_prompts

PHASES = ("schedule", "adapters", "inputs", "linear", "attention", "lora", "other", "forward", "logits", "grammar",
          "sampling", "execute_rest", "commit_tokens", "commit_text", "host")  # fmt: skip
# linear, attention, lora, other: the forward pass's parts by the native kernels' own clocks
# (motet/kernels/cpu_native.PHASES); "forward" is the rest of it (the embedding lookup and the call; the whole
# forward on the eager model).
# The host's share of a step: everything but the forward pass and the logits (the device's work on a GPU).
HOST = (
    "schedule",
    "adapters",
    "inputs",
    "grammar",
    "sampling",
    "execute_rest",
    "commit_tokens",
    "commit_text",
)
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "words": {"type": "array",
          "items": {"type": "string"}, "minItems": 40}}, "required": ["title", "words"]}  # long: all rows stay  # fmt: skip


class Timers:
    """Accumulating clocks around the step's stages (an eval only: production has none), removed by `close()`.

    The step is the engine's schedule -> execute -> commit (motet/engine/llm_engine.py), driven here by hand so
    each stage is timed in order. Inside `execute`: the step's LoRA segments (`adapters.batch`), the grammar
    masks (`engine.structured_output.mask`, then the wait for the side thread's bitmask and applying it: the masks' own
    stats), the inputs built on the host and sent (`InputBuilder.host` / `graph_rows`, `to_device`), the forward
    (the step backend's `forward`, or the CUDA graphs' `run_rows`; split by the native step's clocks), the
    logits (the backend's `logits`) and the sampler; the commit is its two halves (`commit_tokens`,
    `commit_text`)."""

    def __init__(self, llm: LLM):
        self.engine, self.runner = llm.engine, llm.engine.runner
        self.t: dict[str, float] = defaultdict(float)
        self.logit_rows = 0
        self._undo: list = []
        steps = self.runner.steps
        eager = getattr(steps, "eager", steps)  # (GraphSteps keeps the eager step behind it)
        inputs = eager.inputs
        for obj, name, phase in ((self.engine.adapters, "batch", "adapters"), (inputs, "host", "inputs"),
                                 (inputs, "graph_rows", "inputs"), (inputs, "to_device", "inputs"),
                                 (eager, "forward", "forward"), (self.engine.structured_output, "mask", "grammar")):  # fmt: skip
            self._wrap(obj, name, phase)
        if getattr(steps, "graphs", None) is not None:
            self._wrap(steps.graphs, "run_rows", "forward")
        self._wrap(steps, "logits", "logits", lambda hidden, *a, **kw: setattr(self, "logit_rows",
                   self.logit_rows + hidden.shape[0]))  # fmt: skip
        sampler = self.runner.sampler
        self._set(self.runner, "sampler", _Timed(sampler, self._clock("sampling")))

    def _clock(self, phase: str, note=None):
        def timed(fn):
            def call(*a, **kw):
                if note is not None:
                    note(*a, **kw)
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.t[phase] += time.perf_counter() - t0

            return call

        return timed

    def _set(self, obj, name: str, value) -> None:
        own = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, value)
        self._undo.append((obj, name, own, old))

    def _wrap(self, obj, name: str, phase: str, note=None) -> None:
        self._set(obj, name, self._clock(phase, note)(getattr(obj, name)))

    def close(self) -> None:
        """The stages as they were."""
        for obj, name, own, old in reversed(self._undo):
            if own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo.clear()

    def step(self) -> dict[str, float]:
        """One timed step: its phases in seconds, its tokens and logit rows."""
        self.t.clear()
        self.logit_rows = 0
        engine, native, grammar = self.engine, self.runner.native, self.engine.structured_output.stats
        masked = grammar.wait_s + grammar.apply_s
        if native is not None:
            native.profile()
        t0 = time.perf_counter()
        batch = engine.schedule()
        t1 = time.perf_counter()
        result = engine.execute(batch)
        t2 = time.perf_counter()
        landed = engine.commit_tokens(batch, result)
        t3 = time.perf_counter()
        engine.commit_text(landed)
        t4 = time.perf_counter()
        out = dict(self.t)
        out["schedule"], out["commit_tokens"], out["commit_text"] = t1 - t0, t3 - t2, t4 - t3
        out["grammar"] = out.get("grammar", 0.0) + (grammar.wait_s + grammar.apply_s - masked)
        out["forward_total"] = out.get("forward", 0.0)
        if native is not None:
            parts = native.phase_seconds()
            out.update(parts)
            out["forward"] = out["forward_total"] - sum(
                parts.values()
            )  # what is left: the call, embedding lookup
        inside = ("adapters", "inputs", "forward_total", "logits", "grammar", "sampling")
        out["execute_rest"] = (t2 - t1) - sum(out.get(k, 0.0) for k in inside)
        out["total"] = t4 - t0
        out["rows"] = len(batch)
        out["tokens"] = batch.num_tokens
        out["logit_rows"] = self.logit_rows
        out["host"] = sum(out.get(k, 0.0) for k in HOST)
        return out


class _Timed:
    """A callable object (the sampler) timed by `clock`; its attributes read through."""

    def __init__(self, obj, clock):
        self._obj, self._call = obj, clock(obj)

    def __call__(self, *a, **kw):
        return self._call(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._obj, name)


def device_idle(engine, steps: int) -> dict:
    """`engine.step()` as the engine runs it (overlapped or not): per step, how long the forward pass waits for
    the host (from one step's end, sampled tokens in hand, to the next forward's start: the host's work in the
    device's way), and the step's period. Instruments the step backend's forward and the engine's `execute`,
    which both the sequential and the overlapped strategy call."""
    steps_obj = engine.runner.steps
    eager = getattr(steps_obj, "eager", steps_obj)
    forward, execute = eager.forward, engine.execute
    starts, ends = [], []

    def timed_forward(*a, **kw):
        starts.append(time.perf_counter())
        return forward(*a, **kw)

    def timed_execute(*a, **kw):
        try:
            return execute(*a, **kw)
        finally:
            ends.append(time.perf_counter())

    eager.forward, engine.execute = timed_forward, timed_execute
    try:
        for _ in range(steps + 1):
            engine.step()
    finally:
        eager.forward = forward
        del engine.execute
    n = min(len(starts), len(ends))
    idle = [starts[k + 1] - ends[k] for k in range(n - 1)]
    period = [ends[k + 1] - ends[k] for k in range(n - 1)]
    if not idle:
        return {}
    return {"idle_ms": 1e3 * statistics.median(idle), "period_ms": 1e3 * statistics.median(period)}


def linear_shapes(cfg) -> dict[str, tuple[int, int, int]] | None:
    """The model's projections as torch's linear runs them: name -> (in, out, how many a token goes through in
    the forward); the lm_head's count is 0 (it runs in the logits). None for a sparse (MoE) model, whose tokens
    each read only some experts."""
    if getattr(cfg, "is_moe", False):
        return None
    h, q, kv, layers = (
        cfg.hidden_size,
        cfg.num_attention_heads * cfg.head_dim,
        cfg.num_key_value_heads * cfg.head_dim,
        cfg.num_hidden_layers,
    )
    inter = cfg.intermediate_size
    return {"q": (h, q, layers), "k": (h, kv, layers), "v": (h, kv, layers), "o": (q, h, layers),
            "gate": (h, inter, layers), "up": (h, inter, layers), "down": (inter, h, layers),
            "lm_head": (h, cfg.vocab_size, 0)}  # fmt: skip


def linear_gflops(rows: int, k: int, n: int, dtype: torch.dtype, budget_s: float = 0.2) -> float:
    """torch's linear of `rows` x `k` by an `n` x `k` weight in `dtype`: GFLOPS of its fastest call (at least
    three calls after a warm-up one, and as many as `budget_s` allows: without bf16 instructions torch's bf16
    product can be a hundred times slower than its fp32 one)."""
    x, w = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    with torch.inference_mode():
        return fastest_gflops(lambda: torch.nn.functional.linear(x, w), 2 * rows * k * n, budget_s)


def fastest_gflops(call, flops: int, budget_s: float) -> float:
    """GFLOPS of `call`'s fastest run (`flops` a run): a warm-up call, then at least three, as many as `budget_s`
    allows."""
    call()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or spent < budget_s:
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return flops / best / 1e9


def measure_peak(cfg, batches: list[int], threads: int, budget_s: float = 0.2) -> dict:
    """Per batch size (the decode step's rows): torch's linear on each of the model's projection shapes in
    bfloat16 and float32; `decoder` is the GFLOPS of the forward's projections, each at the faster dtype for its
    shape (their FLOPs over the sum of their times), `lm_head` the logits' at its faster dtype, `best` the
    fastest shape's."""
    shapes = linear_shapes(cfg)
    if shapes is None:
        return {}
    torch.set_num_threads(threads)
    out = {}
    for b in batches:
        measured = {name: {str(dt).removeprefix("torch."): linear_gflops(b, k, n, dt, budget_s) for dt in (torch.bfloat16, torch.float32)}
                    for name, (k, n, _) in shapes.items()}  # fmt: skip
        best = {name: max(g.values()) for name, g in measured.items()}
        flops = {name: 2 * b * k * n * count for name, (k, n, count) in shapes.items()}
        seconds = sum(flops[name] / (best[name] * 1e9) for name in shapes if flops[name])
        out[b] = {"shapes": measured, "decoder": sum(flops.values()) / seconds / 1e9, "lm_head": best["lm_head"],
                  "best": max(best.values())}  # fmt: skip
    return out


def flop_counts(cfg) -> dict[str, int] | None:
    """FLOPs a token costs in the forward's projections (2 x their parameters) and a logit row in the lm_head."""
    shapes = linear_shapes(cfg)
    if shapes is None:
        return None
    return {"decoder": sum(2 * k * n * count for k, n, count in shapes.values()),
            "lm_head": 2 * shapes["lm_head"][0] * shapes["lm_head"][1]}  # fmt: skip


def achieved(samples: list[dict], flops: dict[str, int] | None, peak: dict | None) -> dict:
    """GFLOPS of the forward, its linear phase (the native step's clock) and the logits over the timed steps
    (their FLOPs over their summed time), and each as a share of the peak measured at the same rows."""
    if not flops:
        return {}
    tokens = sum(s["tokens"] for s in samples)
    logit_rows = sum(s["logit_rows"] for s in samples)
    timed = {k: sum(s.get(k, 0.0) for s in samples) for k in ("forward_total", "linear", "logits")}
    done = {"forward": (flops["decoder"] * tokens, timed["forward_total"], "decoder"),
            "linear": (flops["decoder"] * tokens, timed["linear"], "decoder"),
            "logits": (flops["lm_head"] * logit_rows, timed["logits"], "lm_head")}  # fmt: skip
    gflops = {k: f / t / 1e9 for k, (f, t, _) in done.items() if t > 0}
    out = {"gflops": gflops}
    if peak:
        out["peak_gflops"] = {"decoder": peak["decoder"], "lm_head": peak["lm_head"]}
        out["pct_of_peak"] = {k: 100 * g / peak[done[k][2]] for k, g in gflops.items()}
    return out


def profile(
    llm: LLM, prompts, adapters, params: SamplingParams, steps: int, peak: dict | None = None
) -> dict:
    """Median step time and mean phase shares over `steps` decode steps of the whole batch; the forward's, the
    linear phase's and the logits' GFLOPS against `peak` (measure_peak's at this batch size)."""
    engine = llm.engine
    for p, a in zip(prompts, adapters, strict=True):
        engine.add_request(p, params, adapter=a)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()  # prefill
    for _ in range(2):
        engine.step()
    # an overlapped engine's launched step is committed: the timed steps below are driven by hand
    engine.flush()
    timers = Timers(llm)
    samples = []
    try:
        while len(samples) < steps and engine.scheduler.running:  # a constrained output may end early
            samples.append(timers.step())
    finally:
        timers.close()
    idle = device_idle(engine, steps) if len(engine.scheduler.running) == len(prompts) else {}
    engine.flush()
    while engine.has_unfinished():
        engine.step()
    total = statistics.median(s["total"] for s in samples)
    mean = {k: statistics.fmean(s.get(k, 0.0) for s in samples) for k in PHASES}
    return {"step_ms": 1e3 * total, "tokens_per_s": statistics.fmean(s["rows"] for s in samples) / total,
            "host_ms": 1e3 * statistics.median(s["host"] for s in samples),
            "rows": statistics.fmean(s["rows"] for s in samples),
            "forward_ms": 1e3 * statistics.fmean(s.get("forward_total", 0.0) for s in samples),
            "phases_ms": {k: 1e3 * v for k, v in mean.items()},
            **achieved(samples, flop_counts(engine.model_config), peak), **idle}  # fmt: skip


def offline(args, model_dir: Path, tmp: Path, peaks: dict) -> list[dict]:
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
                res = profile(llm, prompts, adapters, params, args.steps, peaks.get(b))
                res.update(batch=b, load=load, compiled=compiled)
                rows.append(res)
                print(f"{'compiled' if compiled else 'eager':8s} batch {b:3d} {load:12s} {res['step_ms']:8.2f} ms/step "
                      f"{res['tokens_per_s']:7.1f} tok/s, host {res['host_ms']:.2f} ms, {res['rows']:.0f} rows, "
                      f"device idle {res.get('idle_ms', float('nan')):.2f} ms; GFLOPS "
                      + ", ".join(f"{k} {g:.3g} ({res.get('pct_of_peak', {}).get(k, float('nan')):.0f}% of peak)"
                                  for k, g in res.get("gflops", {}).items()), flush=True)  # fmt: skip
            del llm
    return rows


def serving(args, model_dir: Path, offline_rows: list[dict]) -> list[dict]:
    """Per level C: R x C streamed chat requests (--serve-rounds R), C at once, through the server, then the same prompts through the
    offline engine (max_num_seqs C): output tokens/s of each, and TPOT against the offline step time."""
    step_ms = {r["batch"]: r["step_ms"] for r in offline_rows if r["compiled"] and r["load"] == "base"}
    rows, loads = [], {}
    for c in args.serve_levels:
        texts = [f"Continue this text: {p}" for p in make_prompts(args.serve_rounds * c, 40, c)]
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
            reqs = [("/chat/completions", {"model": model_dir.name, "max_tokens": args.max_tokens, **GREEDY,
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
        # the offline TPOT as the client's is taken: each request's first token to its last, over the tokens after
        # the first (the engine's own stamps: RequestTimings.decode_s)
        tpots = [
            o.timings.decode_s / (len(o.token_ids) - 1) for o in outs if o.timings and len(o.token_ids) > 1
        ]
        row["offline_tpot_p50_ms"] = 1e3 * statistics.median(tpots) if tpots else None
        row["tpot_ratio"] = row["tpot_p50_ms"] / row["offline_tpot_p50_ms"] if tpots else None
        del llm
        print(f"serving {c:3d} clients: {row['served_tokens_per_s']:.1f} tok/s served, "
              f"{row['offline_tokens_per_s']:.1f} offline on the same load ({100 * row['served_share']:.0f}%); "
              f"TPOT p50 {row['tpot_p50_ms']:.2f} ms served, {row['offline_tpot_p50_ms'] or float('nan'):.2f} offline",
              flush=True)  # fmt: skip
    return rows


def gflops_md(report: dict) -> list[str]:
    """The GFLOPS table: the forward's, its linear phase's and the logits' against torch's linear at the rows."""
    rows = [r for r in report["offline"] if r.get("gflops")]
    if not rows:
        return []
    cell = lambda r, k: (f"{r['gflops'][k]:.3g} ({r['pct_of_peak'][k]:.0f}%)" if k in r.get("pct_of_peak", {})  # noqa: E731
                         else f"{r['gflops'][k]:.3g}" if k in r["gflops"] else "")  # fmt: skip
    lines = ["", "Achieved GFLOPS (2 x the projections' parameters x tokens / the phase's time; attention's and the "
             "LoRA deltas' FLOPs not counted) and their share of the peak: torch's linear on the model's own shapes "
             "at the step's rows, the faster of bfloat16 and float32 per shape, measured in the same run.", "",
             "| step | batch | load | forward | linear | logits | peak: forward's shapes | peak: lm_head |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        peak = r.get("peak_gflops", {})
        lines.append(f"| {'compiled' if r['compiled'] else 'eager'} | {r['batch']} | {r['load']} | {cell(r, 'forward')} | "
                     f"{cell(r, 'linear')} | {cell(r, 'logits')} | {peak.get('decoder', float('nan')):.3g} | "
                     f"{peak.get('lm_head', float('nan')):.3g} |")  # fmt: skip
    peaks = report.get("peak", {})
    if peaks:
        names = list(next(iter(peaks.values()))["shapes"])
        lines += ["", "torch's linear, GFLOPS bfloat16 / float32 per projection shape and batch rows:", "",
                  "| rows | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]  # fmt: skip
        for b, p in peaks.items():
            lines.append(f"| {b} | " + " | ".join(f"{p['shapes'][n]['bfloat16']:.3g} / {p['shapes'][n]['float32']:.3g}"
                                                  for n in names) + " |")  # fmt: skip
    return lines


def summary_md(report: dict) -> str:
    cols = [p for p in PHASES if any(r["phases_ms"].get(p, 0) > 0.005 for r in report["offline"])]
    lines = [f"# Where a step's time goes ({report['dtype']}, {report['threads']} threads)", "",
             f"CPU: {cpu_line(report['cpu'])}.", "",
             "Mean ms per decode step by phase (median step in `step ms`).", "",
             "| step | batch | load | step ms | tok/s | " + " | ".join(cols) + " |",
             "|---|---:|---|---:|---:|" + "---:|" * len(cols)]  # fmt: skip
    for r in report["offline"]:
        ph = " | ".join(f"{r['phases_ms'].get(p, 0):.2f}" for p in cols)
        lines.append(f"| {'compiled' if r['compiled'] else 'eager'} | {r['batch']} | {r['load']} | "
                     f"{r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | {ph} |")  # fmt: skip
    lines += gflops_md(report)
    if report["serving"]:
        lines += ["", f"The same load served over HTTP and run offline ({report.get('serve_rounds', 2)} x C requests, C at once):", "",
                  "| clients | served tok/s | offline tok/s | served / offline | TPOT p50 ms served | TPOT p50 ms offline | served / offline TPOT | offline step ms |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in report["serving"]:
            off = "" if r["offline_step_ms"] is None else f"{r['offline_step_ms']:.2f}"
            tpot = "" if r.get("offline_tpot_p50_ms") is None else f"{r['offline_tpot_p50_ms']:.2f}"
            ratio = "" if r.get("tpot_ratio") is None else f"{r['tpot_ratio']:.3f}"
            lines.append(f"| {r['clients']} | {r['served_tokens_per_s']:.1f} | {r['offline_tokens_per_s']:.1f} | "
                         f"{100 * r['served_share']:.0f}% | {r['tpot_p50_ms']:.2f} | {tpot} | {ratio} | {off} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
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
    ap.add_argument("--serve-rounds", type=int, default=2,
                    help="requests per serving level: this many times its clients (more: a steadier TPOT at 1)")  # fmt: skip
    ap.add_argument("--peak-seconds", type=float, default=0.2,
                    help="time for torch's linear on each shape and dtype in the peak measurement")  # fmt: skip
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    model_dir = Path(resolve_model(args.model))
    from motet.engine.weights.model_config import load_model_config

    peaks = measure_peak(load_model_config(model_dir), args.batches, args.threads, args.peak_seconds)
    for b, p in peaks.items():
        print(f"peak at {b} rows: torch's linear {p['decoder']:.3g} GFLOPS on the forward's shapes, "
              f"{p['lm_head']:.3g} on the lm_head's", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        off = offline(args, model_dir, Path(tmp), peaks)
    report = {"dtype": args.dtype, "threads": args.threads, "machine": machine(), "cpu": cpu_info(),
              "peak": peaks, "offline": off, "serve_rounds": args.serve_rounds,
              "serving": serving(args, model_dir, off) if args.serve_levels else []}  # fmt: skip
    out = Path(args.out or f"reports/step_profile/{time.strftime('%Y%m%d-%H%M%S')}")
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    main()
