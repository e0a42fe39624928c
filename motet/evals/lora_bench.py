"""Multi-LoRA decode throughput: the same batch with no adapter, one adapter, and many distinct adapters.

    python -m motet.evals.lora_bench [--batch 32] [--adapters 8 32] [--rank 16] [--new-tokens 64] [--rounds 3]
                               [--out reports/lora_bench]

One engine, one batch of `--batch` chat prompts generating `--new-tokens` tokens each (EOS ignored, so the
work is equal), three ways: every request on the base model; every request on one adapter; requests
spread evenly over each `--adapters` count of distinct adapters (random weights, rank `--rank`, all seven modules) in
the same batch. Decode tokens/s comes from the median step time over the steps that decode the whole
batch; the scenarios are interleaved for `--rounds` rounds and the best round of each is kept (the
machine is noisy), and reported as ratios to the base model. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.model_store import resolve_model
from motet.evals.lora_reference import write_random_adapter
from motet.evals.throughput import chat_prompts


def run(llm: LLM, prompts, adapter_ids, new_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for p, a in zip(prompts, adapter_ids, strict=True):
        engine.add_request(p, params, adapter=a)
    steps, t0 = [], time.perf_counter()
    while engine.has_unfinished():
        batch = engine.schedule()
        t = time.perf_counter()
        result = engine.execute(batch)
        if all(n == 1 for n in batch.num_new_tokens) and len(batch) == len(prompts):
            steps.append(time.perf_counter() - t)
        engine.commit(batch, result)
    median = statistics.median(steps)  # robust to the stalls of a shared machine; the mean is not
    return {
        "seconds": time.perf_counter() - t0,
        "decode_steps": len(steps),
        "decode_step_ms": 1e3 * median,
        "decode_step_ms_mean": 1e3 * statistics.fmean(steps),
        "decode_tokens_per_s": len(prompts) / median,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--adapters", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="reports/lora_bench")
    args = ap.parse_args(argv)

    llm = LLM(
        str(resolve_model(args.model)),
        dtype=args.dtype,
        max_num_seqs=args.batch,
        num_kv_blocks=args.batch * (-(-(args.new_tokens + 128) // 16)),  # room for every request
        max_loras=max(args.adapters),  # every distinct adapter of a step resident: no time slicing
        max_lora_rank=args.rank,
        speculative="off",  # plain decode steps: the adapter path's cost, not speculation's gain
    )
    base = llm.engine.model_config
    tmp = tempfile.TemporaryDirectory()  # kept until exit: the engine may reload adapters from disk
    ids = [
        llm.add_lora(f"bench-{i}", write_random_adapter(Path(tmp.name) / f"a{i}", base, args.rank, seed=i))
        for i in range(max(args.adapters))
    ]
    prompts = chat_prompts(llm.tokenizer, args.batch)
    scenarios = {
        "base": [None] * args.batch,
        "1 adapter": [ids[0]] * args.batch,
        **{f"{n} adapters": [ids[i % n] for i in range(args.batch)] for n in args.adapters},
    }
    run(llm, prompts[:4], [None] * 4, 4)  # warm-up
    best: dict[str, dict] = {}
    for r in range(args.rounds):
        for name, adapter_ids in scenarios.items():
            res = run(llm, prompts, adapter_ids, args.new_tokens)
            print(f"round {r}: {name:12s} {res['decode_tokens_per_s']:8.1f} decode tok/s", flush=True)
            if name not in best or res["decode_tokens_per_s"] > best[name]["decode_tokens_per_s"]:
                best[name] = res
    base_rate = best["base"]["decode_tokens_per_s"]
    for res in best.values():
        res["ratio_to_base"] = res["decode_tokens_per_s"] / base_rate

    report = {
        "model": str(llm.engine.model_dir),
        "dtype": args.dtype,
        "device": str(llm.engine.runner.device),
        "batch": args.batch,
        "rank": args.rank,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "machine": {
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "scenarios": best,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# Multi-LoRA decode throughput ({args.dtype}, {report['device']}, batch {args.batch}, "
        f"rank {args.rank}, all modules)",
        "",
        "| scenario | decode step ms (median) | (mean) | decode tok/s | vs base |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {name} | {r['decode_step_ms']:.1f} | {r['decode_step_ms_mean']:.1f} | "
            f"{r['decode_tokens_per_s']:.1f} | {r['ratio_to_base']:.2f}x |"
            for name, r in best.items()
        ),
        "",
        f"Best of {args.rounds} interleaved rounds per scenario; {torch.get_num_threads()} torch threads.",
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
