"""GPU benchmarks (one CUDA device): the Triton kernels against their torch references and against the HBM
bandwidth roofline, the engine's decode against HF transformers `generate` on the same GPU, and greedy
equality of the two. Writes gpu_bench.json and gpu_bench.md into --out.

    python -m benchmarks.gpu_bench --model-dir DIR --out OUT [--quick]

DIR is a Hugging Face checkpoint directory (scripts/gpu/run.sh builds SmolLM2-135M-Instruct's architecture
with random weights there when the real weights cannot travel: decode speed does not depend on the values,
and equality with HF holds for any weights).
"""

# ruff: noqa: B023  (the timed lambdas run before the loop moves on)
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import write_report
from benchmarks.gpu_common import motet_engine, prompts

HBM_BYTES_PER_S = 3.35e12  # H100 SXM's specified bandwidth (a device-to-device copy measured ~3.0e12 here)


def cuda_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def sgmv_case(tokens: int, rank: int, n: int, dev: str = "cuda", dt: torch.dtype = torch.bfloat16) -> dict:
    """n rank-`rank` adapters on SmolLM2-135M's gate/up (hidden 576 -> 2 x 1536) packed into an AdapterPool
    (motet/lora/pool.py), `tokens` rows cut into n equal segments, one adapter each: add_lora's arguments."""
    from types import SimpleNamespace

    from motet.lora.adapter import LoRAAdapter
    from motet.lora.pool import AdapterPool, PoolLayout, pack

    shape = SimpleNamespace(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    )  # fmt: skip
    layout = PoolLayout(shape)
    pool = AdapterPool(layout, 1 << 30, dev, dt, max_slots=max(n, 8))
    for i in range(n):
        weights = {
            (0, m): (torch.randn(rank, 576) / 576**0.5, torch.randn(1536, rank) * 0.01, 2.0)
            for m in ("gate_proj", "up_proj")
        }
        pool.place(i, pack(LoRAAdapter(f"a{i}", rank, weights), layout, dt), lambda u: False)
    bounds = [round(i * tokens / n) for i in range(n + 1)]
    geo = layout.groups[2]
    return dict(
        x=torch.randn(tokens, 576, device=dev, dtype=dt),
        y=torch.zeros(tokens, 3072, device=dev, dtype=dt),
        pool=pool.data,
        desc=pool.desc,
        seg_starts=torch.tensor(bounds, device=dev, dtype=torch.int32),
        seg_slots=torch.tensor([pool.slot_of[i] for i in range(n)], device=dev, dtype=torch.int32),
        kw=dict(group=2, layer=0, a_ld=geo.a_ld, bt_ld=geo.bt_ld),
        max_rank=rank,
        max_seg_len=max(b - a for a, b in zip(bounds, bounds[1:], strict=False)),
        # bytes each kernel must move at least: x, the adapters' A (2 modules), h (fp32); h, BT, y read+write
        bytes_shrink=tokens * 576 * 2 + n * 2 * rank * 576 * 2 + tokens * 2 * rank * 4,
        bytes_expand=tokens * 2 * rank * 4 + n * 2 * rank * 1536 * 2 + 2 * tokens * 3072 * 2,
    )


def sgmv_calls(c: dict):
    """(shrink, expand, reference) of a case, as argument-less callables (shrink writes h, expand reads it)."""
    from motet.kernels import sgmv

    args = (c["pool"], c["desc"], c["seg_starts"], c["seg_slots"])
    kw = {**c["kw"], "max_rank": c["max_rank"], "max_seg_len": c["max_seg_len"]}
    h = torch.empty(c["x"].shape[0], 2 * c["max_rank"], dtype=torch.float32, device=c["x"].device)
    sizes = (1536, 1536)
    return (
        lambda: sgmv.sgmv_shrink_triton(c["x"], *args, out=h, **kw),
        lambda: sgmv.sgmv_expand_triton(h, *args, c["y"], sizes=sizes, **kw),
        lambda: sgmv.lora_delta_reference(c["x"], *args, sizes=sizes, **c["kw"]),
    )


