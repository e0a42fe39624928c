"""Tensor parallelism on this machine: decode tokens/s over two gloo ranks against one rank at the same total
threads, and the bytes the ranks exchange per token against the theoretical minimum.

    python -m benchmarks.tensor_parallel [--model M] [--dtype float32] [--batches 1 8 32] [--tokens 64]
                                         [--threads 2] [--repeats 3] [--out DIR]

One rank runs --threads threads; TP=2 runs --threads / 2 on each rank (the engine's runner and one worker
process). Each side serves the same greedy requests offline (speculation off: one token per row per step):
B requests with distinct 32-token prompts, --tokens new tokens each; decode time is what the steps after
every request's first token take (prefill excluded), the median of --repeats. Both sides' outputs are
compared token for token.

Bytes per token: (a) the payload rank 0 hands to collectives (Parallel.sent_bytes: the embedding's and each
block's all-reduce, its share of the logits' gather) and (b) everything sent over the loopback interface
while decoding (/sys/class/net/lo/statistics/tx_bytes: both ranks, the plans' broadcasts, TCP framing; run it
on a quiet machine, since other loopback traffic counts too), each over the tokens decoded; against the
minimum a Megatron split must move: per token and rank, 2 all-reduces per layer plus the embedding's of a
hidden-sized fp32 row, each 2 (p-1)/p of its size for a ring all-reduce, plus the (p-1)/p of the vocabulary's
fp32 logits the other ranks send to rank 0. Writes results.json and summary.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks import write_report
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.evals.serving_bench import machine

LO_TX = Path("/sys/class/net/lo/statistics/tx_bytes")


def lo_bytes() -> int:
    return int(LO_TX.read_text()) if LO_TX.exists() else 0


def decode(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]], int, int, int]:
    """(decode seconds, outputs, rank 0's collective bytes, loopback bytes, tokens decoded in that time) for
    one batch of requests (the window starts once every request has its first token; a request whose
    prompt finished earlier may have decoded a few tokens before it: those are not counted)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while any(not out[i] for i in ids):  # prefill: until every request has its first token
        for o in engine.step():
            out[o.request_id] += o.token_ids
    par = engine.runner.parallel
    before = sum(len(v) for v in out.values())
    sent0, lo0, t0 = par.sent_bytes, lo_bytes(), time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    seconds = time.perf_counter() - t0
    decoded = sum(len(v) for v in out.values()) - before
    return seconds, [out[i] for i in ids], par.sent_bytes - sent0, lo_bytes() - lo0, decoded


def minimum_bytes(cfg, p: int) -> float:
    """Bytes all ranks together must send per decoded token (fp32 activations and logits)."""
    row = cfg.hidden_size * 4
    all_reduces = (2 * cfg.num_hidden_layers + 1) * row * 2 * (p - 1) / p  # per rank
    return p * all_reduces + (p - 1) / p * cfg.vocab_size * 4


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="both sides on the eager model")
    ap.add_argument(
        "--out", type=Path, default=Path("benchmarks/reports/tensor_parallel") / time.strftime("%Y-%m-%d")
    )
    args = ap.parse_args(argv)

    sides = {"tp1": (1, args.threads), "tp2": (2, max(1, args.threads // 2))}
    results: dict[str, dict] = {}
    outputs: dict[str, dict[int, list]] = {}
    cfg = None
    for name, (tp, threads) in sides.items():
        with LLM(
            args.model,
            dtype=args.dtype,
            tensor_parallel_size=tp,
            num_threads=threads,
            speculative="off",
            max_num_seqs=max(args.batches),
            num_kv_blocks=max(args.batches) * (-(-(32 + args.tokens) // 16) + 1) + 8,
            compile_step=not args.no_compile,
        ) as llm:
            cfg = llm.engine.model_config
            path = "native" if llm.engine.runner.native is not None else "eager"
            tok = llm.tokenizer
            base = tok.encode("The history of the printing press begins with movable type in East Asia and")
            decode(llm, [base[:8]], 4)  # warm-up
            results[name] = {"tensor_parallel_size": tp, "threads_per_rank": threads, "path": path}
            outputs[name] = {}
            for B in args.batches:
                prompts = [([i + 10] + base * 4)[:32] for i in range(B)]
                runs = [decode(llm, prompts, args.tokens) for _ in range(args.repeats)]
                rates = [r[4] / r[0] for r in runs]
                results[name][B] = {
                    "decode_tok_s": statistics.median(rates),
                    "decode_tok_s_runs": rates,
                    "rank0_collective_bytes_per_token": statistics.median(r[2] / r[4] for r in runs),
                    "loopback_bytes_per_token": statistics.median(r[3] / r[4] for r in runs),
                }
                outputs[name][B] = runs[0][1]
                print(name, B, results[name][B], flush=True)

    floor = minimum_bytes(cfg, 2)
    lines = [
        f"# Tensor parallelism: {args.model} ({args.dtype}), TP=2 vs TP=1 at {args.threads} threads in all",
        "",
        f"machine: {machine()}; decode of {args.tokens} tokens per request after 32-token prompts, greedy, "
        f"speculation off, median of {args.repeats}; TP=1 on the {results['tp1']['path']} path, TP=2 on the "
        f"{results['tp2']['path']} path",
        "",
        "| batch | TP=1 tok/s (runs) | TP=2 tok/s (runs) | TP=2 / TP=1 | same tokens | rank-0 payload B/token | "
        "loopback B/token | minimum B/token | loopback / minimum |",
        "|---:|---:|---:|---:|:-:|---:|---:|---:|---:|",
    ]
    for B in args.batches:
        one, two = results["tp1"][B], results["tp2"][B]
        same = outputs["tp1"][B] == outputs["tp2"][B]
        two["same_tokens_as_tp1"] = same
        lines.append(
            f"| {B} | {one['decode_tok_s']:.1f} ({min(one['decode_tok_s_runs']):.1f}-{max(one['decode_tok_s_runs']):.1f}) | "
            f"{two['decode_tok_s']:.1f} ({min(two['decode_tok_s_runs']):.1f}-{max(two['decode_tok_s_runs']):.1f}) | "
            f"{two['decode_tok_s'] / one['decode_tok_s']:.2f} | {'yes' if same else 'no'} | "
            f"{two['rank0_collective_bytes_per_token']:,.0f} | {two['loopback_bytes_per_token']:,.0f} | "
            f"{floor:,.0f} | {two['loopback_bytes_per_token'] / floor:.2f} |"
        )
    lines += [
        "",
        "minimum: (2 layers' all-reduces + the embedding's) x hidden x 4 B x 2(p-1)/p per rank, both ranks, plus "
        "(p-1)/p of the vocabulary's fp32 logits to rank 0 (bf16 activations would halve the first part).",
    ]
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine(),
        "minimum_bytes_per_token": floor,
    }
    report["results"] = results
    write_report(args.out, report, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
