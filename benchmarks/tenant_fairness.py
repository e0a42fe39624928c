"""Fairness and latency isolation between tenants, served: a light tenant's answers under another's burst, two
backlogged tenants' shares, and a batch beside interactive traffic, on one `motet serve` with three API keys
(tenants `eval-suite`, `interactive`, `batch`).

Phase `burst`: `interactive` first sends --light-alone 16-token chat requests one at a time on the idle server
(alone); `eval-suite` then fires --burst chat requests at once with nobody else (its throughput alone), and
again while `interactive` keeps sending its 16-token requests one at a time (--light-gap seconds apart).
Reported: `interactive`'s E2E p99 under the burst against its E2E p50 alone (target <= 2x), its TTFT p99 (target
<= 1 s), and the burst's output tokens/s beside `interactive` against alone (target >= 85%).

Phase `backlog`: `eval-suite` and `batch` (equal weight) each keep --backlog-clients chat requests in flight,
`batch` starting --backlog-stagger seconds after `eval-suite`, for --backlog-seconds. Output tokens are counted as
they stream over the window where both are backlogged. Reported: each tenant's tokens/s and their ratio (target:
within 10%).

Phase `batch`: `interactive` keeps --interactive-clients streamed chat requests going for --interactive-seconds,
without and then beside `batch`'s Batch API job of --batch-lines lines. Reported: the interactive TTFT p99 and
TPOT p99 beside the batch against without (target <= 1.2x), and that the batch completes.

Phase `prompt`: `interactive` sends --prompt-repeats prompts of about --prompt-tokens tokens one at a time (1 output
token: the prompt done) alone, then while `eval-suite` keeps --prompt-streams streams decoding. Reported: the
prompt's time beside the streams against alone (target <= 2x). With --prompt-hogs N, N CPU-bound processes (a busy
loop each) run beside the server throughout the phase (alone and beside alike).

Phase `hogs`: one streamed request's output tokens/s alone, then beside --hogs CPU-bound processes (target: >= 45%
of alone with 2 loops on 2 cores, a fair share being 50%).

    python -m benchmarks.tenant_fairness                                  # every phase
    python -m benchmarks.tenant_fairness --phases burst                   # one of them
    python -m benchmarks.tenant_fairness --server-args --tpot-target-ms 0 # latency isolation off

Writes tenant_fairness-TIME.json and .md under --output-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks import chat_body
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import Record, machine, make_prompts, one_request, stats, write_report

TENANTS = {"sk-eval-suite": "eval-suite", "sk-interactive": "interactive", "sk-batch": "batch"}
KEY = {tenant: key for key, tenant in TENANTS.items()}
LIGHT_QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "How many legs has a spider?",
                   "What do bees make?", "Which planet is the largest?", "What is frozen water called?"]  # fmt: skip


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


async def run_burst(heavy: httpx.AsyncClient, model: str, args, done: asyncio.Event | None = None):
    """eval-suite's burst: --burst chat requests at once. Returns (records, seconds)."""
    t0 = time.perf_counter()
    prompts = make_prompts(args.burst, args.burst_prompt_words, args.seed)
    bodies = [chat_body(model, p, args.burst_max_tokens) for p in prompts]
    records = await asyncio.gather(*(one_request(heavy, "/v1/chat/completions", b) for b in bodies))
    if done is not None:
        done.set()
    return records, time.perf_counter() - t0


def burst_summary(records: list[Record], seconds: float) -> dict:
    return {**summary(records), "duration_s": seconds,
            "output_tokens_per_s": sum(r.output_tokens for r in records if r.ok) / seconds}  # fmt: skip


