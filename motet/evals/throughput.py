"""Offline throughput: motet's engine vs Hugging Face transformers `generate`, same weights and dtype.

    python -m motet.evals.throughput [--batches 1 8 32 64] [--prompts 64] [--new-tokens 128] [--out reports/throughput]

For each batch limit B, both generate `--new-tokens` tokens for each of the chat prompts (EOS ignored, so
the work is equal): motet with max_num_seqs=B (continuous batching), HF in padded batches of B. Reports
tokens/s and the ratio, plus motet's batch-1 decode rate against the weight-bandwidth ceiling
(weight bytes / measured memory read bandwidth). Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.model_store import resolve_model

TOPICS = [
    "the ocean", "volcanoes", "bread baking", "chess openings", "the moon", "honeybees", "jazz", "bicycles",
    "rainforests", "origami", "black holes", "coffee", "the Roman empire", "penguins", "solar panels", "tea",
]  # fmt: skip
TASKS = ["Write a short story about", "Explain", "Give five facts about", "Write a poem about"]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    return [
        tokenizer.encode_chat([{"role": "user", "content": f"{TASKS[i % 4]} {TOPICS[i % 16]}."}])
        for i in range(n)
    ]


def read_bandwidth_gbs(size_mb: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth as a reduction over a buffer much larger than the caches sees it."""
    x = torch.ones(size_mb * 2**20 // 4)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def run_motet(llm: LLM, prompts, new_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, params)
    decode_time, decode_steps, t0 = 0.0, 0, time.perf_counter()
    while engine.has_unfinished():
        batch = engine.schedule()
        t = time.perf_counter()
        result = engine.execute(batch)
        if all(n == 1 for n in batch.num_new_tokens):
            decode_time += time.perf_counter() - t
            decode_steps += 1
        engine.commit(batch, result)
    elapsed = time.perf_counter() - t0
    return {
        "seconds": elapsed,
        "tokens_per_s": len(prompts) * new_tokens / elapsed,
        "decode_step_ms": 1e3 * decode_time / max(decode_steps, 1),
    }


def run_hf(
    model, tokenizer, prompts, batch: int, new_tokens: int, adapter_names: list[str] | None = None
) -> dict:
    """HF `generate` in padded batches of `batch`; `adapter_names` (one per prompt) for a PEFT model's
    mixed-adapter batches ("__base__": no adapter)."""
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        extra = {"adapter_names": adapter_names[i : i + batch]} if adapter_names else {}
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
                **extra,
            )
    elapsed = time.perf_counter() - t0
    return {"seconds": elapsed, "tokens_per_s": len(prompts) * new_tokens / elapsed}


def engine_vs_hf(
    model_dir,
    dtype,
    hf,
    batches: list[int],
    n_prompts: int,
    batch1_prompts: int | None,
    new_tokens: int,
    on_row=print,
) -> list[dict]:
    """For each batch limit B: motet (max_num_seqs=B) and HF (padded batches of B) on the same prompts."""
    rows = []
    for b in batches:
        n = batch1_prompts if (b == 1 and batch1_prompts) else n_prompts
        llm = LLM(str(model_dir), dtype=dtype, max_num_seqs=b, num_kv_blocks=4096)
        prompts = chat_prompts(llm.tokenizer, n)
        ours = run_motet(llm, prompts, new_tokens)
        ref = run_hf(hf, llm.tokenizer.hf, prompts, b, new_tokens)
        rows.append(
            {
                "batch": b,
                "prompts": n,
                "motet": ours,
                "hf": ref,
                "ratio": ours["tokens_per_s"] / ref["tokens_per_s"],
            }
        )
        if on_row:
            on_row(
                f"batch {b:3d}: motet {ours['tokens_per_s']:8.1f} tok/s  HF {ref['tokens_per_s']:8.1f} tok/s  "
                f"ratio {rows[-1]['ratio']:.2f}x"
            )
        del llm
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument(
        "--batch1-prompts", type=int, default=None, help="fewer prompts at batch 1 (default: --prompts)"
    )
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default="reports/throughput")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    model_dir = resolve_model(args.model)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied embeddings count once
    bandwidth = read_bandwidth_gbs()

    rows = engine_vs_hf(
        model_dir, args.dtype, hf, args.batches, args.prompts, args.batch1_prompts, args.new_tokens
    )
    ceiling = bandwidth * 1e9 / weight_bytes
    b1 = next((r for r in rows if r["batch"] == 1), None)
    decode_rate = 1e3 / b1["motet"]["decode_step_ms"] if b1 else None
    report = {
        "model": str(model_dir),
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
        "machine": {
            "cpus": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "weight_bytes": weight_bytes,
        "read_bandwidth_gbs": bandwidth,
        "batch1_ceiling_tokens_per_s": ceiling,
        "batch1_decode_tokens_per_s": decode_rate,
        "batch1_fraction_of_ceiling": decode_rate / ceiling if decode_rate else None,
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2))
    lines = [
        f"# Offline throughput: motet vs HF transformers ({args.dtype}, {args.new_tokens} new tokens per prompt)",
        "",
        "| batch limit | prompts | motet tok/s | HF tok/s | motet / HF |",
        "|---:|---:|---:|---:|---:|",
        *(
            f"| {r['batch']} | {r['prompts']} | {r['motet']['tokens_per_s']:.1f} | {r['hf']['tokens_per_s']:.1f} "
            f"| {r['ratio']:.2f}x |"
            for r in rows
        ),
        "",
        f"Weights: {weight_bytes / 1e6:.0f} MB; measured read bandwidth {bandwidth:.1f} GB/s; "
        f"batch-1 ceiling {ceiling:.1f} tok/s.",
    ]
    if decode_rate:
        lines.append(
            f"Batch-1 decode: {decode_rate:.1f} tok/s = {100 * decode_rate / ceiling:.0f}% of the weight-bandwidth ceiling."
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
