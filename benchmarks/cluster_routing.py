"""motet's router vs Ray Serve's default routing on the real model, through `motet serve --replicas 2`.

    python -m benchmarks.cluster_routing [--conversations 24] [--rate 0.25] [--max-tokens 24] [--out DIR]

The same shared-prefix, multi-adapter workload runs twice in one go, against `motet serve --replicas 2
--router motet` and then `--router pow2` (Ray's PowerOfTwoChoicesRequestRouter), each a fresh server on the
default model (SmolLM2-135M-Instruct; --model another), one thread per replica. Tenants each have a long system prompt and
random rank-8 LoRA adapters (uploaded per tenant; one tenant also uses the base model); conversations start
as a Poisson process and run a few turns, each turn's prompt holding the history. Figures per router: the
replicas' prefix-cache hit rate (prompt tokens found cached, from their counters on /metrics), the share of
prompt tokens the responses report cached, and the time to first token (p50, p99) measured by the client
(the openai SDK, streaming). Writes results.json and summary.md (and a plot) under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.peft_adapters import random_peft_adapters
from motet.evals.report import fmt, pct, pyplot, save, table
from motet.evals.server import ManagedServer

ROOT = Path(__file__).resolve().parents[1]
ADMIN_KEY = "sk-admin"  # reads /metrics (the replicas' counters) under --api-keys
WORDS = [
    "policy",
    "account",
    "invoice",
    "refund",
    "shipment",
    "customer",
    "warranty",
    "order",
    "ledger",
    "balance",
    "audit",
    "contract",
    "clause",
    "tariff",
    "schedule",
    "region",
    "support",
    "ticket",
    "priority",
    "escalate",
    "summary",
    "report",
    "quarterly",
    "revenue",
    "forecast",
    "inventory",
    "supplier",
    "partner",
    "compliance",
    "review",
    "approve",
    "deny",
    "pending",
    "status",
    "update",
    "notify",
]
QUESTIONS = [
    "What should I do about a late shipment?",
    "Summarize the refund rules in one sentence.",
    "Which clause covers the warranty?",
    "How do I escalate a ticket?",
    "Is an audit needed this quarter?",
    "List two reasons to deny a request.",
]


def workload(args) -> list[dict]:
    """Conversations: start time, tenant, model (an adapter's name or the base model), questions."""
    rng = random.Random(args.seed)
    t, conversations = 0.0, []
    for k in range(args.conversations):
        t += rng.expovariate(args.rate)
        tenant = k % args.tenants
        choices = [f"a{j}" for j in range(args.adapters_per_tenant)] + (["base"] if tenant == 0 else [])
        turns = rng.randint(2, args.max_turns)
        conversations.append(
            {
                "start": t,
                "tenant": tenant,
                "model": rng.choice(choices),
                "questions": rng.sample(QUESTIONS, turns),
            }
        )
    return conversations


def system_prompt(tenant: int, words: int) -> str:
    rng = random.Random(1000 + tenant)
    return f"You are the assistant of company {tenant}. Rules: " + " ".join(
        rng.choice(WORDS) for _ in range(words)
    )


def replica_counters(url: str) -> tuple[float, float]:
    """Prefix-cache hits and queries summed over the replicas (their latest reports; /metrics is the admin's
    under --api-keys)."""
    hits = queries = 0.0
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    r.raise_for_status()
    for line in r.text.splitlines():
        if line.startswith("motet_replica_prefix_cache_hits"):
            hits += float(line.rsplit(" ", 1)[1])
        elif line.startswith("motet_replica_prefix_cache_queries"):
            queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def converse(client, conv: dict, args, t0: float, served: str, records: list) -> None:
    await asyncio.sleep(max(0.0, t0 + conv["start"] - time.monotonic()))
    model = served if conv["model"] == "base" else conv["model"]
    messages = [{"role": "system", "content": system_prompt(conv["tenant"], args.system_words)}]
    for q in conv["questions"]:
        messages.append({"role": "user", "content": q})
        sent, first, text, usage = time.monotonic(), None, "", None
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic()
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        records.append(
            {"ttft_s": (first or time.monotonic()) - sent, "prompt": usage.prompt_tokens, "cached": cached}
        )
        messages.append({"role": "assistant", "content": text})
        await asyncio.sleep(args.think)


async def drive(server: ManagedServer, args, adapters: list[Path], served: str) -> dict:
    import openai

    records: list[dict] = []
    keys = {f"sk-{t}": t for t in range(args.tenants)}
    for t in range(args.tenants):  # each tenant uploads its adapters under the same names
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer sk-{t}"}, timeout=120) as c:
            for j in range(args.adapters_per_tenant):
                path = adapters[t * args.adapters_per_tenant + j]
                files = [("files", (f.name, f.read_bytes())) for f in sorted(path.iterdir()) if f.is_file()]
                r = c.post("/v1/adapters", data={"name": f"a{j}"}, files=files)
                r.raise_for_status()
    before = replica_counters(server.url)
    clients = {
        t: openai.AsyncOpenAI(base_url=server.base_url, api_key=k, max_retries=0, timeout=600)
        for k, t in keys.items()
    }
    conversations = workload(args)
    t0 = time.monotonic()
    await asyncio.gather(
        *(converse(clients[c["tenant"]], c, args, t0, served, records) for c in conversations)
    )
    seconds = time.monotonic() - t0
    await asyncio.sleep(2)  # the replicas' last reports
    after = replica_counters(server.url)
    hits, queries = after[0] - before[0], after[1] - before[1]
    ttfts = sorted(r["ttft_s"] for r in records)
    return {
        "requests": len(records),
        "seconds": seconds,
        "prefix_hit_rate": hits / queries if queries else None,
        "cached_prompt_share": sum(r["cached"] for r in records) / sum(r["prompt"] for r in records),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))],
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttfts_s": [round(t, 3) for t in ttfts],
    }


