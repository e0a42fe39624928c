"""Fairness between tenants, served: a light tenant's latency under another's burst, and two backlogged
tenants' shares, on one `motet serve` with three API keys (tenants `eval-suite`, `interactive`, `batch`).

Phase 1, a burst: `interactive` first sends --light-alone 16-token chat requests one at a time on the idle
server (its TTFT alone); then `eval-suite` fires --burst chat requests at once, and while they run,
`interactive` keeps sending its 16-token requests one at a time (--light-gap seconds apart). Reported:
`interactive`'s TTFT p50/p99 under the burst against alone, and the burst's duration. Target: p99 <= 2 s.

Phase 2, two backlogged tenants of equal weight: `eval-suite` and `batch` each keep --backlog-clients chat
requests in flight (more than the server runs at once), `batch` starting --backlog-stagger seconds after
`eval-suite` (which has the whole server by then), for --backlog-seconds. Output tokens are counted as they
stream (chat logprobs: one entry per token) over the window where both are backlogged, after a warm-up.
Reported: each tenant's output tokens/s and their ratio. Target: within 10% of each other.

    python -m benchmarks.tenant_fairness                                  # the full measurement
    python -m benchmarks.tenant_fairness --burst 32 --backlog-seconds 20  # a quick check
    python -m benchmarks.tenant_fairness --server-args --num-kv-blocks 96 # a small KV cache

Writes tenant_fairness-TIME.json and .md under --output-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from motet.evals.server import ManagedServer
from motet.evals.serving_bench import Record, machine, make_prompts, one_request, stats, write_report

TENANTS = {"sk-eval-suite": "eval-suite", "sk-interactive": "interactive", "sk-batch": "batch"}
KEY = {tenant: key for key, tenant in TENANTS.items()}
LIGHT_QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "How many legs has a spider?",
                   "What do bees make?", "Which planet is the largest?", "What is frozen water called?"]  # fmt: skip


def chat_body(model: str, content: str, max_tokens: int, logprobs: bool = False) -> dict:
    """A streamed chat request with a fixed output length (ignore_eos)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if logprobs:
        body["logprobs"] = True
    return body


