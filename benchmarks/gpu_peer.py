"""motet's decode against a gpt-fast-style peer on the same device in one call (issue 30, item 6).

The peer: Hugging Face transformers over a static KV cache (`transformers.StaticCache`, what
`generation_config.cache_implementation = "static"` gives `generate`), its decode step (forward + argmax)
under `torch.compile(mode="reduce-overhead", fullgraph=True)` as gpt-fast compiles `decode_one_token`, each
step's tokens copied to the host ("synced", as a server needs them) or left on the device ("pipelined").
motet: an `LLMEngine` (CUDA-graph decode, plain steps: no speculation), base and with 8 / 32 distinct random
rank-16 adapters, each configuration in a fresh engine. Both decode the same prompts greedily from random
weights of real architectures (the SmolLM2-135M, Qwen2.5-1.5B and Llama-3-8B shapes: benchmarks/gpu_common.py).

Per configuration: tokens/s and ms per step over --steps steps after --warmup; the share of the bandwidth
limit (the bytes a step must read: weights, the KV of every row's context, the step's adapters, over the
copy bandwidth measured in the same call); and from torch.profiler over --profile-steps steps: device
launches per step (kernels, copies, memsets) and how many are copies, the device-busy share of the step
(the union of their intervals over the timed step), and host waits per step (cuda*Synchronize and blocking
cudaMemcpy calls; device-to-host copies counted beside). motet's base greedy tokens are compared with the
peer's. Writes results.json and summary.md into --out.

On the GPU machine, one command (the `run` tool with carry=[".whl"], the wheels scripts/gpu/run.sh installs):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
    PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_peer --out $OUT

All three shapes may outlast one call's 10 minutes (the 8B checkpoint, 16 GB, is written once and loaded
once per configuration; the peer compiles once per batch size): then one call per shape, the same command
with `--shapes smollm2-135m`, `--shapes qwen2.5-1.5b`, `--shapes llama-3-8b`, each writing its own report
(`--batches` and `--adapters` narrow a call further). The smoke test on a CPU (tests/benchmarks/test_gpu_peer.py), the
peer traced whole by dynamo but run eagerly, the profiles counting CPU ops instead of kernels:

    python -m benchmarks.gpu_peer --device cpu --shapes tiny --batches 1 2 --adapters 2 --steps 3 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import write_report
from benchmarks.gpu_common import (
    SHAPES,
    adapter_bytes,
    copy_bandwidth,
    free_memory,
    kv_bytes_per_token,
    motet_engine,
    prompts,
    random_checkpoint,
    synchronize,
    weight_bytes,
)

DEFAULT_SHAPES = ("smollm2-135m", "qwen2.5-1.5b", "llama-3-8b")
# The peer's decode step: torch.compile as gpt-fast ("reduce-overhead": CUDA graphs), inductor without graphs
# ("default"), dynamo's full-graph trace run eagerly ("trace": checks that the step compiles whole, in seconds
# on a CPU), or plain eager ("off").
PEER_COMPILE = ("reduce-overhead", "default", "trace", "off")
PREFILL_TOKENS = 8192  # motet's step budget while the prompts prefill (decode steps take `batch` of it)
# Host waits in a trace: runtime calls that block the host until the device catches up.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2")  # fmt: skip
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Issue 30's acceptance lines, checked where the report has the rows.
ACCEPT_OVER_PIPELINED, ACCEPT_OVER_SYNCED = 1.0, 1.3
ACCEPT_B1_LAUNCHES, ACCEPT_B1_BUSY = 300, 0.9
ACCEPT_ADAPTER_SHARE, ACCEPT_8B_LIMIT = 0.85, 0.8


# -- the profile ----------------------------------------------------------------------------------------
def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _leaf_cpu_ops(events: list[dict]) -> list[dict]:
    """The CPU ops no other op runs inside (per thread): what a CPU step executes, counted once."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"),
                 key=lambda e: (e.get("tid"), e["ts"], -e.get("dur", 0)))  # fmt: skip
    leaves = []
    for i, e in enumerate(ops):
        nxt = ops[i + 1] if i + 1 < len(ops) else None
        inside = nxt is not None and nxt.get("tid") == e.get("tid") and nxt["ts"] < e["ts"] + e.get("dur", 0)
        if not inside:
            leaves.append(e)
    return leaves


