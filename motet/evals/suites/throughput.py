"""Offline throughput: motet's engine against HF transformers `generate`, and with LoRA against HF + PEFT.

No server: both run in this process on the same weights, dtype and chat prompts, generating --new-tokens
tokens per prompt with EOS ignored, so the work is equal; figures are ratios from one run (this
machine is noisy across runs).

- Batches: for each of --batches B, motet with max_num_seqs=B (continuous batching) vs HF in padded
  batches of B (--prompts prompts; --batch1-prompts at B=1). Also the batch-1 decode rate against the
  weight-bandwidth ceiling (weight bytes / measured memory read bandwidth). (motet/evals/throughput.py)
- LoRA: one batch of --lora-batch prompts on the base model, on one adapter, and spread over
  --lora-adapters distinct adapters (random, rank --lora-rank, all seven modules), in motet and in HF +
  PEFT (mixed-adapter batches through `adapter_names`). End-to-end tokens/s of each and motet's decode
  rate relative to its base model. (motet/evals/lora_bench.py)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from motet.evals import report
from motet.evals.context import EvalContext

NAME = "throughput"
NEEDS_SERVER = False


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("throughput options")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    g.add_argument("--prompts", type=int, default=32, help="prompts per batch size")
    g.add_argument("--batch1-prompts", type=int, default=4, help="prompts at batch 1 (it is slow)")
    g.add_argument("--new-tokens", type=int, default=64)
    g.add_argument("--lora-batch", type=int, default=8, help="prompts in the LoRA batch (0: skip LoRA)")
    g.add_argument("--lora-adapters", type=int, default=4)
    g.add_argument("--lora-rank", type=int, default=8)


def _lora(ctx: EvalContext, model_dir: Path, hf) -> list[dict]:
    from motet.engine.llm import LLM
    from motet.evals.lora_bench import run as run_lora
    from motet.evals.lora_reference import peft_model, write_random_adapter
    from motet.evals.throughput import chat_prompts, run_hf

    a = ctx.args
    batch, n_adapters, tokens = a.lora_batch, a.lora_adapters, a.new_tokens
    llm = LLM(
        str(model_dir),
        dtype=a.dtype,
        max_num_seqs=batch,
        num_kv_blocks=batch * (-(-(tokens + 256) // 16)),  # room for every request
        max_loras=n_adapters,
        max_lora_rank=a.lora_rank,
        speculative="off",  # plain decode steps: the adapter path's cost, not speculation's gain
    )
    base = llm.engine.model_config
    prompts = chat_prompts(llm.tokenizer, batch)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [
            write_random_adapter(Path(tmp) / f"a{i}", base, a.lora_rank, seed=i) for i in range(n_adapters)
        ]
        ids = [llm.add_lora(f"eval-{i}", p) for i, p in enumerate(paths)]
        peft = peft_model(hf, {f"a{i}": path for i, path in enumerate(paths)}).eval()
        scenarios = {
            "base": ([0] * batch, ["__base__"] * batch),
            "1 adapter": ([ids[0]] * batch, ["a0"] * batch),
            f"{n_adapters} adapters": (
                [ids[i % n_adapters] for i in range(batch)],
                [f"a{i % n_adapters}" for i in range(batch)],
            ),
        }
        bar = ctx.progress(len(scenarios), "lora: motet vs HF + PEFT")
        for name, (motet_ids, peft_names) in scenarios.items():
            run_lora(llm, prompts, motet_ids, 2)  # warm-up: the adapters into their slots
            ours = run_lora(llm, prompts, motet_ids, tokens)
            ours["tokens_per_s"] = batch * tokens / ours["seconds"]
            ref = run_hf(peft, llm.tokenizer.hf, prompts, batch, tokens, adapter_names=peft_names)
            rows.append(
                {
                    "scenario": name,
                    "motet": ours,
                    "hf_peft": ref,
                    "ratio": ours["tokens_per_s"] / ref["tokens_per_s"],
                }
            )
            bar.update(1)
        bar.close()
        peft.unload()  # HF's model without the LoRA layers again
    base_rate = rows[0]["motet"]["decode_tokens_per_s"]
    for r in rows:
        r["motet_decode_vs_base"] = r["motet"]["decode_tokens_per_s"] / base_rate
    return rows


def run(ctx: EvalContext) -> dict:
    import platform

    import torch
    from transformers import AutoModelForCausalLM

    from motet.engine.weights.model_store import resolve_model
    from motet.evals.throughput import engine_vs_hf, read_bandwidth_gbs

    a = ctx.args
    t0 = time.perf_counter()
    model_dir = resolve_model(ctx.model or None)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied embeddings count once
    bandwidth = read_bandwidth_gbs()

    bar = ctx.progress(len(a.batches), "batches: motet vs HF")
    rows = engine_vs_hf(
        model_dir,
        a.dtype,
        hf,
        a.batches,
        a.prompts,
        a.batch1_prompts,
        a.new_tokens,
        on_row=lambda _: bar.update(1),
    )
    bar.close()
    lora = _lora(ctx, model_dir, hf) if a.lora_batch > 0 else []

    ceiling = bandwidth * 1e9 / weight_bytes
    b1 = next((r for r in rows if r["batch"] == 1), None)
    decode_rate = 1e3 / b1["motet"]["decode_step_ms"] if b1 else None
    return {
        "config": {
            "model": str(model_dir),
            "dtype": a.dtype,
            "new_tokens": a.new_tokens,
            "lora_batch": a.lora_batch,
            "lora_adapters": a.lora_adapters,
            "lora_rank": a.lora_rank,
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "seconds": time.perf_counter() - t0,
        },
        "weight_bytes": weight_bytes,
        "read_bandwidth_gbs": bandwidth,
        "batch1_ceiling_tokens_per_s": ceiling,
        "batch1_decode_tokens_per_s": decode_rate,
        "batch1_fraction_of_ceiling": decode_rate / ceiling if decode_rate else None,
        "batches": rows,
        "lora": lora,
    }


def markdown(results: dict) -> str:
    cfg = results["config"]
    rows = [
        [
            str(r["batch"]),
            str(r["prompts"]),
            report.fmt(r["motet"]["tokens_per_s"], ".1f"),
            report.fmt(r["hf"]["tokens_per_s"], ".1f"),
            report.fmt(r["ratio"]) + "x",
        ]
        for r in results["batches"]
    ]
    parts = [
        f"Model `{cfg['model']}`, {cfg['dtype']}, {cfg['new_tokens']} new tokens per prompt (EOS ignored), "
        f"{cfg['threads']} torch threads.",
        "",
        "## motet vs HF transformers generate",
        "",
        report.table(["batch limit", "prompts", "motet tok/s", "HF tok/s", "motet / HF"], rows),
        "",
        f"Weights {results['weight_bytes'] / 1e6:.0f} MB; measured read bandwidth "
        f"{report.fmt(results['read_bandwidth_gbs'], '.1f')} GB/s; batch-1 ceiling "
        f"{report.fmt(results['batch1_ceiling_tokens_per_s'], '.1f')} tok/s.",
    ]
    if results["batch1_decode_tokens_per_s"]:
        parts.append(
            f"Batch-1 decode: {report.fmt(results['batch1_decode_tokens_per_s'], '.1f')} tok/s = "
            f"{report.pct(results['batch1_fraction_of_ceiling'], 0)} of the weight-bandwidth ceiling."
        )
    if results["lora"]:
        rows = [
            [
                r["scenario"],
                report.fmt(r["motet"]["tokens_per_s"], ".1f"),
                report.fmt(r["hf_peft"]["tokens_per_s"], ".1f"),
                report.fmt(r["ratio"]) + "x",
                report.fmt(r["motet"]["decode_tokens_per_s"], ".1f"),
                report.fmt(r["motet_decode_vs_base"]) + "x",
            ]
            for r in results["lora"]
        ]
        parts += [
            "",
            f"## LoRA: motet vs HF + PEFT (batch {cfg['lora_batch']}, rank {cfg['lora_rank']}, all modules)",
            "",
            report.table(
                [
                    "scenario",
                    "motet tok/s",
                    "HF+PEFT tok/s",
                    "motet / HF+PEFT",
                    "motet decode tok/s",
                    "motet decode vs base",
                ],
                rows,
            ),
        ]
    return "\n".join(parts)


def plots(results: dict, out_dir: Path) -> list[Path]:
    plt = report.pyplot()
    ncols = 2 if results["lora"] else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.5), squeeze=False)
    rows = results["batches"]
    report.grouped_bars(
        axes[0][0],
        [f"batch {r['batch']}" for r in rows],
        {
            "motet": [r["motet"]["tokens_per_s"] for r in rows],
            "HF generate": [r["hf"]["tokens_per_s"] for r in rows],
        },
        "tokens/s",
        "Offline throughput per batch limit",
        value_fmt=".3g",
    )
    if results["lora"]:
        lora = results["lora"]
        report.grouped_bars(
            axes[0][1],
            [r["scenario"] for r in lora],
            {
                "motet": [r["motet"]["tokens_per_s"] for r in lora],
                "HF + PEFT": [r["hf_peft"]["tokens_per_s"] for r in lora],
            },
            "tokens/s",
            f"LoRA batch of {results['config']['lora_batch']}",
            value_fmt=".3g",
        )
    return [report.save(fig, out_dir / "throughput.png")]


def summary(results: dict) -> str:
    lines = [
        f"batch {r['batch']:3d}: motet {report.fmt(r['motet']['tokens_per_s'], '.1f')} tok/s, "
        f"HF {report.fmt(r['hf']['tokens_per_s'], '.1f')} tok/s, {report.fmt(r['ratio'])}x"
        for r in results["batches"]
    ]
    lines += [
        f"LoRA {r['scenario']}: motet {report.fmt(r['motet']['tokens_per_s'], '.1f')} tok/s, "
        f"HF+PEFT {report.fmt(r['hf_peft']['tokens_per_s'], '.1f')} tok/s, {report.fmt(r['ratio'])}x"
        for r in results["lora"]
    ]
    return "\n".join(lines)
