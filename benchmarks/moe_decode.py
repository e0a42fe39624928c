"""Mixture-of-experts decode: motet's engine (the compiled CPU step) against Hugging Face `generate` on the same
model, in the same run, at equal threads.

    python -m benchmarks.moe_decode [--arch mixtral] [--hidden 768] [--layers 4] [--experts 8] [--top-k 2]
                                    [--expert-inter 2048] [--batches 1 8 32] [--prompt 32] [--tokens 32]
                                    [--repeats 3] [--threads 2] [--dtypes float32 bfloat16]
                                    [--formats bf16 int8 int4 mxfp4] [--quick] [--out DIR]

The model: random weights (N(0, 0.02)) in a real architecture's shape, built with transformers and saved once
(Mixtral-shaped by default: hidden 768, 12 heads of 64, 4 KV heads, 8 experts of 2048 with top-2 routing,
4 layers, a 32000 vocabulary, untied lm_head; `--arch qwen2_moe` adds Qwen2-MoE's shared expert of
`--shared-inter` with its sigmoid gate; `--arch qwen3_moe` is Qwen3-MoE: no shared expert, renormalized top-k,
per-head q/k RMSNorm; `--arch gpt_oss` is GPT-OSS: experts with biases and a clamped SwiGLU, sinks, every other layer
sliding). For each batch size B, B greedy requests of --prompt random tokens
each generate --tokens tokens (EOS ignored on both sides):

- motet: the offline engine (max_num_seqs B, speculation off: one token per sequence a step). Prefill
  runs first; then the decode steps are timed, B tokens a step.
- Hugging Face: `model.generate` on the [B, prompt] batch, do_sample False, min_new_tokens = max_new_tokens,
  the default experts implementation and KV cache; its decode time is generate(--tokens) minus
  generate(1) (the prefill and the first token), for --tokens - 1 steps of B tokens.

Decode tokens/s = B x steps / decode time (median of --repeats), and motet's speed-up over Hugging Face. Both
sides use --threads torch threads (motet's native kernels share torch's OpenMP pool) and the same weights' dtype,
each of --dtypes in turn: float32, where torch's CPU products are at their best, and bfloat16, how MoE
checkpoints ship (torch's bf16 products are slow on CPUs without bf16 instructions; motet widens bf16 in
registers and keeps fp32 activations). The issue's target: >= 3x at batch 32.

`--formats` adds motet alone on the same model with its experts in each format in turn, the rest of the model
in bf16: bf16 (the float experts' grouped GEMM), int8 / int4 (`--quantization`: Q8_0's / Q4_1's blocks; the
attention projections and lm_head are quantized too), mxfp4 (the checkpoint rewritten with its experts in MXFP4
blocks as OpenAI's are: `--arch gpt_oss` only). Each reports its decode step time (ms a step of B tokens).
`--dtypes` with no value leaves the Hugging Face comparison out:

    python -m benchmarks.moe_decode --arch gpt_oss --formats bf16 int8 int4 mxfp4 --dtypes

`--quick` is a smoke run (8 tokens, one repeat). Writes results.json and summary.md.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from benchmarks import write_report
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.evals.serving_bench import machine
from tests.mxfp4_checkpoint import save_mxfp4
from tests.tiny_models import build_tokenizer

FORMATS = ("bf16", "int8", "int4", "mxfp4")  # --formats: the experts' weight formats motet runs


def shape(args) -> dict:
    """The model's config fields (the same for both sides)."""
    common = dict(
        vocab_size=32000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 64 // 3),
        max_position_embeddings=4096,
        num_experts_per_tok=args.top_k,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    if args.arch == "mixtral":
        return dict(common, num_local_experts=args.experts, intermediate_size=args.expert_inter)
    if args.arch == "gpt_oss":
        return dict(common, num_local_experts=args.experts, intermediate_size=args.expert_inter, head_dim=64,
                    sliding_window=128)  # fmt: skip
    if args.arch == "qwen3_moe":
        return dict(common, num_experts=args.experts, moe_intermediate_size=args.expert_inter, head_dim=64,
                    norm_topk_prob=True)  # fmt: skip
    return dict(
        common,
        num_experts=args.experts,
        moe_intermediate_size=args.expert_inter,
        intermediate_size=args.shared_inter,
        shared_expert_intermediate_size=args.shared_inter,
        norm_topk_prob=False,
    )


def build_model(args, path: Path) -> Path:
    """A random-weight checkpoint of the shape, with a small tokenizer (the engine needs one; prompts are
    token ids)."""
    torch.manual_seed(0)
    cfg_cls = {
        "mixtral": MixtralConfig,
        "qwen2_moe": Qwen2MoeConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "gpt_oss": GptOssConfig,
    }[args.arch]
    tok = build_tokenizer()
    cfg = cfg_cls(**shape(args), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def parameters(model_dir: Path) -> int:
    """The checkpoint's parameter count (read from its files' headers)."""
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118 (a safe_open is not iterable)
                total += math.prod(st.get_slice(k).get_shape())
    return total


def prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(300, 32000, (batch, length), generator=g).tolist()


def motet_decode(llm: LLM, batch: list[list[int]], tokens: int) -> tuple[float, int]:
    """(seconds, tokens) of the decode steps of `batch` (after every prompt is prefilled)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for p in batch:
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    # tokens still to come (a chunked prefill may have let the first sequences decode already)
    remaining = sum(tokens - s.num_output_tokens for s in engine.scheduler.running)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t0, remaining


def hf_decode(model, batch: list[list[int]], tokens: int) -> tuple[float, int]:
    """(seconds, tokens) of generate's decode steps: generate(tokens) minus generate(1)."""
    ids = torch.tensor(batch)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    return run(tokens) - run(1), len(batch) * (tokens - 1)


def measure(fn, repeats: int) -> dict:
    runs = [fn() for _ in range(repeats)]
    rates = [n / s for s, n in runs]
    return {"tokens_per_s": statistics.median(rates), "range": [min(rates), max(rates)]}


def motet_llm(model_dir: Path, args, b: int, dtype: str, quantization: str | None = None) -> LLM:
    """motet's offline engine for batch size b (one token a sequence a step), on the compiled CPU step."""
    llm = LLM(str(model_dir), dtype=dtype, quantization=quantization, num_threads=args.threads, max_num_seqs=b,
              block_size=16, num_kv_blocks=b * -(-(args.prompt + args.tokens) // 16) + 16,
              max_num_batched_tokens=max(512, b * args.prompt), speculative="off")  # fmt: skip
    assert llm.engine.runner.native is not None, "the compiled CPU step did not take this model"
    return llm


def compare(args, model_dir: Path, hf, dtype: str, b: int) -> dict:
    """One batch size in one dtype: motet's decode tokens/s, then Hugging Face's."""
    batch = prompts(b, args.prompt)
    llm = motet_llm(model_dir, args, b, dtype)
    motet_decode(llm, batch[:1], 4)  # warm
    motet = measure(lambda: motet_decode(llm, batch, args.tokens), args.repeats)
    llm.engine = None  # its weights and KV cache freed before Hugging Face runs
    torch.set_num_threads(args.threads)
    hf_decode(hf, batch[:1], 3)  # warm
    ref = measure(lambda: hf_decode(hf, batch, args.tokens), args.repeats)
    row = {
        "dtype": dtype,
        "batch": b,
        "motet": motet,
        "hf": ref,
        "speedup": motet["tokens_per_s"] / ref["tokens_per_s"],
    }
    print(f"{dtype} batch {b:3d}: motet {motet['tokens_per_s']:8.1f} tok/s, HF {ref['tokens_per_s']:8.1f} tok/s, "
          f"{row['speedup']:.2f}x", flush=True)  # fmt: skip
    return row


def expert_format(args, model_dir: Path, fmt: str) -> list[dict]:
    """motet alone, its experts in `fmt` (the rest of the model bf16): decode step time at each batch size (one
    engine for them all)."""
    quantization = fmt if fmt in ("int8", "int4") else None
    if fmt == "mxfp4":
        mxfp4_dir = model_dir.parent / "mxfp4"
        if not mxfp4_dir.exists():
            save_mxfp4(model_dir, mxfp4_dir)
        model_dir = mxfp4_dir
    llm = motet_llm(model_dir, args, max(args.batches), "bfloat16", quantization)
    motet_decode(llm, prompts(1, args.prompt), 4)  # warm
    rows = []
    for b in args.batches:
        batch = prompts(b, args.prompt)
        rate = measure(lambda batch=batch: motet_decode(llm, batch, args.tokens), args.repeats)
        rows.append({"format": fmt, "batch": b, "step_ms": 1000.0 * b / rate["tokens_per_s"], **rate})
        print(f"experts {fmt:5s} batch {b:3d}: {rows[-1]['step_ms']:7.2f} ms a step, "
              f"{rate['tokens_per_s']:8.1f} tok/s", flush=True)  # fmt: skip
    llm.engine = None
    return rows


def summary_md(report: dict) -> str:
    s = report["shape"]
    lines = [
        f"# MoE decode: motet (compiled CPU step) vs Hugging Face generate ({report['threads']} threads, "
        f"{report['machine']})",
        "",
        f"Model: {report['arch']}-shaped, random weights: hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, "
        f"{s['num_attention_heads']} heads / {s['num_key_value_heads']} KV heads of 64, "
        f"{report['experts']} experts of {report['expert_inter']} with top-{s['num_experts_per_tok']} routing"
        + (
            f", a shared expert of {s['shared_expert_intermediate_size']}"
            if report["arch"] == "qwen2_moe"
            else ""
        )
        + f", vocabulary {s['vocab_size']} ({report['params_m']:.0f}M parameters). Prompts of {report['prompt']} "
        f"random tokens, {report['tokens']} generated per request, greedy; median of {report['repeats']}; "
        + (
            f"Hugging Face's experts implementation: {report['hf_experts_implementation']}."
            if report["rows"]
            else ""
        ),
        "",
    ]
    if report["rows"]:
        lines += [
            "| dtype | batch | motet tok/s (min-max) | HF tok/s (min-max) | motet / HF |",
            "|---|---:|---:|---:|---:|",
        ]
    for r in report["rows"]:
        m, h = r["motet"], r["hf"]
        lines.append(
            f"| {r['dtype']} | {r['batch']} | {m['tokens_per_s']:.1f} ({m['range'][0]:.1f}-{m['range'][1]:.1f}) | "
            f"{h['tokens_per_s']:.1f} ({h['range'][0]:.1f}-{h['range'][1]:.1f}) | {r['speedup']:.2f}x |"
        )
    if report["format_rows"]:
        lines += [
            "",
            "motet alone, the experts' weight format (the rest of the model bf16; int8 / int4 quantize the attention "
            "projections and lm_head too): decode step time, a step being B tokens.",
            "",
            "| experts | batch | ms a step | tok/s (min-max) |",
            "|---|---:|---:|---:|",
        ]
    for r in report["format_rows"]:
        lines.append(
            f"| {r['format']} | {r['batch']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.1f} "
            f"({r['range'][0]:.1f}-{r['range'][1]:.1f}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--arch",
        choices=["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"],
        default="mixtral",
        help="the model's architecture",
    )
    ap.add_argument("--hidden", type=int, default=768, help="hidden size (a multiple of 64: heads of 64)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (all sparse)")
    ap.add_argument("--experts", type=int, default=8, help="experts per layer")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token")
    ap.add_argument("--expert-inter", type=int, default=2048, help="each expert's intermediate size")
    ap.add_argument("--shared-inter", type=int, default=2048, help="qwen2_moe: the shared expert's size")
    ap.add_argument(
        "--batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes (requests at once)"
    )
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per request (>= 2)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side and batch (median)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    ap.add_argument(
        "--dtypes",
        nargs="*",
        choices=["float32", "bfloat16"],
        default=["float32", "bfloat16"],
        help="the weights' dtype on both sides, each in turn (none: no comparison with Hugging Face)",
    )
    ap.add_argument(
        "--formats",
        nargs="*",
        choices=FORMATS,
        default=[],
        help="the experts' formats motet runs alone, each in turn (mxfp4: --arch gpt_oss)",
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 tokens, one repeat")
    ap.add_argument(
        "--out", default=None, help="report directory (default benchmarks/reports/moe_decode/TIME)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats = 8, 1
    if args.tokens < 2 or args.hidden % 64:
        ap.error("--tokens must be >= 2 and --hidden a multiple of 64")
    if "mxfp4" in args.formats and args.arch != "gpt_oss":
        ap.error("--formats mxfp4: MXFP4 experts are read from GPT-OSS checkpoints only (--arch gpt_oss)")
    rows, format_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args, Path(tmp) / "model")
        params_m = parameters(model_dir) / 1e6
        hf_impl = None
        for dtype in args.dtypes:
            torch.set_num_threads(args.threads)
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
            hf_impl = getattr(hf.config, "_experts_implementation", None) or "eager"
            for b in args.batches:
                rows.append(compare(args, model_dir, hf, dtype, b))
            del hf
        for fmt in args.formats:
            format_rows += expert_format(args, model_dir, fmt)
    report = {
        "arch": args.arch, "shape": shape(args), "experts": args.experts, "expert_inter": args.expert_inter,
        "params_m": params_m, "threads": args.threads, "machine": machine(),
        "prompt": args.prompt, "tokens": args.tokens, "repeats": args.repeats,
        "hf_experts_implementation": hf_impl, "rows": rows, "format_rows": format_rows,
    }  # fmt: skip
    out = Path(args.out or f"benchmarks/reports/moe_decode/{time.strftime('%Y%m%d-%H%M%S')}")
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    main()
