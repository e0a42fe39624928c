"""Serving benchmark: a load generator on loopback against `motet serve` (or any OpenAI-compatible server).

Requests arrive as a Poisson process (--request-rate per second; inf: all at once) and at most
--concurrency are in flight. Each request streams a completion with a fixed output length (ignore_eos),
so runs are comparable. Reported per concurrency level: TTFT, TPOT (per output token after the first),
inter-token latency (between streamed chunks) and end-to-end latency percentiles, request and token
throughput, and goodput (requests per second that met the TTFT and TPOT targets, when given). Writes
JSON and Markdown. The pieces here (one streamed request, one level, its summary) are also what
`motet eval serving` (motet/evals/suites/serving.py) runs on.

    python -m motet.evals.serving_bench --concurrency 1 16 64                # starts a server itself
    python -m motet.evals.serving_bench --url http://127.0.0.1:8000 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from motet.evals.report import table as report_table

TEXT = (
    "the model serves many tenants with adapters and grammars on a paged cache while the scheduler "
    "keeps every step full of tokens from prompts and decodes alike so latency stays low and fair"
)


@dataclass
class Record:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None with fewer than two tokens)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def make_prompts(n: int, mean_words: int, seed: int) -> list[str]:
    rng, words = random.Random(seed), TEXT.split()
    return [
        " ".join(rng.choice(words) for _ in range(max(4, int(rng.gauss(mean_words, mean_words / 4)))))
        for _ in range(n)
    ]


# Greedy as the request writes it, whatever a server's defaults (the default model's generation config carries a
# frequency penalty, which vLLM's and llama.cpp's servers would not apply): every peer does the same work.
GREEDY = {"temperature": 0, "frequency_penalty": 0, "presence_penalty": 0}


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    """A streamed /v1/completions body with a fixed output length."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, **GREEDY, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


def _has_output(choice: dict) -> bool:
    """Whether a completions chunk (`text`) or a chat chunk (`delta`) carries generated output."""
    delta = choice.get("delta") or {}
    return bool(
        choice.get("text")
        or delta.get("content")
        or delta.get("reasoning_content")
        or delta.get("tool_calls")
    )


async def one_request(client: httpx.AsyncClient, path: str, body: dict) -> Record:
    """POST a streaming request (`/completions` or `/chat/completions`) and time its chunks."""
    rec = Record()
    t0 = time.perf_counter()
    last = None
    try:
        for attempt in range(2):
            try:
                r = await client.send(client.build_request("POST", path, json=body), stream=True)
                break
            except httpx.RemoteProtocolError:  # a pooled connection the server had just closed: retry once,
                if attempt:  # as clients do (the request never reached the server)
                    raise
        try:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("error"):
                    rec.error = chunk["error"]["message"]
                    return rec
                if not chunk.get("choices") or not _has_output(chunk["choices"][0]):
                    continue
                if last is None:
                    rec.ttft = now - t0
                else:
                    rec.itls.append(now - last)
                last = now
        finally:
            await r.aclose()
        rec.e2e = time.perf_counter() - t0
        rec.ok = rec.output_tokens > 0
        if not rec.ok:
            rec.error = "no output tokens reported (usage missing or empty)"
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_level(
    url: str,
    requests: list[tuple[str, dict]],
    concurrency: int,
    rate: float = math.inf,
    seed: int = 0,
    headers: dict | None = None,
    on_done: Callable[[Record], None] | None = None,
) -> tuple[list[Record], float]:
    """Send (path, body) requests with Poisson arrivals at `rate`/s, at most `concurrency` in flight."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits, headers=headers) as client:

        async def gated(path, body):
            async with sem:
                rec = await one_request(client, path, body)
            if on_done is not None:
                on_done(rec)
            return rec

        tasks = []
        t0 = time.perf_counter()
        for path, body in requests:
            tasks.append(asyncio.create_task(gated(path, body)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        records = await asyncio.gather(*tasks)
        return records, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def stats(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs) if xs else float("nan"), "p50": pct(xs, 0.5), "p90": pct(xs, 0.9),
            "p99": pct(xs, 0.99)}  # fmt: skip


def meets_slo(r: Record, ttft_slo: float | None, tpot_slo: float | None) -> bool:
    if not r.ok:
        return False
    if ttft_slo is not None and r.ttft > ttft_slo:
        return False
    return tpot_slo is None or r.tpot is None or r.tpot <= tpot_slo


def summarize(
    records: list[Record],
    duration: float,
    concurrency: int,
    ttft_slo: float | None = None,
    tpot_slo: float | None = None,
) -> dict:
    ok = [r for r in records if r.ok]
    good = [r for r in records if meets_slo(r, ttft_slo, tpot_slo)]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": len(good) / duration,  # requests per second that met the targets
        "slo_attainment": len(good) / len(records) if records else float("nan"),
        "ttft_s": stats([r.ttft for r in ok]),
        # Records in the order sent: the first `concurrency` go together, each later one as one before it ends
        # (with --request-rate inf, a closed loop): a wave's tail and the rounds after it queue differently.
        "ttft_by_round_s": {
            "first": stats([r.ttft for r in records[:concurrency] if r.ok]),
            "later": stats([r.ttft for r in records[concurrency:] if r.ok]),
        },
        "tpot_s": stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": stats([x for r in ok for x in r.itls]),
        "e2e_s": stats([r.e2e for r in ok]),
    }


def markdown(report: dict) -> str:
    cfg = report["config"]
    rows = [
        [r["concurrency"], f"{r['completed']}/{r['requests']}", f"{r['request_throughput']:.2f}",
         f"{r['output_token_throughput']:.1f}", f"{r['ttft_s']['p50']:.2f} / {r['ttft_s']['p99']:.2f}",
         f"{1e3 * r['tpot_s']['p50']:.0f} / {1e3 * r['tpot_s']['p99']:.0f}",
         f"{1e3 * r['itl_s']['p50']:.0f} / {1e3 * r['itl_s']['p99']:.0f}",
         f"{r['e2e_s']['p50']:.2f} / {r['e2e_s']['p99']:.2f}"]
        for r in report["levels"]
    ]  # fmt: skip
    header = ["clients", "done/sent", "req/s", "out tok/s", "TTFT p50 / p99 (s)", "TPOT p50 / p99 (ms)",
              "ITL p50 / p99 (ms)", "E2E p50 / p99 (s)"]  # fmt: skip
    intro = (
        f"Model `{cfg['model']}` at {cfg['url']}; {cfg['max_tokens']} output tokens per request (ignore_eos), "
        f"prompts of ~{cfg['prompt_words']} words, request rate {cfg['request_rate']}/s (Poisson)."
    )
    table = report_table(header, rows, "r" * len(header))
    return "\n".join(["# Serving benchmark", "", intro, "", table, "", f"Machine: {report['machine']}", ""])


def machine() -> str:
    return (
        f"{os.cpu_count()} CPUs, {sys.platform}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
    )


def write_report(out: Path, name: str, report: dict, text: str) -> None:
    """NAME-TIME.json and .md under `out`, and the markdown printed."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"{name}-{stamp}.json").write_text(json.dumps(report, indent=2))
    (out / f"{name}-{stamp}.md").write_text(text)
    print(text)


