"""What request tracing costs the served throughput: one `motet serve` without and one with
`--otlp-traces-endpoint` (exporting to a real OTLP/HTTP receiver in this process), the same mixed load on each
(streamed chat requests, a quarter with a JSON schema), --rounds rounds alternating which goes first.

Reported: output tokens/s with tracing on against off per round, their median and range (target: within 3%),
and the spans the receiver got (a request span and its children per request).

    python -m benchmarks.tracing_overhead
    python -m benchmarks.tracing_overhead --rounds 4 --requests 256

Writes tracing_overhead-TIME.json and .md under --output-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

from motet.evals.otlp_receiver import OTLPReceiver
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import machine, make_prompts, run_level, summarize, write_report

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
}


def requests(model: str, args) -> list[tuple[str, dict]]:
    out = []
    for i, prompt in enumerate(make_prompts(args.requests, args.prompt_words, args.seed)):
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        if i % 4 == 1:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        out.append(("/v1/chat/completions", body))
    return out


def one_run(traced: bool, receiver: OTLPReceiver, args) -> dict:
    server_args = ["--otlp-traces-endpoint", receiver.url] if traced else []
    server = ManagedServer([*server_args, *args.server_args], model=args.model_path).start()
    try:
        warm = requests(args.model, argparse.Namespace(**{**vars(args), "requests": 8}))
        asyncio.run(run_level(server.url, warm, 8))
        records, seconds = asyncio.run(run_level(server.url, requests(args.model, args), args.concurrency))
    finally:
        server.stop(120)  # the exporter sends what it still holds as the server stops
    return summarize(records, seconds, args.concurrency)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="the model name sent in requests")
    p.add_argument("--model-path", default=None, help="--model for the servers this script starts")
    p.add_argument("--requests", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="benchmarks/reports/tracing_overhead")
    p.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="passed to both `motet serve`s"
    )
    args = p.parse_args(argv)

    receiver = OTLPReceiver()
    rounds = []
    try:
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            runs = {}
            for traced in order:
                before = len(receiver.spans)
                runs[traced] = one_run(traced, receiver, args)
                runs[traced]["spans"] = len(receiver.spans) - before
                print(f"round {r} traced={traced}: {runs[traced]['output_token_throughput']:.1f} tok/s, "
                      f"{runs[traced]['spans']} spans", flush=True)  # fmt: skip
            on, off = runs[True]["output_token_throughput"], runs[False]["output_token_throughput"]
            rounds.append({"off": runs[False], "on": runs[True], "ratio": on / off})
    finally:
        receiver.shutdown()

    ratios = [r["ratio"] for r in rounds]
    report = {
        "config": {k: v for k, v in vars(args).items() if k != "output_dir"},
        "machine": machine(),
        "rounds": rounds,
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
    }
    write_report(Path(args.output_dir), "tracing_overhead", report, markdown(report))
    return 0


def markdown(report: dict) -> str:
    cfg, ratio = report["config"], report["ratio"]
    lines = [
        "# Tracing overhead",
        "",
        f"{cfg['requests']} chat requests ({cfg['max_tokens']} output tokens, streamed, a quarter with a JSON schema) at concurrency {cfg['concurrency']}, on a server without and one with `--otlp-traces-endpoint` "
        f"(a real OTLP/HTTP receiver); {cfg['rounds']} rounds, alternating which runs first. {report['machine']}.",
        "",
        "| round | off tok/s | on tok/s | on / off | spans exported (on) | failed (off / on) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for i, r in enumerate(report["rounds"]):
        lines.append(
            f"| {i} | {r['off']['output_token_throughput']:.1f} | {r['on']['output_token_throughput']:.1f} | "
            f"{r['ratio']:.3f} | {r['on']['spans']} | {r['off']['failed']} / {r['on']['failed']} |"
        )
    lines += [
        "",
        f"Tracing on / off: **{ratio['median']:.3f}** (median; range {ratio['min']:.3f}-{ratio['max']:.3f}). "
        "Target: within 3% (>= 0.97).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