def run_router(router: str, args, adapters, keys_file: Path, out: Path) -> dict:
    server_args = [
        "--replicas", "2", "--threads", str(args.threads), "--router", router,
        "--num-kv-blocks", str(args.kv_blocks), "--api-keys", str(keys_file), "--served-model-name", "base-model",
    ]  # fmt: skip
    with ManagedServer(
        server_args, model=args.model, log_path=out / f"server-{router}.log", start_timeout=1200
    ) as server:
        result = asyncio.run(drive(server, args, adapters, "base-model"))
    print(f"{router}: {json.dumps({k: v for k, v in result.items() if k != 'ttfts_s'})}", file=sys.stderr)
    return result


def markdown(results: dict) -> str:
    rows = [
        [
            name,
            str(r["requests"]),
            pct(r["prefix_hit_rate"]),
            pct(r["cached_prompt_share"]),
            fmt(r["ttft_p50_s"], ".2f"),
            fmt(r["ttft_p99_s"], ".2f"),
        ]
        for name, r in results["routers"].items()
    ]
    header = ["router", "requests", "prefix hit rate", "cached prompt tokens", "TTFT p50 s", "TTFT p99 s"]
    a = results["args"]
    return "\n".join(
        [
            "# Routing through two replicas, on the real model",
            "",
            f"`{' '.join(results['argv'])}`",
            "",
            f"{a['conversations']} conversations ({a['tenants']} tenants, {a['adapters_per_tenant']} adapters "
            f"each, system prompts of {a['system_words']} words, 2-{a['max_turns']} turns, {a['max_tokens']} "
            f"tokens per reply), {a['kv_blocks']} KV blocks and {a['threads']} thread per replica.",
            "",
            table(header, rows),
            "",
        ]
    )


def plot(results: dict, out: Path) -> Path:
    plt = pyplot()
    names = list(results["routers"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    axes[0].bar(names, [results["routers"][n]["prefix_hit_rate"] or 0 for n in names])
    axes[0].set_ylabel("prefix hit rate")
    axes[0].set_ylim(0, 1)
    width = 0.35
    for i, key in enumerate(("ttft_p50_s", "ttft_p99_s")):
        xs = [j + (i - 0.5) * width for j in range(len(names))]
        axes[1].bar(xs, [results["routers"][n][key] for n in names], width, label=key[5:8])
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels(names)
    axes[1].set_ylabel("TTFT (s)")
    axes[1].legend()
    return save(fig, out / "routing.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--rate", type=float, default=0.25, help="conversations started per second")
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--adapters-per-tenant", type=int, default=2)
    p.add_argument("--system-words", type=int, default=160)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--think", type=float, default=0.5, help="seconds between a reply and the next turn")
    p.add_argument("--kv-blocks", type=int, default=512, help="per replica")
    p.add_argument("--threads", type=int, default=1, help="per replica")
    p.add_argument("--routers", nargs="+", default=["motet", "pow2"])
    p.add_argument("--model", default=None, help="the served model (default: motet's default model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or ROOT / "reports" / "eval" / f"cluster_routing-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    from motet.engine.weights.model_store import resolve_model

    with tempfile.TemporaryDirectory(prefix="motet-routing-") as tmp:
        adapters = random_peft_adapters(
            resolve_model(args.model), Path(tmp), args.tenants * args.adapters_per_tenant
        )
        keys_file = Path(tmp) / "keys.json"
        tenants = {f"sk-{t}": f"tenant{t}" for t in range(args.tenants)}
        keys_file.write_text(json.dumps({**tenants, ADMIN_KEY: {"admin": True}}))
        routers = {r: run_router(r, args, adapters, keys_file, out) for r in args.routers}
    argv_ = ["python -m benchmarks.cluster_routing", *(argv if argv is not None else sys.argv[1:])]
    results = {"argv": argv_, "args": vars(args) | {"out": str(out)}, "routers": routers}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "summary.md").write_text(markdown(results) + f"\n![routing]({plot(results, out).name})\n")
    print(markdown(results))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