def trace_counts(events: list[dict], steps: int) -> dict:
    """Per step, from a Chrome trace of `steps` steps (torch.profiler's export): the device's launches
    (kernels, copies, memsets) and copies among them, device-to-host copies, the host's waits, and the
    device's busy time (the union of its launches' intervals). With no device events (a CPU run) the
    launches are the CPU's leaf ops and their copies aten::copy_."""
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and e.get("ph") == "X"]
    if device:
        unit, launches = "kernels", device
        copies = [e for e in device if e["cat"] == "gpu_memcpy"]
    else:
        unit, launches = "cpu ops", _leaf_cpu_ops(events)
        copies = [e for e in launches if e["name"] == "aten::copy_"]
    d2h = [e for e in copies if "DtoH" in e["name"]]
    waits = [
        e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") in SYNC_CALLS
    ]
    busy_us = _union_us([(e["ts"], e["ts"] + e.get("dur", 0)) for e in launches])
    return {
        "unit": unit,
        "launches_per_step": len(launches) / steps,
        "copies_per_step": len(copies) / steps,
        "d2h_copies_per_step": len(d2h) / steps,
        "host_waits_per_step": len(waits) / steps,
        "busy_ms_per_step": busy_us / 1e3 / steps,
    }


def profile_steps(step, steps: int, device: torch.device) -> dict:
    """`step()` run `steps` times under torch.profiler; trace_counts of what it recorded."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return trace_counts(events, steps)


# -- the peer -------------------------------------------------------------------------------------------
def compiled(fn, how: str):
    if how == "off":
        return fn
    if how == "trace":
        return torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)
    mode = None if how == "default" else how
    return torch.compile(fn, mode=mode, fullgraph=True, dynamic=False)


@torch.no_grad()
def peer_decode(
    model, batch: int, args, device: torch.device
) -> tuple[list[dict], dict[str, list[list[int]]]]:
    """The peer at `batch`, synced then pipelined over one static cache: a row per mode, and each mode's
    greedy tokens per row (the prefill's first)."""
    from transformers import StaticCache

    ids = torch.tensor(prompts(batch, args.prompt_len, model.config.vocab_size), device=device)
    new_tokens = 1 + args.warmup + args.steps + args.profile_steps
    cache = StaticCache(config=model.config, max_cache_len=args.prompt_len + new_tokens)

    def decode_step(tok):  # positions come from the cache's own device-side length: no host input
        logits = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    step_fn = compiled(decode_step, args.peer_compile)
    rows, tokens = [], {}
    for mode in ("synced", "pipelined"):
        cache.reset()
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        out = [logits[:, -1].argmax(-1, keepdim=True)]  # on the device: each feeds the next step

        def step(out=out, synced=mode == "synced"):
            torch.compiler.cudagraph_mark_step_begin()  # the last step's output buffer may be reused
            out.append(step_fn(out[-1]).clone())
            if synced:
                out[-1].cpu()  # the copy a server makes of each step's tokens, and the wait for it

        t = time.perf_counter()
        for _ in range(args.warmup):
            step()
        synchronize(device)
        warmup_s = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        synchronize(device)
        seconds = time.perf_counter() - t
        prof = profile_steps(step, args.profile_steps, device)
        tokens[mode] = torch.cat(out, dim=1).tolist()
        rows.append({"batch": batch, "mode": mode, "step_ms": 1e3 * seconds / args.steps,
                     "tokens_per_s": batch * args.steps / seconds, "warmup_s": warmup_s, "profile": prof})  # fmt: skip
    return rows, tokens


# -- motet ----------------------------------------------------------------------------------------------
def motet_decode(model_dir: Path, adapter_dir: Path, batch: int, adapters: int, args, device: torch.device):
    """motet at `batch` with `adapters` distinct adapters (0: the base model) in a fresh engine: its row and
    the greedy tokens per row (the prefill's first)."""
    from motet.engine.sampling_params import SamplingParams

    budget = max(batch, min(batch * args.prompt_len, PREFILL_TOKENS))
    prefill_steps = -(-batch * args.prompt_len // budget)  # rows prefilled first decode this many steps early
    max_tokens = 1 + args.warmup + args.steps + args.profile_steps + prefill_steps + 2
    blocks = batch * -(-(args.prompt_len + max_tokens) // 16) + 8
    t = time.perf_counter()
    engine, names = motet_engine(model_dir, adapter_dir, batch=batch, adapters=adapters, rank=args.rank,
                                 dtype=args.dtype, device=str(device), block_size=16, num_kv_blocks=blocks,
                                 max_num_batched_tokens=budget, speculative="off")  # fmt: skip
    load_s = time.perf_counter() - t
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    order = []
    for i, p in enumerate(prompts(batch, args.prompt_len, engine.model_config.vocab_size)):
        order.append(engine.add_request(p, params, adapter=names[i % adapters] if adapters else None))
    tokens: dict[str, list[int]] = {}

    def step() -> int:
        n = 0
        for o in engine.step():  # (deltas: each request's new tokens)
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
            n += len(o.token_ids)
        return n

    while len(tokens) < batch:  # every prompt prefilled
        step()
    t = time.perf_counter()
    for _ in range(args.warmup):  # graphs captured at their first use
        step()
    synchronize(device)
    warmup_s = time.perf_counter() - t
    graphs = getattr(engine.runner, "graphs", None)
    replays = getattr(graphs, "replays", None)
    t = time.perf_counter()
    produced = sum(step() for _ in range(args.steps))
    synchronize(device)
    seconds = time.perf_counter() - t
    replayed = None if replays is None else graphs.replays - replays
    prof = profile_steps(step, args.profile_steps, device)
    engine.close()
    row = {"batch": batch, "adapters": adapters, "step_ms": 1e3 * seconds / args.steps,
           "tokens_per_s": produced / seconds, "tokens_per_step": produced / args.steps,
           "graph_replays": replayed, "load_s": load_s, "warmup_s": warmup_s, "profile": prof}  # fmt: skip
    return row, [tokens[r] for r in order]


# -- the call -------------------------------------------------------------------------------------------
def greedy_agreement(ours: list[list[int]], peer: list[list[int]]) -> dict:
    """Rows whose tokens agree with the peer's over the length both have."""
    n = min(min(map(len, ours)), min(map(len, peer)))
    equal = sum(a[:n] == b[:n] for a, b in zip(ours, peer, strict=True))
    return {"rows": len(ours), "rows_equal": equal, "tokens_compared": n}


def step_bytes(facts: dict, batch: int, adapters: int, args) -> int:
    """Bytes a timed step must read: the weights, every row's KV at the timed steps' mean context, and the
    step's distinct adapters."""
    context = args.prompt_len + 1 + args.warmup + args.steps / 2
    return int(
        facts["weight_bytes"]
        + batch * context * facts["kv_bytes_per_token"]
        + adapters * facts["adapter_bytes"]
    )


def run_shape(shape: str, args, device: torch.device, bandwidth: float, report: dict) -> None:
    from motet.models.config import ModelConfig

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(dir=args.work_dir, prefix=f"gpu_peer_{shape}_") as tmp:
        t = time.perf_counter()
        model = random_checkpoint(shape, Path(tmp) / "model", dtype, str(device))
        base = ModelConfig.from_dir(Path(tmp) / "model")
        facts = {"weight_bytes": weight_bytes(model), "kv_bytes_per_token": kv_bytes_per_token(base, dtype),
                 "adapter_bytes": adapter_bytes(base, args.rank, dtype), "build_s": time.perf_counter() - t}  # fmt: skip
        report["shapes"][shape] = facts
        print(
            f"{shape}: {facts['weight_bytes'] / 1e9:.3g} GB of weights, built in {facts['build_s']:.0f} s",
            flush=True,
        )
        peer_tokens, t = {}, time.perf_counter()
        for batch in args.batches:
            rows, tokens = peer_decode(model, batch, args, device)
            peer_tokens[batch] = tokens
            for r in rows:
                r.update(shape=shape, limit_share=_limit_share(facts, batch, 0, r["step_ms"], args, bandwidth),
                         busy_share=r["profile"]["busy_ms_per_step"] / r["step_ms"])  # fmt: skip
                report["peer"].append(r)
                print(f"  peer  batch {batch:3d} {r['mode']:9s} {r['tokens_per_s']:10.0f} tok/s {r['step_ms']:7.2f} ms/step"
                      f"  (warm-up and compile {r['warmup_s']:.0f} s)", flush=True)  # fmt: skip
            torch._dynamo.reset()  # this batch's compiled step, its CUDA-graph pool and static cache
            free_memory()
        facts["peer_s"] = time.perf_counter() - t
        del model
        free_memory()
        t = time.perf_counter()
        for batch in args.batches:
            for adapters in (0, *args.adapters):
                if adapters > batch:
                    continue
                row, ours = motet_decode(
                    Path(tmp) / "model", Path(tmp) / "adapters", batch, adapters, args, device
                )
                free_memory()  # the engine, before the next one loads
                row.update(shape=shape, limit_share=_limit_share(facts, batch, adapters, row["step_ms"], args, bandwidth),
                           busy_share=row["profile"]["busy_ms_per_step"] / row["step_ms"])  # fmt: skip
                report["motet"].append(row)
                print(f"  motet batch {batch:3d} {adapters:2d} adapters {row['tokens_per_s']:10.0f} tok/s "
                      f"{row['step_ms']:7.2f} ms/step", flush=True)  # fmt: skip
                if adapters == 0:
                    peer = peer_tokens[batch]
                    report["greedy"].append({"shape": shape, "batch": batch, **greedy_agreement(ours, peer["synced"]),
                                             "peer_modes_agree": peer["synced"] == peer["pipelined"]})  # fmt: skip
        facts["motet_s"] = time.perf_counter() - t


def _limit_share(facts, batch, adapters, step_ms, args, bandwidth) -> float:
    return step_bytes(facts, batch, adapters, args) / bandwidth / (step_ms * 1e-3)


def comparison_rows(report: dict) -> list[dict]:
    """One row per motet configuration beside the peer at its shape and batch."""
    peer = {(r["shape"], r["batch"], r["mode"]): r for r in report["peer"]}
    base = {(r["shape"], r["batch"]): r for r in report["motet"] if r["adapters"] == 0}
    rows = []
    for m in report["motet"]:
        key = (m["shape"], m["batch"])
        synced, piped = peer.get((*key, "synced")), peer.get((*key, "pipelined"))
        rows.append({"shape": m["shape"], "batch": m["batch"], "adapters": m["adapters"],
                     "tokens_per_s": m["tokens_per_s"], "step_ms": m["step_ms"], "limit_share": m["limit_share"],
                     "peer_synced_tokens_per_s": synced["tokens_per_s"] if synced else None,
                     "peer_pipelined_tokens_per_s": piped["tokens_per_s"] if piped else None,
                     "over_synced": m["tokens_per_s"] / synced["tokens_per_s"] if synced else None,
                     "over_pipelined": m["tokens_per_s"] / piped["tokens_per_s"] if piped else None,
                     "share_of_base": m["tokens_per_s"] / base[key]["tokens_per_s"] if key in base else None})  # fmt: skip
    return rows


def acceptance(report: dict) -> list[str]:
    """Issue 30's acceptance lines over the rows this report has (a line per criterion it can judge)."""
    rows = [r for r in report["rows"] if r["shape"] in DEFAULT_SHAPES]  # the issue's shapes only
    lines = []

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    base = [r for r in rows if r["adapters"] == 0 and r["over_pipelined"] is not None]
    if base:
        worst_p = min(base, key=lambda r: r["over_pipelined"])
        worst_s = min(base, key=lambda r: r["over_synced"])
        lines.append(f"motet >= {ACCEPT_OVER_PIPELINED}x the peer pipelined: {verdict(worst_p['over_pipelined'] >= ACCEPT_OVER_PIPELINED)} "
                     f"(lowest {worst_p['over_pipelined']:.2f}x, {worst_p['shape']} batch {worst_p['batch']})")  # fmt: skip
        lines.append(f"motet >= {ACCEPT_OVER_SYNCED}x the peer synced: {verdict(worst_s['over_synced'] >= ACCEPT_OVER_SYNCED)} "
                     f"(lowest {worst_s['over_synced']:.2f}x, {worst_s['shape']} batch {worst_s['batch']})")  # fmt: skip
    for m in report["motet"]:
        if (
            m["shape"] == "smollm2-135m"
            and m["batch"] == 1
            and m["adapters"] == 0
            and m["profile"]["unit"] == "kernels"
        ):
            p = m["profile"]
            ok = (
                p["launches_per_step"] <= ACCEPT_B1_LAUNCHES
                and p["host_waits_per_step"] == 0
                and m["busy_share"] >= ACCEPT_B1_BUSY
            )
            lines.append(f"135M batch 1: <= {ACCEPT_B1_LAUNCHES} kernels, no host wait, busy >= {ACCEPT_B1_BUSY:.0%}: {verdict(ok)} "
                         f"({p['launches_per_step']:.0f} kernels, {p['host_waits_per_step']:.0f} waits, busy {m['busy_share']:.0%})")  # fmt: skip
    for r in rows:
        if (
            r["shape"] in ("llama-3-8b", "smollm2-135m")
            and r["batch"] == 64
            and r["adapters"]
            and r["share_of_base"]
        ):
            lines.append(f"{r['shape']} batch 64, {r['adapters']} adapters >= {ACCEPT_ADAPTER_SHARE:.0%} of base: "
                         f"{verdict(r['share_of_base'] >= ACCEPT_ADAPTER_SHARE)} ({r['share_of_base']:.0%})")  # fmt: skip
        if r["shape"] == "llama-3-8b" and r["batch"] == 1 and r["adapters"] == 0:
            lines.append(f"8B batch 1 >= {ACCEPT_8B_LIMIT:.0%} of the bandwidth limit: "
                         f"{verdict(r['limit_share'] >= ACCEPT_8B_LIMIT)} ({r['limit_share']:.0%})")  # fmt: skip
    return lines


def _num(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def summary_md(report: dict) -> str:
    a = report["args"]
    lines = [f"# motet vs a compiled-HF peer on {report['device']} (torch {report['torch']}, transformers {report['transformers']})",
             "", f"{a['dtype']}, greedy, prompts of {a['prompt_len']} tokens, {a['steps']} timed steps after {a['warmup']}, "
             f"peer compile: {a['peer_compile']}. Copy bandwidth {report['copy_bandwidth_gb_s']:.0f} GB/s (the limit's reference).", ""]  # fmt: skip
    if checks := acceptance(report):
        lines += ["Issue 30's acceptance on these rows:", "", *(f"- {c}" for c in checks), ""]
    lines += ["| shape | batch | adapters | motet tok/s | ms/step | share of limit | peer synced | peer pipelined | "
              "motet/synced | motet/pipelined | of base |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["rows"]:
        lines.append(f"| {r['shape']} | {r['batch']} | {r['adapters']} | {r['tokens_per_s']:.0f} | {r['step_ms']:.2f} | "
                     f"{r['limit_share']:.1%} | {_num(r['peer_synced_tokens_per_s'], '.0f')} | "
                     f"{_num(r['peer_pipelined_tokens_per_s'], '.0f')} | {_num(r['over_synced'], '.2f')} | "
                     f"{_num(r['over_pipelined'], '.2f')} | {_num(r['share_of_base'], '.0%')} |")  # fmt: skip
    lines += ["", "Per step, from torch.profiler over a few steps (launches: kernels + copies + memsets on a GPU, leaf "
              "ops on a CPU; busy: the device's share of the timed step):", "",
              "| shape | batch | who | launches | copies | busy | host waits | D2H copies |",
              "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    who = [(r, f"motet, {r['adapters']} adapters" if r["adapters"] else "motet") for r in report["motet"]]
    who += [(r, f"peer {r['mode']}") for r in report["peer"]]
    for r, name in sorted(who, key=lambda x: (x[0]["shape"], x[0]["batch"])):
        p = r["profile"]
        lines.append(f"| {r['shape']} | {r['batch']} | {name} | {p['launches_per_step']:.0f} | {p['copies_per_step']:.0f} | "
                     f"{r['busy_share']:.0%} | {p['host_waits_per_step']:.0f} | {p['d2h_copies_per_step']:.0f} |")  # fmt: skip
    lines += ["", "Greedy tokens, motet (base) against the peer synced:", ""]
    for g in report["greedy"]:
        lines.append(f"- {g['shape']} batch {g['batch']}: {g['rows_equal']}/{g['rows']} rows equal over "
                     f"{g['tokens_compared']} tokens; peer synced == pipelined: {g['peer_modes_agree']}")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(DEFAULT_SHAPES),
                    help="architectures to build with random weights (default: %(default)s)")  # fmt: skip
    ap.add_argument(
        "--batches",
        nargs="+",
        type=int,
        default=[1, 8, 64, 256],
        help="rows decoded at once (default: %(default)s)",
    )
    ap.add_argument("--adapters", nargs="*", type=int, default=[8, 32],
                    help="counts of distinct adapters to run besides the base model; a count above the batch is "
                         "skipped (default: %(default)s)")  # fmt: skip
    ap.add_argument("--rank", type=int, default=16, help="the adapters' LoRA rank (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before the timed ones: graph capture, "
                    "compilation (default: %(default)s)")  # fmt: skip
    ap.add_argument(
        "--profile-steps", type=int, default=3, help="steps under torch.profiler (default: %(default)s)"
    )
    ap.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="weights' dtype (default: %(default)s)",
    )
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where both run (default: cuda where available)")  # fmt: skip
    ap.add_argument("--peer-compile", choices=PEER_COMPILE, default=None,
                    help="the peer's decode step: reduce-overhead (gpt-fast's CUDA graphs; the default on cuda), "
                         "default (inductor), trace (dynamo's full graph run eagerly; the default on cpu), off")  # fmt: skip
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where checkpoints are written (default: the system's temp)",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="report directory (default: reports/gpu_peer/<time>)"
    )
    args = ap.parse_args(argv)
    for name in ("steps", "warmup", "profile_steps", "prompt_len", "rank"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.batches) < 1 or any(a < 1 for a in args.adapters):
        ap.error("--batches and --adapters take positive integers")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (--device cpu runs the smoke test)")
    args.peer_compile = args.peer_compile or ("reduce-overhead" if args.device == "cuda" else "trace")
    out = args.out or Path("reports/gpu_peer") / time.strftime("%Y%m%d-%H%M%S")
    device = torch.device(args.device)

    import transformers

    bandwidth = copy_bandwidth(device)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "copy_bandwidth_gb_s": bandwidth / 1e9,
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "shapes": {}, "peer": [], "motet": [], "greedy": []}  # fmt: skip
    print(f"{report['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    for shape in args.shapes:
        run_shape(shape, args, device, bandwidth, report)
    report["rows"] = comparison_rows(report)
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    main()