async def burst_phase(url: str, model: str, args) -> dict:
    async with client(url, "interactive", 4) as light, client(url, "eval-suite", args.burst + 8) as heavy:
        alone = await light_requests(light, model, args.light_alone, args.light_gap)
        burst_alone = await run_burst(heavy, model, args)  # the burst with nobody else: its throughput alone
        await asyncio.sleep(1.0)
        done = asyncio.Event()
        burst_task = asyncio.create_task(run_burst(heavy, model, args, done))
        await asyncio.sleep(args.light_gap)  # the burst is in first
        under = await light_requests(light, model, None, args.light_gap, until=done)
        burst_records, burst_s = await burst_task
    return {
        "light_alone": summary(alone),
        "light_under_burst": summary(under),
        "burst_alone": burst_summary(*burst_alone),
        "burst": burst_summary(burst_records, burst_s),
    }


def summary(records: list[Record]) -> dict:
    ok = [r for r in records if r.ok]
    return {"requests": len(records), "completed": len(ok), "errors": sorted({r.error for r in records if r.error})[:5],
            "ttft_s": stats([r.ttft for r in ok]), "e2e_s": stats([r.e2e for r in ok])}  # fmt: skip


# -- phase `prompt`: a long prompt beside another tenant's streams --------------------------------------------
@contextlib.contextmanager
def cpu_hogs(n: int):
    """`n` processes each spinning a core's worth of pure Python for as long as the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def long_prompt(i: int, tokens: int) -> str:
    """About `tokens` tokens of text, its own from the first word (no prefix-cache hit between two)."""
    return f"Document {i}: " + " ".join(make_prompts(1, int(tokens * 0.75), 1000 + i))


async def timed_prompts(c: httpx.AsyncClient, model: str, args, first: int) -> list[Record]:
    records = []
    for i in range(first, first + args.prompt_repeats):
        records.append(
            await one_request(
                c, "/v1/chat/completions", chat_body(model, long_prompt(i, args.prompt_tokens), 1)
            )
        )
    return records


async def prompt_phase(url: str, model: str, args) -> dict:
    with cpu_hogs(args.hogs):
        async with (
            client(url, "interactive", 2) as b,
            client(url, "eval-suite", args.prompt_streams + 2) as a,
        ):
            alone = await timed_prompts(b, model, args, 0)
            stop = asyncio.Event()

            async def stream(w: int):
                prompts = make_prompts(64, args.burst_prompt_words, args.seed + 4 + w)
                i = 0
                while not stop.is_set():
                    await one_request(a, "/v1/chat/completions", chat_body(model, prompts[i % 64], 256))
                    i += 1

            streams = [asyncio.create_task(stream(w)) for w in range(args.prompt_streams)]
            await asyncio.sleep(1.0)  # the streams are decoding
            beside = await timed_prompts(b, model, args, args.prompt_repeats)
            stop.set()
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
    return {"hogs": args.prompt_hogs, "alone": summary(alone), "beside_streams": summary(beside)}


# -- phase `hogs`: one stream beside CPU-bound loops -----------------------------------------------------------
async def hogs_phase(url: str, model: str, args) -> dict:
    body = chat_body(model, "Write a long story about a lighthouse keeper.", args.hogs_tokens)
    rates = {}
    async with client(url, "interactive", 2) as c:
        for name, n in (("alone", 0), ("beside_hogs", args.hogs)):
            with cpu_hogs(n):
                await asyncio.sleep(0.5)
                recs = [await one_request(c, "/v1/chat/completions", body) for _ in range(args.hogs_repeats)]
            rates[name] = [r.output_tokens / r.e2e for r in recs if r.ok and r.e2e]
    return {"hogs": args.hogs, "output_tokens_per_s": rates}


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


# -- phase 3: a batch beside interactive traffic ------------------------------------------------------------
async def interactive_window(url: str, model: str, args, seconds: float) -> list[Record]:
    """`interactive` keeps --interactive-clients streamed chat requests going for `seconds`."""
    stop_at = time.perf_counter() + seconds
    prompts = make_prompts(32, args.burst_prompt_words, args.seed + 2)
    records: list[Record] = []
    async with client(url, "interactive", args.interactive_clients + 2) as c:

        async def worker(w: int):
            i = w
            while time.perf_counter() < stop_at:
                body = chat_body(model, prompts[i % len(prompts)], args.interactive_max_tokens)
                records.append(await one_request(c, "/v1/chat/completions", body))
                i += args.interactive_clients

        await asyncio.gather(*(worker(w) for w in range(args.interactive_clients)))
    return records


async def start_batch(url: str, model: str, args) -> str:
    prompts = make_prompts(args.batch_lines, args.burst_prompt_words, args.seed + 3)
    lines = [
        json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": model, "messages": [{"role": "user", "content": p}],
                             "max_tokens": args.batch_max_tokens, "temperature": 0, "ignore_eos": True}})
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    async with client(url, "batch", 2) as c:
        files = {"file": ("lines.jsonl", "\n".join(lines).encode(), "application/jsonl")}
        r = await c.post("/v1/files", data={"purpose": "batch"}, files=files)
        r.raise_for_status()
        r = await c.post("/v1/batches", json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})  # fmt: skip
        r.raise_for_status()
        return r.json()["id"]


async def wait_batch(url: str, batch_id: str, timeout: float) -> dict:
    deadline = time.perf_counter() + timeout
    async with client(url, "batch", 2) as c:
        while True:
            body = (await c.get(f"/v1/batches/{batch_id}")).json()
            if (
                body["status"] in ("completed", "failed", "expired", "cancelled")
                or time.perf_counter() > deadline
            ):
                return body
            await asyncio.sleep(1.0)


def interactive_summary(records: list[Record]) -> dict:
    ok = [r for r in records if r.ok]
    return {**summary(records), "tpot_s": stats([r.tpot for r in ok if r.tpot is not None])}


async def batch_phase(url: str, model: str, args) -> dict:
    without = await interactive_window(url, model, args, args.interactive_seconds)
    t0 = time.perf_counter()
    batch_id = await start_batch(url, model, args)
    await asyncio.sleep(args.backlog_stagger)  # the batch's lines are running
    beside = await interactive_window(url, model, args, args.interactive_seconds)
    final = await wait_batch(url, batch_id, args.batch_timeout)
    return {
        "without_batch": interactive_summary(without),
        "beside_batch": interactive_summary(beside),
        "batch": {"id": batch_id, "status": final["status"], "request_counts": final.get("request_counts"),
                  "seconds": time.perf_counter() - t0},
    }  # fmt: skip


# -- report ----------------------------------------------------------------------------------------------------
def markdown(report: dict) -> str:
    cfg = report["config"]
    out = ["# Tenant fairness", "",
           f"Server: `motet serve {' '.join(cfg['server_args'])}` (API keys for `eval-suite`, `interactive` and "
           "`batch`, equal weights unless --tenant-weights is among the server args).", ""]  # fmt: skip
    if "burst" in report:
        out += burst_markdown(cfg, report["burst"])
    if "backlog" in report:
        out += backlog_markdown(cfg, report["backlog"])
    if "batch" in report:
        out += batch_markdown(cfg, report["batch"])
    if "prompt" in report:
        out += prompt_markdown(cfg, report["prompt"])
    if "hogs" in report:
        out += hogs_markdown(report["hogs"])
    out += [f"Machine: {report['machine']}", ""]
    return "\n".join(out)


def burst_markdown(cfg: dict, burst: dict) -> list[str]:
    alone, under = burst["light_alone"], burst["light_under_burst"]
    e2e_ratio = under["e2e_s"]["p99"] / alone["e2e_s"]["p50"]
    share = burst["burst"]["output_tokens_per_s"] / burst["burst_alone"]["output_tokens_per_s"]
    row = lambda name, r: (f"| {name} | {r['completed']} | {r['ttft_s']['p50']:.2f} | {r['ttft_s']['p99']:.2f} "  # noqa: E731
                           f"| {r['e2e_s']['p50']:.2f} | {r['e2e_s']['p99']:.2f} |")  # fmt: skip
    burst_row = lambda name, b: (f"| {name} | {b['completed']}/{b['requests']} | {b['duration_s']:.1f} "  # noqa: E731
                                 f"| {b['output_tokens_per_s']:.1f} |")  # fmt: skip
    return [
        f"## A light tenant under a burst of {cfg['burst']} chat requests",
        "",
        f"`eval-suite` sends {cfg['burst']} chat requests at once (~{cfg['burst_prompt_words']}-word prompts, "
        f"{cfg['burst_max_tokens']} output tokens each), alone and then while `interactive` sends 16-token chat "
        "requests one at a time (streamed), as it did alone before.",
        "",
        "| interactive | requests | TTFT p50 (s) | TTFT p99 (s) | E2E p50 (s) | E2E p99 (s) |",
        "|---|---:|---:|---:|---:|---:|",
        row("alone", alone),
        row("under the burst", under),
        "",
        "| eval-suite's burst | completed | seconds | output tokens/s |",
        "|---|---:|---:|---:|",
        burst_row("alone", burst["burst_alone"]),
        burst_row("beside interactive", burst["burst"]),
        "",
        f"- interactive's E2E p99 under the burst / its E2E p50 alone: **{e2e_ratio:.2f}x** (target <= 2x: "
        f"{'met' if e2e_ratio <= 2 else 'missed'})",
        f"- interactive's TTFT p99 under the burst: **{under['ttft_s']['p99']:.2f} s** (target <= 1 s: "
        f"{'met' if under['ttft_s']['p99'] <= 1 else 'missed'})",
        f"- the burst's output tokens/s beside interactive / alone: **{share:.1%}** (target >= 85%: "
        f"{'met' if share >= 0.85 else 'missed'})",
        f"- errors: {json.dumps([alone['errors'], under['errors'], burst['burst']['errors']])}",
        "",
    ]


def prompt_markdown(cfg: dict, phase: dict) -> list[str]:
    alone, beside = phase["alone"], phase["beside_streams"]
    ratio = beside["e2e_s"]["p50"] / alone["e2e_s"]["p50"]
    worst = beside["e2e_s"]["p99"] / alone["e2e_s"]["p50"]
    row = lambda name, r: f"| {name} | {r['completed']} | {r['e2e_s']['p50']:.2f} | {r['e2e_s']['p99']:.2f} |"  # noqa: E731
    return [
        f"## A {cfg['prompt_tokens']}-token prompt beside another tenant's {cfg['prompt_streams']} streams",
        "",
        f"`interactive` sends a ~{cfg['prompt_tokens']}-token prompt (1 output token) {cfg['prompt_repeats']} times, "
        f"alone and while `eval-suite` keeps {cfg['prompt_streams']} streams decoding; "
        f"{phase['hogs']} CPU-bound processes beside the server throughout.",
        "",
        "| interactive's prompt | requests | done p50 (s) | done p99 (s) |",
        "|---|---:|---:|---:|",
        row("alone", alone),
        row("beside the streams", beside),
        "",
        f"- beside / alone, p50: **{ratio:.2f}x**, p99 / alone p50: **{worst:.2f}x** (target <= 2x: "
        f"{'met' if worst <= 2 else 'missed'})",
        f"- errors: {json.dumps([alone['errors'], beside['errors']])}",
        "",
    ]


def hogs_markdown(phase: dict) -> list[str]:
    rates = phase["output_tokens_per_s"]
    mean = {k: sum(v) / len(v) if v else float("nan") for k, v in rates.items()}
    share = mean["beside_hogs"] / mean["alone"]
    return [
        f"## One stream beside {phase['hogs']} CPU-bound processes",
        "",
        "| | output tokens/s (each request) | mean |",
        "|---|---|---:|",
        *[f"| {k} | {', '.join(f'{x:.1f}' for x in v)} | {mean[k]:.1f} |" for k, v in rates.items()],
        "",
        f"- beside / alone: **{share:.1%}** (a fair share: {2 / (2 + phase['hogs']):.0%} of 2 cores; target >= 45% "
        f"with 2 loops)",
        "",
    ]


def backlog_markdown(cfg: dict, backlog: dict) -> list[str]:
    rates = backlog["output_tokens_per_s"]
    ok_share = backlog["ratio_low_to_high"] >= 0.9
    return [
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
        f"**{'met' if ok_share else 'missed'}**. Errors: {json.dumps(backlog['errors'])}",
        "",
    ]


def batch_markdown(cfg: dict, phase: dict) -> list[str]:
    w, b = phase["without_batch"], phase["beside_batch"]
    ttft = b["ttft_s"]["p99"] / w["ttft_s"]["p99"]
    tpot = b["tpot_s"]["p99"] / w["tpot_s"]["p99"]
    row = lambda name, r: (f"| {name} | {r['completed']} | {r['ttft_s']['p50']:.3f} | {r['ttft_s']['p99']:.3f} "  # noqa: E731
                           f"| {1000 * r['tpot_s']['p50']:.1f} | {1000 * r['tpot_s']['p99']:.1f} |")  # fmt: skip
    batch = phase["batch"]
    return [
        f"## A {cfg['batch_lines']}-line batch beside interactive traffic",
        "",
        f"`interactive` keeps {cfg['interactive_clients']} streamed chat requests going "
        f"({cfg['interactive_max_tokens']} output tokens each) for {cfg['interactive_seconds']:g} s, without and "
        f"then beside `batch`'s Batch API job of {cfg['batch_lines']} chat lines ({cfg['batch_max_tokens']} "
        "output tokens each).",
        "",
        "| interactive | requests | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | TPOT p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|",
        row("without the batch", w),
        row("beside the batch", b),
        "",
        f"- TTFT p99 beside / without: **{ttft:.2f}x**; TPOT p99: **{tpot:.2f}x** (target <= 1.2x: "
        f"{'met' if max(ttft, tpot) <= 1.2 else 'missed'})",
        f"- the batch: {batch['status']} ({json.dumps(batch['request_counts'])}) after {batch['seconds']:.0f} s",
        "",
    ]


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
    p.add_argument(
        "--interactive-clients", type=int, default=2, help="interactive's requests in flight (phase 3)"
    )
    p.add_argument("--interactive-max-tokens", type=int, default=32)
    p.add_argument("--interactive-seconds", type=float, default=60, help="each interactive window (phase 3)")
    p.add_argument("--batch-lines", type=int, default=1000)
    p.add_argument("--batch-max-tokens", type=int, default=16)
    p.add_argument(
        "--batch-timeout", type=float, default=1800, help="seconds to wait for the batch to finish"
    )
    p.add_argument("--prompt-tokens", type=int, default=1200, help="interactive's long prompt (phase prompt)")
    p.add_argument("--prompt-repeats", type=int, default=5)
    p.add_argument("--prompt-streams", type=int, default=8, help="eval-suite's streams beside it")
    p.add_argument("--prompt-hogs", type=int, default=0, help="CPU-bound processes beside it (phase prompt)")
    p.add_argument("--hogs", type=int, default=2, help="CPU-bound processes beside the stream (phase hogs)")
    p.add_argument("--hogs-tokens", type=int, default=128, help="the stream's output tokens (phase hogs)")
    p.add_argument("--hogs-repeats", type=int, default=3)
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
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
        results = {}
        try:
            warm = chat_body(args.model, "Hello!", 4)
            asyncio.run(_warm(server.url, warm))
            for phase in args.phases:
                results[phase] = asyncio.run(PHASES[phase](server.url, args.model, args))
                print(f"{phase}: {json.dumps(results[phase])[:400]}", flush=True)
        finally:
            server.stop(120)

    report = {
        "config": {**{k: v for k, v in vars(args).items() if k != "output_dir"}, "tenants": sorted(KEY)},
        "machine": machine(),
        **results,
    }
    write_report(Path(args.output_dir), "tenant_fairness", report, markdown(report))
    return 0


PHASES = {"burst": burst_phase, "backlog": backlog_phase, "batch": batch_phase, "prompt": prompt_phase,
          "hogs": hogs_phase}  # fmt: skip


async def _warm(url: str, body: dict) -> None:
    async with client(url, "interactive", 2) as c:
        await one_request(c, "/v1/chat/completions", body)


if __name__ == "__main__":
    sys.exit(main())