def main(argv=None) -> int:
    from motet.evals.server import ManagedServer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--url", default=None, help="a running server; default: start `motet serve` on a free port"
    )
    p.add_argument(
        "--model", default=None, help="the model name sent in requests (default: the server's first)"
    )
    p.add_argument("--model-path", default=None, help="--model for the server this script starts")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--num-prompts", type=int, default=None, help="per level (default: max(8, 2 x clients))")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="benchmarks/reports")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed to `motet serve`")
    args = p.parse_args(argv)

    server = None
    if args.url is None:
        server_args = ["--max-num-seqs", str(max(args.concurrency)), *args.server_args]
        server = ManagedServer(server_args, model=args.model_path).start()
    url = args.url or server.url
    try:
        if args.model is None:  # the model the server serves (GET /v1/models), not a name it may not know
            args.model = httpx.get(f"{url}/v1/models", timeout=30).raise_for_status().json()["data"][0]["id"]
        warm = [("/v1/completions", completion_body(args.model, p, 4)) for p in make_prompts(2, 8, 1)]
        asyncio.run(run_level(url, warm, 2))
        levels = []
        for c in args.concurrency:
            n = args.num_prompts or max(8, 2 * c)
            prompts = make_prompts(n, args.prompt_words, args.seed + c)
            requests = [("/v1/completions", completion_body(args.model, p, args.max_tokens)) for p in prompts]
            records, duration = asyncio.run(run_level(url, requests, c, args.request_rate, args.seed))
            summary = summarize(records, duration, c)
            levels.append(summary)
            print(
                f"clients={c:3d} done={summary['completed']}/{n} {summary['output_token_throughput']:.1f} tok/s "
                f"TTFT p50={summary['ttft_s']['p50']:.2f}s TPOT p50={1e3 * summary['tpot_s']['p50']:.0f}ms "
                f"E2E p50={summary['e2e_s']['p50']:.2f}s",
                flush=True,
            )
    finally:
        if server is not None:
            server.stop(60)

    report = {
        "config": {
            "url": url,
            "model": args.model,
            "max_tokens": args.max_tokens,
            "prompt_words": args.prompt_words,
            "request_rate": args.request_rate,
            "seed": args.seed,
        },
        "machine": machine(),
        "levels": levels,
    }
    write_report(Path(args.output_dir), "serving_bench", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
