"""What several fine-tuning jobs' rows in one micro-batch could save on this machine (issue 66: many tenants' jobs
in one batch over one frozen base, ASPEN / mLoRA's way): the training step's work (forward and backward of the base
with a LoRA adapter, PEFT on transformers, the loss on the answers' tokens) for one micro-batch of --jobs x --batch
rows against --jobs micro-batches of --batch rows, the same rows. Where the first costs about as much as the second,
the machine's compute is already used as well by one job's micro-batch as by several jobs' together, and batching
jobs cannot make four jobs finish faster than one after another; where it costs much less (a GPU's small batches
leave it idle), it can.

With --shared-base, also one job's micro-batch over the frozen base a job reads from the server's prepared weights
(motet/training/shared_base.py: the served model's panels, mapped) against the same over a private copy of the base:
the speed a job pays for not holding a second copy (the served model's entry must exist: start the server once).

Each is timed by the wall clock (what a job's end waits for: measure on a quiet machine) and by its process CPU time
(all its threads', waits spinning included), the smallest of --repeats, at --threads compute threads.

    python -m benchmarks.fine_tuning_batch                      # the default model, 4 jobs x 4 rows of 53 tokens
    python -m benchmarks.fine_tuning_batch --jobs 4 --batch 8
    python -m benchmarks.fine_tuning_batch --shared-base          # and the shared base's step against a private copy

Writes fine_tuning_batch-TIME.json and .md under --output-dir.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.fine_tuning import machine
from motet.evals.serving_bench import write_report

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def step_seconds(model, rows: int, tokens: int, answer: int, vocab: int, repeats: int) -> dict:
    """The smallest wall and CPU time of a forward and backward of `rows` rows of `tokens` tokens, the loss on the
    last `answer` tokens of each."""
    import torch

    best = {"wall_s": float("inf"), "cpu_s": float("inf")}
    generator = torch.Generator().manual_seed(0)
    for _ in range(repeats):
        ids = torch.randint(0, vocab, (rows, tokens), generator=generator)
        labels = ids.clone()
        labels[:, : tokens - answer] = -100
        wall, cpu = time.perf_counter(), time.process_time()
        model(input_ids=ids, labels=labels).loss.backward()
        best["wall_s"] = min(best["wall_s"], time.perf_counter() - wall)
        best["cpu_s"] = min(best["cpu_s"], time.process_time() - cpu)
        model.zero_grad(set_to_none=True)
    return best


def lora_model(base, rank: int):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(base, lora)


def shared_against_private(args, model_dir: Path, private) -> dict:
    """One job's micro-batch over the shared base and over `private` (a PEFT model on a private copy), each the
    smallest of --repeats, alternating."""
    from motet.training.shared_base import shared_base

    base = shared_base(model_dir, "float32")
    if base is None:
        return {"shared": None}  # (no prepared weights of the model: said in the report)
    shared, vocab = lora_model(base, args.rank), base.config.vocab_size
    times: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, model in (("shared", shared), ("private", private)):
            t = step_seconds(model, args.batch, args.tokens, args.answer_tokens, vocab, 1)
            best = times.setdefault(name, t)
            times[name] = {k: min(best[k], t[k]) for k in t}
    return {**times, "speed": times["private"]["wall_s"] / times["shared"]["wall_s"],
            "cpu_speed": times["private"]["cpu_s"] / times["shared"]["cpu_s"]}  # fmt: skip


def measure(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from motet.engine.weights.model_store import default_model_path

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_path()
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = lora_model(base, args.rank)
    vocab = base.config.vocab_size
    step_seconds(model, args.batch, args.tokens, args.answer_tokens, vocab, 1)  # (warm-up)
    one = step_seconds(model, args.batch, args.tokens, args.answer_tokens, vocab, args.repeats)
    together = step_seconds(
        model, args.jobs * args.batch, args.tokens, args.answer_tokens, vocab, args.repeats
    )
    shared = shared_against_private(args, model_dir, model) if args.shared_base else None
    return {
        "shared_base": shared,
        "model": str(model_dir), "jobs": args.jobs, "batch": args.batch, "tokens": args.tokens,
        "answer_tokens": args.answer_tokens, "rank": args.rank, "threads": args.threads,
        "one_job_micro_batch": one, "jobs_in_one_micro_batch": together,
        "ratio": together["wall_s"] / (args.jobs * one["wall_s"]),
        "cpu_ratio": together["cpu_s"] / (args.jobs * one["cpu_s"]),
    }  # fmt: skip


def summary(r: dict) -> str:
    m, b = r["machine"], r["batch"]
    return "\n".join([
        "# Several jobs' rows in one micro-batch", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, flags {', '.join(m['flags']) or 'none of avx2/avx512'}; "
        f"{b['threads']} threads, float32, LoRA rank {b['rank']} on {', '.join(TARGETS)}.", "",
        "| measure | wall s | CPU s |", "|---|---|---|",
        f"| one job's micro-batch: {b['batch']} rows of {b['tokens']} tokens, forward and backward | "
        f"{b['one_job_micro_batch']['wall_s']:.2f} | {b['one_job_micro_batch']['cpu_s']:.2f} |",
        f"| {b['jobs']} jobs' rows in one micro-batch ({b['jobs'] * b['batch']} rows) | "
        f"{b['jobs_in_one_micro_batch']['wall_s']:.2f} | {b['jobs_in_one_micro_batch']['cpu_s']:.2f} |",
        f"| the second over {b['jobs']} x the first (below 1: what batching the jobs saves) | {b['ratio']:.2f} | "
        f"{b['cpu_ratio']:.2f} |",
    ] + _shared_lines(b["shared_base"])) + "\n"  # fmt: skip


def _shared_lines(r: dict | None) -> list[str]:
    if r is None:
        return []
    if r["shared"] is None:
        return ["", "The shared base: no prepared weights of the model to read (start the server once)."]
    return [
        "", "| one job's micro-batch over | wall s | CPU s |", "|---|---|---|",
        f"| the shared base (the server's prepared weights, mapped) | {r['shared']['wall_s']:.2f} | "
        f"{r['shared']['cpu_s']:.2f} |",
        f"| a private copy of the base | {r['private']['wall_s']:.2f} | {r['private']['cpu_s']:.2f} |",
        f"| the shared base's speed over the private copy's | {r['speed']:.3f} | {r['cpu_speed']:.3f} |",
    ]  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="the base model's directory (default: the default model)")
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--batch", type=int, default=4, help="one job's micro-batch (rows)")
    p.add_argument(
        "--tokens", type=int, default=53, help="a row's tokens (the docs' behaviour file: 53 on average)"
    )
    p.add_argument("--answer-tokens", type=int, default=13, help="a row's answer tokens (the loss's)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--shared-base", action="store_true", help="also the shared base's step against a private copy"
    )
    p.add_argument("--output-dir", default="benchmarks/reports/fine_tuning")
    args = p.parse_args(argv)
    report = {"machine": machine(), "batch": measure(args)}
    write_report(Path(args.output_dir), "fine_tuning_batch", report, summary(report))
    print(summary(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