def client(url: str, tenant: str, connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(
        base_url=url, timeout=3600, limits=limits, headers={"Authorization": f"Bearer {KEY[tenant]}"}
    )


# -- phase 1: a light tenant under another's burst --------------------------------------------------------------
async def light_requests(c: httpx.AsyncClient, model: str, count: int | None, gap: float, until=None) -> list:
    """`interactive`'s 16-token requests one at a time: `count` of them, or until `until` is set."""
    records, i = [], 0
    while (count is None or i < count) and not (until is not None and until.is_set()):
        body = chat_body(model, LIGHT_QUESTIONS[i % len(LIGHT_QUESTIONS)] + f" (question {i})", 16)
        records.append(await one_request(c, "/v1/chat/completions", body))
        i += 1
        await asyncio.sleep(gap)
    return records


async def burst_phase(url: str, model: str, args) -> dict:
    async with client(url, "interactive", 4) as light, client(url, "eval-suite", args.burst + 8) as heavy:
        alone = await light_requests(light, model, args.light_alone, args.light_gap)
        prompts = make_prompts(args.burst, args.burst_prompt_words, args.seed)
        done = asyncio.Event()

        async def burst():
            t0 = time.perf_counter()
            bodies = [chat_body(model, p, args.burst_max_tokens) for p in prompts]
            records = await asyncio.gather(*(one_request(heavy, "/v1/chat/completions", b) for b in bodies))
            done.set()
            return records, time.perf_counter() - t0

        burst_task = asyncio.create_task(burst())
        await asyncio.sleep(args.light_gap)  # the burst is in first
        under = await light_requests(light, model, None, args.light_gap, until=done)
        burst_records, burst_s = await burst_task
    return {
        "light_alone": summary(alone),
        "light_under_burst": summary(under),
        "burst": {**summary(burst_records), "duration_s": burst_s,
                  "output_tokens_per_s": sum(r.output_tokens for r in burst_records if r.ok) / burst_s},
    }  # fmt: skip


def summary(records: list[Record]) -> dict:
    ok = [r for r in records if r.ok]
    return {"requests": len(records), "completed": len(ok), "errors": sorted({r.error for r in records if r.error})[:5],
            "ttft_s": stats([r.ttft for r in ok]), "e2e_s": stats([r.e2e for r in ok])}  # fmt: skip


# -- phase 2: two backlogged tenants -------------------------------------------------------------------------
async def stream_tokens(c: httpx.AsyncClient, body: dict, log: list[tuple[float, int]]) -> str:
    """One streamed chat request; each chunk's arrival time and output tokens (its logprobs entries) go to
    `log`. Returns an error, or ""."""
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return chunk["error"]["message"]
                for choice in chunk.get("choices") or []:
                    tokens = len((choice.get("logprobs") or {}).get("content") or [])
                    if tokens:
                        log.append((time.perf_counter(), tokens))
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return ""


async def backlog_phase(url: str, model: str, args) -> dict:
    tenants = ("eval-suite", "batch")
    logs: dict[str, list] = {t: [] for t in tenants}
    errors: dict[str, list] = {t: [] for t in tenants}
    prompts = make_prompts(64, args.burst_prompt_words, args.seed + 1)
    t0 = time.perf_counter()
    stop_at = t0 + args.backlog_stagger + args.backlog_seconds

    async def tenant_loop(tenant: str, delay: float):
        await asyncio.sleep(delay)
        async with client(url, tenant, args.backlog_clients + 4) as c:

            async def worker(w: int):
                i = w
                while time.perf_counter() < stop_at:
                    body = chat_body(model, prompts[i % len(prompts)], args.backlog_max_tokens, logprobs=True)
                    if err := await stream_tokens(c, body, logs[tenant]):
                        errors[tenant].append(err)
                    i += args.backlog_clients

            await asyncio.gather(*(worker(w) for w in range(args.backlog_clients)))

    await asyncio.gather(tenant_loop("eval-suite", 0.0), tenant_loop("batch", args.backlog_stagger))
    start = t0 + args.backlog_stagger + args.backlog_warmup
    window = stop_at - start
    rates = {t: sum(n for ts, n in logs[t] if start <= ts < stop_at) / window for t in tenants}
    low, high = min(rates.values()), max(rates.values())
    return {
        "window_s": window,
        "output_tokens_per_s": rates,
        "ratio_low_to_high": low / high if high else float("nan"),
        "errors": {t: sorted(set(e))[:5] for t, e in errors.items()},
    }


# -- report ----------------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    cfg, burst, backlog = report["config"], report["burst"], report["backlog"]
    alone, under = burst["light_alone"]["ttft_s"], burst["light_under_burst"]["ttft_s"]
    rates = backlog["output_tokens_per_s"]
    ok_ttft = under["p99"] <= 2.0
    ok_share = backlog["ratio_low_to_high"] >= 0.9
    return "\n".join([
        "# Tenant fairness",
        "",
        f"Server: `motet serve {' '.join(cfg['server_args'])}` (three API keys, equal weights unless "
        "--tenant-weights is among the server args).",
        "",
        f"## A light tenant under a burst of {cfg['burst']} chat requests",
        "",
        f"`eval-suite` sends {cfg['burst']} chat requests at once (~{cfg['burst_prompt_words']}-word prompts, "
        f"{cfg['burst_max_tokens']} output tokens each); `interactive` sends 16-token chat requests one at a "
        "time, before (alone) and throughout the burst.",
        "",
        "| interactive | requests | TTFT p50 (s) | TTFT p99 (s) | E2E p50 (s) |",
        "|---|---:|---:|---:|---:|",
        f"| alone | {burst['light_alone']['completed']} | {alone['p50']:.2f} | {alone['p99']:.2f} "
        f"| {burst['light_alone']['e2e_s']['p50']:.2f} |",
        f"| under the burst | {burst['light_under_burst']['completed']} | {under['p50']:.2f} | {under['p99']:.2f} "
        f"| {burst['light_under_burst']['e2e_s']['p50']:.2f} |",
        "",
        f"The burst: {burst['burst']['completed']}/{burst['burst']['requests']} completed in "
        f"{burst['burst']['duration_s']:.1f} s ({burst['burst']['output_tokens_per_s']:.0f} output tokens/s).",
        f"Target TTFT p99 <= 2 s under the burst: **{'met' if ok_ttft else 'missed'}** ({under['p99']:.2f} s).",
        "",
        "## Two backlogged tenants of equal weight",
        "",
        f"`eval-suite` and `batch` each keep {cfg['backlog_clients']} chat requests in flight "
        f"({cfg['backlog_max_tokens']} output tokens each), `batch` from {cfg['backlog_stagger']:g} s later; "
        f"tokens counted over {backlog['window_s']:.0f} s once both are backlogged.",
        "",
        "| tenant | output tokens/s |",
        "|---|---:|",
        *[f"| {t} | {r:.1f} |" for t, r in rates.items()],
        "",
        f"Ratio (lower / higher): {backlog['ratio_low_to_high']:.3f}. Target within 10%: "
        f"**{'met' if ok_share else 'missed'}**.",
        "",
        f"Errors: {json.dumps({'burst': report['burst']['burst']['errors'], 'backlog': backlog['errors']})}",
        "",
        f"Machine: {report['machine']}",
        "",
    ])  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="the model name sent in requests")
    p.add_argument("--model-path", default=None, help="--model for the server this script starts")
    p.add_argument("--burst", type=int, default=160, help="eval-suite's requests sent at once")
    p.add_argument("--burst-max-tokens", type=int, default=128)
    p.add_argument("--burst-prompt-words", type=int, default=64)
    p.add_argument("--light-alone", type=int, default=10, help="interactive's requests before the burst")
    p.add_argument("--light-gap", type=float, default=0.25, help="seconds between interactive's requests")
    p.add_argument(
        "--backlog-clients", type=int, default=48, help="requests each backlogged tenant keeps in flight"
    )
    p.add_argument("--backlog-max-tokens", type=int, default=64)
    p.add_argument("--backlog-seconds", type=float, default=90, help="how long both tenants are backlogged")
    p.add_argument("--backlog-stagger", type=float, default=5, help="batch starts this long after eval-suite")
    p.add_argument("--backlog-warmup", type=float, default=10, help="seconds not counted once both run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="benchmarks/reports/tenant_fairness")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed to `motet serve`")
    args = p.parse_args(argv)
    if args.backlog_warmup >= args.backlog_seconds:
        p.error("--backlog-warmup must be shorter than --backlog-seconds")

    with tempfile.TemporaryDirectory(prefix="motet-fairness-") as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps(TENANTS))
        server = ManagedServer(["--api-keys", str(keys), *args.server_args], model=args.model_path).start()
        try:
            warm = chat_body(args.model, "Hello!", 4)
            asyncio.run(_warm(server.url, warm))
            burst = asyncio.run(burst_phase(server.url, args.model, args))
            print(
                f"burst: interactive TTFT p99 {burst['light_under_burst']['ttft_s']['p99']:.2f} s", flush=True
            )
            backlog = asyncio.run(backlog_phase(server.url, args.model, args))
        finally:
            server.stop(120)

    report = {
        "config": {**{k: v for k, v in vars(args).items() if k != "output_dir"}, "tenants": sorted(KEY)},
        "machine": machine(),
        "burst": burst,
        "backlog": backlog,
    }
    write_report(Path(args.output_dir), "tenant_fairness", report, markdown(report))
    return 0


async def _warm(url: str, body: dict) -> None:
    async with client(url, "interactive", 2) as c:
        await one_request(c, "/v1/chat/completions", body)


if __name__ == "__main__":
    sys.exit(main())
