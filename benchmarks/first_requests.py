"""A newcomer's first requests: the README's, as written, several at once. Does every answer end, and in time?

    python -m benchmarks.first_requests [--base-url URL | --server-args "..."] [--runs 10] [--concurrency 6]
                                        [--deadline 10] [--out DIR]

Each run sends --concurrency copies at once of each of the README's requests in turn: its chat question, the same
question to the `upper` adapter the README uploads (tests/fixtures/adapters/upper), and its JSON schema request.
They carry no max_tokens and no sampling field, as the README writes them, so they get the server's defaults (the
model's generation_config.json: docs/serving.md). Against the default model of `motet serve` (a server started
here unless --base-url). For each answer: the seconds to it, its finish_reason and completion tokens. Prints a
Markdown table per request (finish reasons, answers within --deadline seconds, median and slowest seconds, most
tokens, and the first answer that did not end with "stop") and writes results.json and summary.md under --out.

Issue 57's acceptance: every answer within 10 s, 10 runs of 6 at once. Its other half, JSONSchemaBench's
truncation rate on schemas outside the eval's dev set, is `motet eval jsonschema --data
benchmarks/data/jsonschemabench_heldout.jsonl.xz` (built by benchmarks/jsonschema_heldout.py). Timings depend on
the machine and on what else it runs: compare them within one run, and read the finish reasons first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from openai import AsyncOpenAI

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
UPPER = ROOT / "tests" / "fixtures" / "adapters" / "upper"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


# The README's requests, as written there (README.md, "A short tour"), for the served model and the adapter it uploads.
def readme_requests(model: str = MODEL, adapter: str = "upper") -> dict[str, dict]:
    return {
        "chat": {"model": model, "messages": QUESTION},
        "upper adapter": {"model": adapter, "messages": QUESTION},
        "json schema": {
            "model": model,
            "messages": [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": CITY}},
        },
    }


def upload_adapter(url: str, folder: Path = UPPER, name: str = "upper") -> None:
    """The README's `curl .../v1/adapters -F name=upper -F files=@...` (an adapter already there is kept)."""
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
    r = httpx.post(f"{url}/v1/adapters", data={"name": name}, files=files, timeout=120)
    if r.status_code not in (200, 409):
        raise SystemExit(f"uploading the {name} adapter: HTTP {r.status_code} {r.text[:300]}")


async def one(client: AsyncOpenAI, body: dict) -> dict:
    start = time.monotonic()
    try:
        r = await client.chat.completions.create(**body)
    except Exception as e:  # a timeout or an error is an answer that did not come
        return {
            "seconds": time.monotonic() - start,
            "finish_reason": type(e).__name__,
            "tokens": None,
            "text": "",
        }
    choice = r.choices[0]
    return {
        "seconds": time.monotonic() - start,
        "finish_reason": choice.finish_reason,
        "tokens": r.usage.completion_tokens,
        "text": choice.message.content or "",
    }


async def measure(
    base_url: str, requests: dict[str, dict], runs: int, concurrency: int, timeout: float
) -> dict[str, list[dict]]:
    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout)
    answers: dict[str, list[dict]] = {name: [] for name in requests}
    for run in range(runs):
        for name, body in requests.items():
            got = await asyncio.gather(*(one(client, body) for _ in range(concurrency)))
            answers[name] += got
            print(
                f"run {run + 1}/{runs} {name}: " + ", ".join(f"{a['seconds']:.1f} s" for a in got),
                file=sys.stderr,
            )
    return answers


def summary(answers: dict[str, list[dict]], deadline: float) -> tuple[dict, str]:
    rows, out = [], {}
    for name, got in answers.items():
        seconds = [a["seconds"] for a in got]
        tokens = [a["tokens"] for a in got if a["tokens"] is not None]
        unended = next((a for a in got if a["finish_reason"] != "stop"), None)
        out[name] = {
            "answers": len(got),
            "finish_reasons": dict(Counter(a["finish_reason"] for a in got)),
            "within_deadline": sum(s <= deadline for s in seconds),
            "median_s": statistics.median(seconds),
            "max_s": max(seconds),
            "max_tokens": max(tokens, default=None),
            "first_unended": unended and unended["text"][:120],
        }
        o = out[name]
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(o["finish_reasons"].items()))
        rows.append(
            f"| {name} | {reasons} | {o['within_deadline']}/{o['answers']} | {o['median_s']:.1f} | {o['max_s']:.1f} "
            f"| {o['max_tokens']} | {json.dumps(o['first_unended'] or '', ensure_ascii=False)} |"
        )
    table = "\n".join(
        [
            f"| request | finish reasons | within {deadline:g} s | median s | slowest s | most tokens | an answer that did not stop |",
            "|---|---|---:|---:|---:|---:|---|",
            *rows,
        ]
    )
    return out, table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--base-url", default=None, help="a running server's root (default: start `motet serve` here)"
    )
    p.add_argument("--server-args", default="", help="flags of the server started here")
    p.add_argument("--model", default=MODEL, help="the served model's name the requests give")
    p.add_argument(
        "--adapter", type=Path, default=UPPER, help="the adapter uploaded as `upper` (the README's)"
    )
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--deadline", type=float, default=10.0, help="seconds an answer should take at most")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds the client waits for an answer")
    p.add_argument(
        "--out", type=Path, default=ROOT / "reports" / "first_requests" / time.strftime("%Y%m%d-%H%M%S")
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def run(url: str) -> dict:
        upload_adapter(url, args.adapter)
        requests = readme_requests(args.model)
        return asyncio.run(measure(f"{url}/v1", requests, args.runs, args.concurrency, args.timeout))

    if args.base_url:
        answers = run(args.base_url.rstrip("/").removesuffix("/v1"))
    else:
        from motet.evals.server import ManagedServer

        with ManagedServer(shlex.split(args.server_args), log_path=args.out / "server.log") as srv:
            answers = run(srv.url)
    results, table = summary(answers, args.deadline)
    head = (
        f"`python -m benchmarks.first_requests {' '.join(argv if argv is not None else sys.argv[1:])}`: "
        f"{args.runs} runs, {args.concurrency} copies of each request at once, {time.strftime('%Y-%m-%d %H:%M')}"
    )
    (args.out / "results.json").write_text(
        json.dumps(
            {"config": vars(args) | {"out": str(args.out)}, "requests": results, "answers": answers},
            indent=1,
            default=str,
        )
    )
    (args.out / "summary.md").write_text(f"{head}\n\n{table}\n")
    print(f"{head}\n\n{table}\n\nreport: {args.out}")


if __name__ == "__main__":
    main()