def bench_sgmv(quick: bool) -> list[dict]:
    from motet.kernels import sgmv

    rows = []
    for tokens in (1, 8, 64, 256):
        for rank in (8, 16, 64) if not quick else (16,):
            for n in (1, 8, 64) if not quick else (1, 8):
                if n > tokens:
                    continue
                c = sgmv_case(tokens, rank, n)
                shrink, expand, reference = sgmv_calls(c)
                shrink()
                width = 2 * rank
                ref_h = sgmv.sgmv_shrink_reference(
                    c["x"], c["pool"], c["desc"], c["seg_starts"], c["seg_slots"], width=width, **c["kw"]
                )
                h = sgmv.sgmv_shrink_triton(
                    c["x"], c["pool"], c["desc"], c["seg_starts"], c["seg_slots"], max_rank=rank, **c["kw"]
                )
                err = (h - ref_h).abs().max().item()
                t_shrink, t_expand = cuda_ms(shrink), cuda_ms(expand)
                t_ref = cuda_ms(reference, iters=10)
                rows.append(
                    {
                        "tokens": tokens,
                        "rank": rank,
                        "adapters": n,
                        "shrink_us": 1e3 * t_shrink,
                        "expand_us": 1e3 * t_expand,
                        "torch_reference_us": 1e3 * t_ref,
                        "speedup_vs_reference": t_ref / (t_shrink + t_expand),
                        "shrink_roofline": c["bytes_shrink"] / (t_shrink * 1e-3) / HBM_BYTES_PER_S,
                        "expand_roofline": c["bytes_expand"] / (t_expand * 1e-3) / HBM_BYTES_PER_S,
                        "max_abs_err_shrink": err,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_paged_attention(quick: bool) -> list[dict]:
    from motet.kernels import paged_attention as pa
    from motet.kernels.attention_args import AttentionOptions, PagedContext
    from motet.kernels.paged_attention_cpu import paged_attention_reference

    rows, dev, dt = [], "cuda", torch.bfloat16
    heads, kv_heads, head_dim, block = 9, 3, 64, 16  # SmolLM2-135M's attention
    for batch in (1, 8, 64, 256):
        for ctx in (512, 2048) if not quick else (512,):
            blocks_per = ctx // block
            num_blocks = batch * blocks_per
            k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, device=dev, dtype=dt)
            v_cache = torch.randn_like(k_cache)
            tables = torch.arange(num_blocks, device=dev, dtype=torch.int32).view(batch, blocks_per)
            q = torch.randn(batch, heads, head_dim, device=dev, dtype=dt)
            qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
            lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
            kv, options = (k_cache, v_cache), AttentionOptions(head_dim**-0.5)
            # a new context each call: the reference makes its plan each time, as before contexts kept it
            paged = lambda: PagedContext(tables, qsl, lens, max_query_len=1, max_seq_len=ctx)  # noqa: B023
            out = pa.paged_attention_triton(q, kv, paged(), options)
            ref = paged_attention_reference(q, kv, paged(), options)
            err = (out.float() - ref.float()).abs().max().item()
            t = cuda_ms(lambda: pa.paged_attention_triton(q, kv, paged(), options))  # noqa: B023
            t_ref = cuda_ms(lambda: paged_attention_reference(q, kv, paged(), options), iters=5)  # noqa: B023
            kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2
            rows.append(
                {
                    "batch": batch,
                    "context": ctx,
                    "triton_us": 1e3 * t,
                    "torch_reference_us": 1e3 * t_ref,
                    "speedup_vs_reference": t_ref / t,
                    "roofline": kv_bytes / (t * 1e-3) / HBM_BYTES_PER_S,
                    "max_abs_err": err,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def engine_decode(model_dir: Path, batch: int, new_tokens: int, adapters: int, dtype: str) -> dict:
    from motet.engine.sampling_params import SamplingParams

    tmp = tempfile.TemporaryDirectory()
    engine, names = motet_engine(model_dir, Path(tmp.name), batch=batch, adapters=adapters, dtype=dtype,
                                 device="cuda", num_kv_blocks=batch * 8 + 64,
                                 max_num_batched_tokens=max(batch * 32, 256))  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts(batch)):
        engine.add_request(p, params, adapter=names[i % adapters] if adapters else None)
    decode_s, decode_steps, warmed = 0.0, 0, False
    while engine.has_unfinished():
        batch_ = engine.schedule()
        torch.cuda.synchronize()
        t = time.perf_counter()
        result = engine.execute(batch_)
        torch.cuda.synchronize()
        if all(n == 1 for n in batch_.num_new_tokens) and len(batch_) == batch:
            if warmed:  # the first full decode step compiles the kernels and captures the graphs
                decode_s += time.perf_counter() - t
                decode_steps += 1
            warmed = True
        engine.commit(batch_, result)
    step_ms = 1e3 * decode_s / max(decode_steps, 1)
    return {
        "batch": batch,
        "adapters": adapters,
        "decode_step_ms": step_ms,
        "tokens_per_s": batch / step_ms * 1e3,
    }


def hf_decode(model_dir: Path, batch: int, new_tokens: int) -> dict:
    """HF transformers `generate` on the same GPU in bf16: `batch` prompts, `new_tokens` greedy tokens each,
    timed after a short warm-up run."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts(batch), device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    return {"batch": batch, "tokens_per_s": batch * new_tokens / seconds}


def greedy_equality(model_dir: Path, new_tokens: int = 24) -> dict:
    from transformers import AutoModelForCausalLM

    from motet.engine.llm import LLM
    from motet.engine.sampling_params import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    prompt_ids = prompts(6, 20)
    llm = LLM(str(model_dir), device="cuda", num_kv_blocks=256)
    ours = [
        o.token_ids
        for o in llm.generate(
            prompt_ids, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        )
    ]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda().eval()
    same = 0
    for p, got in zip(prompt_ids, ours, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, len(p):].tolist()  # fmt: skip
        same += ref == got
    return {"prompts": len(prompt_ids), "identical": same}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    report["greedy_vs_hf_fp32"] = greedy_equality(args.model_dir)
    print(report["greedy_vs_hf_fp32"], flush=True)
    report["sgmv"] = bench_sgmv(args.quick)
    report["paged_attention"] = bench_paged_attention(args.quick)
    decode = []
    for batch in (1, 8, 64, 256):
        for adapters in (0, 8, 32):
            if adapters > batch:
                continue
            row = engine_decode(args.model_dir, batch, args.new_tokens, adapters, "bfloat16")
            if adapters == 0:
                row["hf_tokens_per_s"] = hf_decode(args.model_dir, batch, args.new_tokens)["tokens_per_s"]
                row["motet_over_hf"] = row["tokens_per_s"] / row["hf_tokens_per_s"]
            decode.append(row)
            print(json.dumps(row), flush=True)
    weight_bytes = 2 * sum(math.prod(shape) for shape in _param_shapes(args.model_dir))  # bf16
    b1 = next(r for r in decode if r["batch"] == 1 and r["adapters"] == 0)
    report["decode"] = decode
    report["batch1_weight_roofline"] = weight_bytes / (b1["decode_step_ms"] * 1e-3) / HBM_BYTES_PER_S
    write_report(args.out, report, markdown(report), name="gpu_bench")


def _param_shapes(model_dir: Path):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return [f.get_slice(k).get_shape() for k in f.keys()]  # noqa: SIM118


def markdown(r: dict) -> str:
    g = r["greedy_vs_hf_fp32"]
    lines = [f"# GPU benchmarks on {r['device']} (torch {r['torch']})", "",
             f"Greedy, fp32, engine vs HF generate on the same GPU: {g['identical']}/{g['prompts']} identical.", "",
             f"Batch-1 bf16 decode: {r['batch1_weight_roofline']:.1%} of the HBM roofline (weights read per step).", "",
             "| batch | adapters | motet tok/s | step ms | HF tok/s | motet/HF |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for d in r["decode"]:
        hf = f"{d['hf_tokens_per_s']:.0f} | {d['motet_over_hf']:.2f}x" if "hf_tokens_per_s" in d else " | "
        lines.append(
            f"| {d['batch']} | {d['adapters']} | {d['tokens_per_s']:.0f} | {d['decode_step_ms']:.2f} | {hf} |"
        )
    lines += ["", "| tokens | rank | adapters | shrink us | expand us | torch ref us | x ref | shrink/expand roofline |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for s in r["sgmv"]:
        lines.append(f"| {s['tokens']} | {s['rank']} | {s['adapters']} | {s['shrink_us']:.1f} | {s['expand_us']:.1f} | "
                     f"{s['torch_reference_us']:.1f} | {s['speedup_vs_reference']:.1f} | {s['shrink_roofline']:.1%} / {s['expand_roofline']:.1%} |")  # fmt: skip
    lines += [
        "",
        "| batch | context | triton us | torch ref us | x ref | roofline | max err |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in r["paged_attention"]:
        lines.append(f"| {a['batch']} | {a['context']} | {a['triton_us']:.1f} | {a['torch_reference_us']:.1f} | "
                     f"{a['speedup_vs_reference']:.1f} | {a['roofline']:.1%} | {a['max_abs_err']:.1e} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
