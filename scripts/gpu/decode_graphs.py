"""Decode tokens/s on one GPU, eager vs CUDA graphs (motet/engine/worker/cuda_graphs.py), and where an eager step's time
goes (the forward alone, and a profiler's top ops at batch 1). Writes decode_graphs.json/.md into --out.

    PYTHONPATH=. python scripts/gpu/decode_graphs.py --model-dir DIR --out OUT [--batches 1,8,64,256] \\
        [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_bench import hf_decode
from benchmarks.gpu_common import prompts


def decode(
    model_dir: Path, batch: int, new_tokens: int, adapters: int, graphs: bool, profile: bool = False
) -> dict:
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from motet.engine.sampling_params import SamplingParams
    from motet.evals.lora_reference import write_random_adapter

    cfg = EngineConfig(
        model=str(model_dir), dtype="bfloat16", device="cuda", num_kv_blocks=batch * 8 + 64,
        max_num_seqs=max(batch, 1), max_num_batched_tokens=max(batch * 32, 256), max_loras=max(adapters, 1),
        max_lora_rank=16, compile_step=graphs,
    )  # fmt: skip
    engine = LLMEngine(cfg, model_dir=model_dir)
    tmp = tempfile.TemporaryDirectory()
    names = [
        engine.add_lora(
            f"a{i}", write_random_adapter(Path(tmp.name) / f"a{i}", engine.model_config, 16, seed=i)
        )
        for i in range(adapters)
    ]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts(batch)):
        engine.add_request(p, params, adapter=names[i % adapters] if adapters else None)
    steps, wall = [], []
    prof_rows = None
    n_step = 0
    while engine.has_unfinished():
        b = engine.schedule()
        decode_step = all(n == 1 for n in b.num_new_tokens) and len(b) == batch
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profile and decode_step and n_step == 10:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as tprof

            with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                result = engine.execute(b)
                torch.cuda.synchronize()
            prof_rows = prof.key_averages().table(sort_by="cpu_time_total", row_limit=18)
        else:
            result = engine.execute(b)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.commit(b, result)
        t2 = time.perf_counter()
        if decode_step:
            n_step += 1
            steps.append(t1 - t0)
            wall.append(t2 - t0)
    # execute (forward + sampling) and execute + commit (scheduler, detokenizer): medians, the first steps
    # (graph capture) left out.
    med = statistics.median(steps[3:] or steps)
    medw = statistics.median(wall[3:] or wall)
    row = {
        "batch": batch, "adapters": adapters, "graphs": graphs,
        "execute_ms": 1e3 * med, "step_ms": 1e3 * medw,
        "tokens_per_s": batch / medw, "execute_tokens_per_s": batch / med,
        "replays": engine.runner.graphs.replays if engine.runner.graphs else 0,
    }  # fmt: skip
    if prof_rows:
        row["profile"] = prof_rows
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--adapters", default="0,8,32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    rows = []
    for batch in map(int, args.batches.split(",")):
        hf = None if args.no_hf else hf_decode(args.model_dir, batch, args.new_tokens)["tokens_per_s"]
        for adapters in map(int, args.adapters.split(",")):
            if adapters > batch:
                continue
            for graphs in (False, True):
                row = decode(
                    args.model_dir,
                    batch,
                    args.new_tokens,
                    adapters,
                    graphs,
                    profile=batch == 1 and adapters == 0,
                )
                if hf and adapters == 0:
                    row["hf_tokens_per_s"] = hf
                prof = row.pop("profile", None)
                print(json.dumps(row), flush=True)
                if prof:
                    print(prof, flush=True)
                    (args.out / f"profile_b1_{'graphs' if graphs else 'eager'}.txt").write_text(prof)
                rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_graphs.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"# Decode on {torch.cuda.get_device_name()}: eager vs CUDA graphs (bf16, {args.new_tokens} new tokens)",
        "",
        "| batch | adapters | graphs | tok/s (step) | step ms | execute ms | HF generate tok/s |",
        "|---:|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        hf = f"{r['hf_tokens_per_s']:.0f}" if "hf_tokens_per_s" in r else ""
        lines.append(
            f"| {r['batch']} | {r['adapters']} | {'yes' if r['graphs'] else 'no'} | {r['tokens_per_s']:.0f} | "
            f"{r['step_ms']:.2f} | {r['execute_ms']:.2f} | {hf} |"
        )
    (args.out / "decode_graphs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
