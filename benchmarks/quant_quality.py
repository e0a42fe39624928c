"""Quality of the quantized formats against the unquantized model, all measured in one run.

    python -m benchmarks.quant_quality [--model NAME|DIR] [--formats fp32 bf16 int8 int4 gguf] [--out DIR]
    python -m benchmarks.quant_quality --formats int8 --text-tokens 256 --prompts 4 --max-tokens 16 \\
        --lm-eval-limit 3                                                          # a smoke run
    python -m benchmarks.quant_quality --model DIR --formats fp32 int8 gguf --gguf A.gguf B.gguf --hf \\
        --no-gguf-check --no-lm-eval                                # several GGUF files, against transformers

Formats: `fp32` and `bf16` serve the checkpoint's weights in that dtype (the references: the others are
compared with `bf16`, and with `fp32` in a second table, which also shows how far bf16 itself moves);
`int8` / `int4` quantize them on load (`--quantization int8|int4`); `gguf` serves the model's GGUF file bare
(`--model file.gguf`, its projections in their own blocks): the model directory's own file, or --gguf FILE
(several files: one row each, named `gguf:<file stem>`).
The quantized formats keep their embeddings, norms and activations in --dtype. On CPU the quantized product
also rounds its activations to int8 blocks (motet/kernels/quant.py), as llama.cpp's CPU kernels do; that is
part of what is measured here.

For each format, with the offline engine (`LLM`) and then a `motet serve` of it:
  perplexity   over a fixed public-domain text shipped beside this script (TEXT), from the engine's prompt
               logprobs, in consecutive windows of at most --window tokens (default: the model's context);
               each window's first token is not scored; and the next-token argmax at every scored position
  vs hf        with --hf, Hugging Face transformers in fp32 on the checkpoint over the same windows: each format's
               perplexity ratio to it and top-1 agreement (the share of scored positions where the format's
               argmax equals transformers')
  greedy       --prompts chat prompts (motet.evals.throughput's tasks x topics, no two alike), --max-tokens
               tokens each, greedy with EOS ignored: the share of prompts whose whole output equals the
               reference's, and the mean length of the common prefix in tokens
  lm-eval      the manual's tasks (docs/evals.md) (motet/evals/lm_eval_tasks): motet_mc by loglikelihood over
               /v1/completions, motet_arith generated over /v1/chat/completions, lm_eval run as a subprocess
               offline, as docs/evals.md runs it; scores and their difference from the reference in points
and, for one `gguf` file (unless --no-gguf-check), whether the file is read right, against Hugging Face transformers on gguf-py's
dequantization of the same file (`from_pretrained(gguf_file=...)`): the weights motet holds (equal, exactly),
and the final logits over the prompts of motet (fp32) serving the file, against transformers plainly and
with the projections' inputs rounded as motet's CPU product rounds them. That rounding makes a 30-layer
model's logits chaotic (a value on a rounding boundary rounds one step apart under another summation order),
so the logits are held to the rounded model's own spread under two attention implementations
(GGUF_TOLERANCE), not to float precision.

Writes results.json and summary.md under --out (default benchmarks/reports/quant_quality/), the servers'
logs and lm_eval's outputs under its logs/.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import write_report
from motet.engine.core.scheduler import ScheduledBatch
from motet.engine.core.sequence import Sequence
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.evals.server import ROOT, ManagedServer, ServerError
from motet.evals.throughput import TASKS, TOPICS

# The text perplexity is measured on: three public-domain English texts, 20 KB, 4,664 tokens for the default
# model, written out for this file after the Declaration of Independence (1776; the National Archives'
# transcription, without the signers), Lincoln's Gettysburg Address (1863; the Bliss copy) and Genesis 1-3 in
# the King James Version (1611; the 1769 Oxford text). Every format reads the same file, so a stray difference
# from those editions changes no comparison.
TEXT = Path(__file__).parent / "data" / "public_domain.txt"
REPORT = Path(__file__).parent / "reports" / "quant_quality"
FLOAT_FORMATS = {"fp32": "float32", "bf16": "bfloat16"}  # the references: the checkpoint's weights
QUANTIZED_FORMATS = ("int8", "int4", "gguf")
FORMATS = (*FLOAT_FORMATS, *QUANTIZED_FORMATS)
REFERENCE = "bf16"  # every format is compared with it (and with fp32, where that runs too)
TASKS_DIR = "motet/evals/lm_eval_tasks"
# lm-eval task -> (metric key in lm_eval's results, the name shown)
LM_EVAL_METRICS = {
    "motet_mc": (("acc,none", "mc acc"), ("acc_norm,none", "mc acc_norm")),
    "motet_arith": (("exact_match,last_number", "arith exact_match"),),
}
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@dataclass(frozen=True)
class Format:
    """How one format is served: the model (a checkpoint directory or a GGUF file), its dtype and the
    quantization given to the engine (None: the checkpoint's weights, or a GGUF file's own blocks)."""

    name: str
    model: str
    dtype: str
    quantization: str | None = None

    def engine_options(self) -> dict:
        return {"dtype": self.dtype, "quantization": self.quantization}

    def serve_args(self) -> list[str]:
        args = ["--model", self.model, "--dtype", self.dtype]
        return args + (["--quantization", self.quantization] if self.quantization else [])


def format_of(name: str, model_dir: Path, gguf: Path | None, dtype: str) -> Format:
    """`name` served from `model_dir` (or the GGUF file); `dtype`: the quantized formats' float type."""
    if name in FLOAT_FORMATS:
        return Format(name, str(model_dir), FLOAT_FORMATS[name])
    if name == "gguf":
        if gguf is None:
            raise ValueError(f"gguf: {model_dir} holds no .gguf file; name one with --gguf FILE")
        return Format(name, str(gguf), dtype)
    return Format(name, str(model_dir), dtype, quantization=name)


def formats_of(names: list[str], model_dir: Path, ggufs: list[Path], dtype: str) -> list[Format]:
    """The formats to measure: `gguf` one row per file (named `gguf:<stem>` when there are several)."""
    out = []
    for name in names:
        if name != "gguf" or len(ggufs) < 2:
            out.append(format_of(name, model_dir, ggufs[0] if ggufs else None, dtype))
        else:
            out += [Format(f"gguf:{g.stem}", str(g), dtype) for g in ggufs]
    return out


# -- what is measured ----------------------------------------------------------------------------------------


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    """`token_ids` cut into consecutive windows of `size` tokens, the last one shorter (dropped when it is a lone
    token: a window's first token is not scored, so it would score nothing)."""
    if size < 2:
        raise ValueError(f"a perplexity window needs at least 2 tokens, got {size}")
    cut = [token_ids[i : i + size] for i in range(0, len(token_ids), size)]
    return [w for w in cut if len(w) >= 2]


def perplexity(llm: LLM, token_ids: list[int], window: int | None = None) -> dict:
    """exp of the mean negative log-likelihood of every token after the first of each window, from the
    engine's prompt logprobs, and the argmax at each of those positions; `window`: at most the engine's
    context less the one token generated."""
    limit = llm.engine.max_model_len - 1
    size = min(window or limit, limit)
    parts = windows(token_ids, size)
    outs = llm.generate(parts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    nll, scored, argmax = 0.0, 0, []
    for part, out in zip(parts, outs, strict=True):
        got = [lp.token_id for lp in out.prompt_logprobs or []]
        if got != part[1:]:  # a logprob for every token after the first, in order
            raise RuntimeError(f"prompt logprobs cover {len(got)} of the window's {len(part) - 1} tokens")
        nll -= sum(lp.logprob for lp in out.prompt_logprobs)
        scored += len(got)
        argmax += [lp.top[0][0] for lp in out.prompt_logprobs]
    return {"ppl": math.exp(nll / scored), "nll_per_token": nll / scored, "tokens": scored,
            "windows": len(parts), "window": size, "argmax": argmax}  # fmt: skip


def hf_reference(model_dir: Path, token_ids: list[int], size: int) -> dict:
    """Hugging Face transformers in fp32 on the checkpoint over the windows `perplexity` scores: its perplexity
    and argmax at every scored position."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    parts = windows(token_ids, size)
    nll, scored, argmax = 0.0, 0, []
    with torch.no_grad():
        for part in parts:
            logits = hf(torch.tensor([part])).logits[0, :-1].float()
            nll += F.cross_entropy(logits, torch.tensor(part[1:]), reduction="sum").item()
            scored += len(part) - 1
            argmax += logits.argmax(-1).tolist()
    del hf
    gc.collect()
    return {"ppl": math.exp(nll / scored), "nll_per_token": nll / scored, "tokens": scored,
            "windows": len(parts), "window": size, "argmax": argmax}  # fmt: skip


def top1_agreement(got: list[int], want: list[int]) -> float:
    """The share of positions whose argmax equals the reference's."""
    if len(got) != len(want):
        raise RuntimeError(f"argmax over {len(got)} positions against the reference's {len(want)}")
    return sum(g == w for g, w in zip(got, want, strict=True)) / len(want)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """n distinct chat prompts: motet.evals.throughput's tasks over its topics (64 pairs, then repeating)."""
    asks = [f"{TASKS[i % len(TASKS)]} {TOPICS[i // len(TASKS) % len(TOPICS)]}." for i in range(n)]
    return [tokenizer.encode_chat([{"role": "user", "content": a}]) for a in asks]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output, `max_tokens` tokens (EOS ignored, so every output has the same length)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """The share of outputs equal to the reference's whole, and the mean length of their common prefixes."""
    prefixes = [common_prefix(o, r) for o, r in zip(outputs, reference, strict=True)]
    exact = sum(o == r for o, r in zip(outputs, reference, strict=True))
    return {"exact_share": exact / len(outputs), "mean_common_prefix": sum(prefixes) / len(prefixes),
            "prefixes": prefixes}  # fmt: skip


def final_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The fp32 logits after each prompt's last token, one prompt per forward (the engine's own model and
    backend, as a step runs it); its KV blocks are freed after."""
    engine = llm.engine
    out = []
    for prompt in prompts:
        seq = Sequence(list(prompt))
        if not engine.block_manager.allocate_slots(seq, len(prompt)):
            raise RuntimeError(f"no KV blocks for a {len(prompt)}-token prompt")
        try:
            hidden, qsl = engine.runner.forward(ScheduledBatch([seq], [len(prompt)]).plan())
            out.append(engine.runner.compute_logits(hidden[qsl[1] - 1 : qsl[1]])[0].float().cpu())
        finally:
            engine.block_manager.free_seq(seq)
    return out


def logit_diffs(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict:
    diffs = [(g - w).abs() for g, w in zip(got, want, strict=True)]
    return {"max_abs": max(d.max().item() for d in diffs),
            "mean_abs": sum(d.mean().item() for d in diffs) / len(diffs),
            "argmax_agree": sum(int(g.argmax() == w.argmax()) for g, w in zip(got, want, strict=True)) / len(got),
            "logit_scale": sum(w.std().item() for w in want) / len(want)}  # fmt: skip


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The GGUF check passes when motet's logits are within this many times the spread of the rounded product
# itself (transformers' rounded model under two attention implementations): rounding the projections' inputs
# to int8 blocks makes the logits chaotic (a value on a rounding boundary rounds one step apart under another
# float summation order, and 30 layers amplify it), so two correct implementations differ by about that
# spread, while a misread tensor moves the logits by their own scale.
GGUF_TOLERANCE = 3.0
# ... or within this share of the logits' scale, where no value lands on a rounding boundary (a small model):
# what two fp32 implementations summing in different orders leave.
GGUF_FLOAT_TOLERANCE = 1e-3


def round_projection_inputs(model: torch.nn.Module, lm_head: bool) -> list:
    """Hooks rounding the decoder projections' inputs of a transformers model to int8 blocks, as motet's CPU
    product rounds them, and the lm_head's where motet holds it quantized (a GGUF's quantized output or tied
    table)."""
    from motet.kernels.quant import quantize_activations

    names = (*PROJECTIONS, "lm_head") if lm_head else PROJECTIONS
    return [
        module.register_forward_pre_hook(lambda _, args: (quantize_activations(args[0]),))
        for name, module in model.named_modules()
        if name.split(".")[-1] in names
    ]


def weight_diff(llm: LLM, hf) -> float:
    """The largest difference between the weights motet holds for a GGUF file (eager model: its projections'
    blocks dequantized, fused as motet fuses them, and the embedding table) and transformers' dequantization."""
    model = llm.engine.runner.model
    linears = model.decoder_linears()
    table = model.embed_tokens  # an nn.Embedding, or a GGUF table looked up in its own blocks (gguf_table.py)
    every_row = torch.arange(hf.model.embed_tokens.weight.shape[0])
    held = table.weight if hasattr(table, "weight") else table(every_row)
    worst = (held.float().cpu() - hf.model.embed_tokens.weight).abs().max().item()
    for i, layer in enumerate(hf.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        refs = [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]  # fmt: skip
        for lin, ref in zip(linears[4 * i : 4 * i + 4], refs, strict=True):
            w = lin.quantized.dequantize() if lin.quantized is not None else lin.weight.float()
            worst = max(worst, (w.cpu() - ref).abs().max().item())
    return worst


def gguf_logits_check(gguf: Path, prompts: list[list[int]], threads: int | None) -> dict:
    """Whether motet reads a GGUF file right, against transformers on gguf-py's dequantization of the same file
    (`from_pretrained(gguf_file=...)`): the weights motet holds (exactly equal when read right), and the final
    logits over the prompts of motet serving it in fp32 (the tightest comparison) against transformers plainly
    and, on CPU, with the projections' inputs rounded as motet's product rounds them."""
    from transformers import AutoModelForCausalLM

    llm = LLM(str(gguf), dtype="float32", num_threads=threads)
    cpu = llm.engine.config.torch_device.type == "cpu"
    got = final_logits(llm, prompts)
    del llm
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    eager = LLM(str(gguf), dtype="float32", num_threads=threads, compile_step=False)
    report = {"device": "cpu" if cpu else "cuda", "weights_max_abs_diff": weight_diff(eager, hf)}
    lm_head_quantized = eager.engine.runner.model.lm_head.quantized is not None
    del eager
    gc.collect()

    def logits() -> list[torch.Tensor]:
        with torch.no_grad():
            return [hf(torch.tensor([p])).logits[0, -1].float() for p in prompts]

    plain = logits()
    report["plain"] = logit_diffs(got, plain)
    if cpu:  # GPU kernels keep 16-bit activations: there the plain reference is the one
        round_projection_inputs(hf, lm_head_quantized)
        rounded = logits()
        report["rounded_inputs"] = logit_diffs(got, rounded)
        report["rounding_effect"] = logit_diffs(rounded, plain)  # transformers rounded against plain
        hf.set_attn_implementation("eager" if hf.config._attn_implementation != "eager" else "sdpa")
        report["rounded_spread"] = logit_diffs(logits(), rounded)  # the rounded product under two orders
        report["tolerance"] = (
            f"weights equal; logits' mean abs diff <= {GGUF_TOLERANCE} x the rounded spread, or "
            f"{GGUF_FLOAT_TOLERANCE:g} x the logits' scale"
        )
        allowed = max(
            GGUF_TOLERANCE * report["rounded_spread"]["mean_abs"],
            GGUF_FLOAT_TOLERANCE * report["rounded_inputs"]["logit_scale"],
        )
        within = report["rounded_inputs"]["mean_abs"] <= allowed
    else:
        report["tolerance"] = "weights equal (the logits are reported)"
        within = True
    report["read_right"] = report["weights_max_abs_diff"] == 0 and within
    return report


# -- lm-eval ------------------------------------------------------------------------------------------------


def lm_eval_commands(base_url: str, served: str, tokenizer: Path, limit: int | None, out: Path) -> dict:
    """The two lm_eval runs of docs/evals.md against one server, as argument lists."""
    common = [sys.executable, "-m", "lm_eval", "--include_path", TASKS_DIR]
    if limit is not None:
        common += ["--limit", str(limit)]
    mc_args = (f"model={served},base_url={base_url}/completions,tokenizer={tokenizer},"
               "tokenizer_backend=huggingface,tokenized_requests=False,num_concurrent=8,max_retries=1")  # fmt: skip
    arith_args = f"model={served},base_url={base_url}/chat/completions,num_concurrent=8,max_retries=1"
    return {
        "motet_mc": [*common, "--model", "local-completions", "--model_args", mc_args, "--tasks", "motet_mc",
                     "--output_path", str(out / "motet_mc")],
        "motet_arith": [*common, "--model", "local-chat-completions", "--model_args", arith_args,
                        "--apply_chat_template", "--tasks", "motet_arith", "--output_path", str(out / "motet_arith")],
    }  # fmt: skip


def run_lm_eval(fmt: Format, served: str, tokenizer: Path, args, logs: Path) -> dict:
    """The lm-eval tasks against a `motet serve` of `fmt`: {task: {metric: score}}."""
    server_args = [*fmt.serve_args(), "--served-model-name", served]
    if args.threads:
        server_args += ["--threads", str(args.threads)]
    scores = {}
    with ManagedServer(server_args, log_path=logs / f"{fmt.name}-server.log") as server:
        out = logs / f"{fmt.name}-lm_eval"
        for task, cmd in lm_eval_commands(
            server.base_url, served, tokenizer, args.lm_eval_limit, out
        ).items():
            proc = subprocess.run(
                cmd, cwd=ROOT, env={**os.environ, **OFFLINE_ENV}, capture_output=True, text=True
            )
            if proc.returncode != 0:
                raise RuntimeError(
                    f"lm_eval {task} on {fmt.name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
                )
            found = sorted((out / task).rglob("results_*.json"))  # named by time: the last is this run's
            if not found:
                raise RuntimeError(f"lm_eval {task} on {fmt.name} wrote no results under {out / task}")
            res = json.loads(found[-1].read_text())
            scores[task] = {key: res["results"][task][key] for key, _ in LM_EVAL_METRICS[task]}
            scores[task]["documents"] = res["n-samples"][task]["effective"]
    return scores


# -- the run ------------------------------------------------------------------------------------------------


def measure_offline(fmt: Format, text_ids, prompts, args) -> tuple[dict, list[list[int]], list[int]]:
    t0 = time.perf_counter()
    llm = LLM(fmt.model, num_threads=args.threads, **fmt.engine_options())
    t1 = time.perf_counter()
    ppl = perplexity(llm, text_ids, args.window)
    argmax = ppl.pop("argmax")
    t2 = time.perf_counter()
    outputs = greedy(llm, prompts, args.max_tokens)
    t3 = time.perf_counter()
    del llm
    gc.collect()
    print(f"{fmt.name:>5}: ppl {ppl['ppl']:.4f} over {ppl['tokens']} tokens ({t2 - t1:.0f} s), "
          f"greedy {len(prompts)} x {args.max_tokens} tokens ({t3 - t2:.0f} s)", flush=True)  # fmt: skip
    row = {"format": fmt.name, "model": fmt.model, "dtype": fmt.dtype, "quantization": fmt.quantization,
           "perplexity": ppl, "seconds": {"load": t1 - t0, "perplexity": t2 - t1, "greedy": t3 - t2}}  # fmt: skip
    return row, outputs, argmax


def compare(
    rows: dict[str, dict],
    outputs: dict[str, list[list[int]]],
    argmax: dict[str, list[int]],
    hf: dict | None = None,
) -> None:
    """Each row against each reference that ran: perplexity ratio, greedy agreement, lm-eval deltas; and
    against transformers fp32 (`hf`, where it ran): perplexity ratio and top-1 agreement over the text."""
    for row in rows.values() if hf is not None else ():
        row["vs_hf"] = {"ppl_ratio": row["perplexity"]["ppl"] / hf["ppl"],
                        "top1_agreement": top1_agreement(argmax[row["format"]], hf["argmax"])}  # fmt: skip
    for ref in (r for r in FLOAT_FORMATS if r in rows):
        base = rows[ref]
        for row in rows.values():
            vs = {"ppl_ratio": row["perplexity"]["ppl"] / base["perplexity"]["ppl"],
                  "greedy": agreement(outputs[row["format"]], outputs[ref])}  # fmt: skip
            if "lm_eval" in row and "lm_eval" in base:
                vs["lm_eval_delta_points"] = {
                    task: {
                        k: 100 * (v - base["lm_eval"][task][k]) for k, v in scores.items() if k != "documents"
                    }
                    for task, scores in row["lm_eval"].items()
                }
            row.setdefault("vs", {})[ref] = vs


def summary_md(report: dict) -> str:
    limit = report["lm_eval_limit"]
    lines = [f"# Quantized formats against the unquantized model ({report['model']})", "",
             f"`{report['command']}`", "",
             f"Perplexity: {report['text']} ({report['text_tokens']} tokens); greedy: {report['prompts']} chat "
             f"prompts x {report['max_tokens']} tokens; lm-eval: {TASKS_DIR} "
             f"({'not run' if not report['lm_eval_run'] else 'all documents' if limit is None else f'--limit {limit}'}). "
             f"Quantized formats in {report['dtype']}; {report['machine']}.", ""]  # fmt: skip
    metrics = [(task, key, label) for task, ms in LM_EVAL_METRICS.items() for key, label in ms]
    for ref in (r for r in FLOAT_FORMATS if any(r in row.get("vs", {}) for row in report["rows"])):
        lines += [f"## Against {ref}", ""]
        head = ["format", "ppl", f"ppl / {ref}", "greedy exact", "mean common prefix"]
        head += [f"{label} (Δ pts)" for *_, label in metrics]
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for row in report["rows"]:
            vs = row["vs"][ref]
            cells = [row["format"], f"{row['perplexity']['ppl']:.4f}", f"{vs['ppl_ratio']:.4f}",
                     f"{vs['greedy']['exact_share']:.2f}",
                     f"{vs['greedy']['mean_common_prefix']:.1f} / {report['max_tokens']}"]  # fmt: skip
            for task, key, _ in metrics:
                if "lm_eval_delta_points" in vs:
                    score, delta = row["lm_eval"][task][key], vs["lm_eval_delta_points"][task][key]
                    cells.append(f"{score:.3f} ({delta:+.1f})")
                else:
                    cells.append("-")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if "hf" in report:
        hf = report["hf"]
        lines += ["## Against transformers fp32", "",
                  f"Hugging Face transformers {hf['transformers']} in fp32 on {report['model']} over the same "
                  f"windows: perplexity {hf['ppl']:.4f} over {hf['tokens']} tokens. Top-1: the share of those "
                  "positions where the format's next-token argmax equals transformers'.", "",
                  "| format | ppl | ppl / transformers fp32 | top-1 agreement |", "|---|---:|---:|---:|"]  # fmt: skip
        for row in report["rows"]:
            vs = row["vs_hf"]
            lines.append(f"| {row['format']} | {row['perplexity']['ppl']:.4f} | {vs['ppl_ratio']:.4f} | "
                         f"{vs['top1_agreement']:.4f} |")  # fmt: skip
        lines.append("")
    if "gguf_logits" in report:
        g = report["gguf_logits"]
        rows = {"plain": "motet vs transformers", "rounded_inputs": "motet vs transformers, inputs rounded",
                "rounding_effect": "transformers rounded vs plain (the rounding's effect)",
                "rounded_spread": "transformers rounded, sdpa vs eager attention (its spread)"}  # fmt: skip
        lines += ["## The GGUF file read right", "",
                  f"motet serving {report['gguf']} against transformers on gguf-py's dequantization of the same "
                  f"file. Weights (motet's blocks dequantized, and its embedding table): max abs diff "
                  f"{g['weights_max_abs_diff']:g}. Final logits (motet in fp32) over the {report['prompts']} "
                  f"prompts, logits' mean std {g['plain']['logit_scale']:.2f}:", "",
                  "| comparison | max abs diff | mean abs diff | same argmax |", "|---|---:|---:|---:|"]  # fmt: skip
        for key, label in rows.items():
            if key in g:
                d = g[key]
                lines.append(
                    f"| {label} | {d['max_abs']:.4f} | {d['mean_abs']:.5f} | {d['argmax_agree']:.2f} |"
                )
        lines += ["", f"Read right: **{'yes' if g['read_right'] else 'NO'}** ({g['tolerance']}). On CPU motet "
                  "rounds the projections' inputs to int8 blocks (as llama.cpp's CPU kernels do), which makes the "
                  "logits chaotic at the level of the spread above; a misread tensor would move them by their scale."]  # fmt: skip
    return "\n".join(lines) + "\n"


def machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return f"{device}, {os.cpu_count()} cores, torch {torch.__version__}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=None, help="model name or checkpoint directory (default: the default model)"
    )
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS,
                    help=f"formats to measure; {REFERENCE} (the reference) always runs")  # fmt: skip
    ap.add_argument("--gguf", nargs="+", default=None,
                    help="the GGUF file(s) of format gguf (default: the model directory's own)")  # fmt: skip
    ap.add_argument("--no-gguf-check", action="store_true",
                    help="skip checking the GGUF file against transformers' reading of it")  # fmt: skip
    ap.add_argument("--hf", action="store_true",
                    help="also compare every format with transformers fp32 on the checkpoint (ppl, top-1)")  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the quantized formats' float type (embeddings, norms, activations)")  # fmt: skip
    ap.add_argument("--text-tokens", type=int, default=None,
                    help="score only the text's first N tokens (default: all of it)")  # fmt: skip
    ap.add_argument("--window", type=int, default=None,
                    help="perplexity window in tokens (default: the model's context)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=32, help="greedy prompts (and GGUF logit prompts)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument(
        "--lm-eval-limit", type=int, default=None, help="lm_eval --limit (default: every document)"
    )
    ap.add_argument("--no-lm-eval", action="store_true", help="skip the lm-eval tasks")
    ap.add_argument("--threads", type=int, default=None, help="compute threads (default: the engine's)")
    ap.add_argument("--out", default=str(REPORT), help="report directory (default: %(default)s)")
    args = ap.parse_args(argv)
    for name in ("text_tokens", "window", "prompts", "max_tokens", "lm_eval_limit", "threads"):
        value = getattr(args, name)
        if value is not None and value < (2 if name == "window" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'window' else 1}, got {value}")

    from motet.engine.tokenizer import load_tokenizer
    from motet.engine.weights.gguf_weights import gguf_file
    from motet.engine.weights.model_store import resolve_model

    command = "python -m benchmarks.quant_quality " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(command, flush=True)
    model_dir = Path(resolve_model(args.model))
    names = [REFERENCE] + [f for f in FORMATS if f in args.formats and f != REFERENCE]
    ggufs = []
    if "gguf" in names:
        ggufs = [Path(g) for g in args.gguf] if args.gguf else [gguf_file(model_dir)]
    formats = formats_of(names, model_dir, ggufs, args.dtype)
    tokenizer = load_tokenizer(model_dir)
    text_ids = tokenizer.encode(TEXT.read_text())[: args.text_tokens]
    prompts = chat_prompts(tokenizer, args.prompts)
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    rows, outputs, argmax = {}, {}, {}
    for fmt in formats:
        rows[fmt.name], outputs[fmt.name], argmax[fmt.name] = measure_offline(fmt, text_ids, prompts, args)
        if not args.no_lm_eval:
            t = time.perf_counter()
            rows[fmt.name]["lm_eval"] = run_lm_eval(fmt, model_dir.name, model_dir, args, logs)
            rows[fmt.name]["seconds"]["lm_eval"] = time.perf_counter() - t
            print(
                f"{fmt.name:>5}: lm-eval {rows[fmt.name]['lm_eval']} ({time.perf_counter() - t:.0f} s)",
                flush=True,
            )
    hf = None
    if args.hf:
        import transformers

        t = time.perf_counter()
        hf = hf_reference(model_dir, text_ids, rows[REFERENCE]["perplexity"]["window"])
        hf["transformers"] = transformers.__version__
        print(f"transformers fp32: ppl {hf['ppl']:.4f} ({time.perf_counter() - t:.0f} s)", flush=True)
    compare(rows, outputs, argmax, hf)
    report = {"command": command, "model": model_dir.name, "model_dir": str(model_dir), "dtype": args.dtype,
              "text": str(TEXT.relative_to(ROOT)), "text_tokens": len(text_ids), "prompts": len(prompts),
              "max_tokens": args.max_tokens, "lm_eval_run": not args.no_lm_eval, "lm_eval_limit": args.lm_eval_limit,
              "machine": machine(), "rows": list(rows.values())}  # fmt: skip
    if hf is not None:
        report["hf"] = {k: v for k, v in hf.items() if k != "argmax"}
    if ggufs:
        report["gguf"] = ", ".join(map(str, ggufs))
    if len(ggufs) == 1 and not args.no_gguf_check:
        gguf = ggufs[0]
        t = time.perf_counter()
        report["gguf_logits"] = gguf_logits_check(gguf, prompts, args.threads)
        report["gguf_logits"]["seconds"] = time.perf_counter() - t
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    try:
        main()
    except (ServerError, RuntimeError, ValueError) as e:
        sys.exit(f"error: {e}")
