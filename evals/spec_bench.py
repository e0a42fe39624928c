"""Speculative decoding on vs off, served, in one run: TPOT and output tokens/s per workload and client count.

Workloads (streamed chat completions, greedy):
  extraction  JSON extraction from a given document under a strict JSON schema (values copy the document)
  bfcl        BFCL tool calls (tool_choice "required"; ../shared/data/bfcl/dev.jsonl, BFCL's "dict" types
              normalized to JSON Schema as evals/suites/bfcl.py does)
  chat        free chat: a short story, fixed length (ignore_eos)
  edit        a multi-turn edit: the model is asked to repeat its previous answer with one word changed
Modes: `off`, `ngram` (--speculative ngram), and `jump-forward` (--jump-forward, the grammar's forced strings
appended without sampling; on the grammar workloads only). Each mode runs on its own server, one after the
other, with the same requests. Writes spec_bench-TIME.json and .md under --output-dir.

    python -m evals.spec_bench --clients 1 4 16                     # the full run
    python -m evals.spec_bench --clients 1 --requests 2 --max-tokens 32 --workloads extraction chat
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
from pathlib import Path

import httpx

from evals.server import ManagedServer
from evals.serving_bench import machine, run_level, summarize, write_report
from evals.suites.bfcl import tools_of

WORKLOADS = ("extraction", "bfcl", "chat", "edit")
MODES = {
    "off": ["--speculative", "off"],
    "ngram": ["--speculative", "ngram"],
    "jump-forward": ["--jump-forward", "--speculative", "off"],
}
GRAMMAR_WORKLOADS = ("extraction", "bfcl")
BFCL = Path(__file__).resolve().parents[2] / "shared" / "data" / "bfcl" / "dev.jsonl"

FIRST = ["Alice", "Bruno", "Chen", "Dalia", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia"]
LAST = ["Martin", "Okafor", "Nakamura", "Silva", "Kowalski", "Haddad", "Berg", "Novak", "Rossi", "Dubois"]
CITIES = ["Lyon", "Osaka", "Porto", "Gdansk", "Accra", "Tunis", "Bergen", "Brno", "Turin", "Quebec"]
ITEMS = ["green tea", "walnut bread", "olive oil", "blue notebooks", "rice noodles", "wool socks"]
EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "address": {"type": "string"},
        "order": {"type": "string"},
        "delivery_note": {"type": "string"},
    },
    "required": ["name", "email", "city", "address", "order", "delivery_note"],
    "additionalProperties": False,
}
TOPICS = ["a lighthouse keeper", "a lost robot", "a city under the sea", "a chess tournament", "a quiet village",
          "a mountain railway", "an old violin", "a winter market"]  # fmt: skip
ANSWER = (
    "Our team meeting is moved to Thursday at 3 pm in the large conference room on the second floor. "
    "Please bring the quarterly budget report, the draft of the customer survey, and your notes from the "
    "supplier visit. If you cannot attend, send a short written update to the project lead before noon, "
    "and we will share the minutes with everyone by Friday morning."
)
EDITS = [
    ("Thursday", "Friday"),
    ("3 pm", "4 pm"),
    ("second", "third"),
    ("noon", "11 am"),
    ("Friday", "Monday"),
]


def document(i: int, rng: random.Random) -> tuple[str, str]:
    first, last, city = FIRST[i % 10], LAST[(i * 3) % 10], CITIES[(i * 7) % 10]
    email = f"{first.lower()}.{last.lower()}@example.com"
    order = f"{rng.randint(2, 9)} packs of {rng.choice(ITEMS)} and {rng.randint(1, 5)} jars of honey"
    doc = (
        f"Customer record {1000 + i}. The customer {first} {last} wrote to us from {city} using the address "
        f"{email}. They placed an order for {order}, to be shipped to {rng.randint(2, 99)} Harbour Street, "
        f"{city}. Delivery note: please leave the parcel with the neighbour at number {rng.randint(1, 40)} "
        "if nobody answers the door."
    )
    return doc, "Extract the customer's name, email, city, street address, order and delivery note as JSON."


def chat_body(model: str, messages: list[dict], max_tokens: int, **extra) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip


def requests_for(workload: str, n: int, model: str, max_tokens: int, seed: int) -> list[tuple[str, dict]]:
    rng = random.Random(seed)
    out = []
    if workload == "bfcl":
        records = [json.loads(line) for line in BFCL.open() if line.strip()]
        records = [r for r in records if r["category"] != "irrelevance"]
        rng.shuffle(records)
    for i in range(n):
        if workload == "extraction":
            doc, ask = document(i, rng)
            fmt = {"type": "json_schema", "json_schema": {"name": "customer", "schema": EXTRACTION_SCHEMA,
                                                          "strict": True}}  # fmt: skip
            body = chat_body(model, [{"role": "user", "content": f"{doc}\n\n{ask}"}], max_tokens,
                             response_format=fmt)  # fmt: skip
        elif workload == "bfcl":
            r = records[i % len(records)]
            body = chat_body(
                model, r["question"][0], max_tokens, tools=tools_of(r, True), tool_choice="required"
            )
        elif workload == "chat":
            topic = TOPICS[i % len(TOPICS)]
            body = chat_body(model, [{"role": "user", "content": f"Write a short story about {topic}."}],
                             max_tokens, ignore_eos=True)  # fmt: skip
        else:
            old, new = EDITS[i % len(EDITS)]
            messages = [
                {"role": "user", "content": "Write a short message telling the team about the moved meeting."},
                {"role": "assistant", "content": ANSWER},
                {"role": "user", "content": f"Repeat your previous answer word for word, but change '{old}' "
                                            f"to '{new}'."},
            ]  # fmt: skip
            body = chat_body(model, messages, max_tokens)
        out.append(("/chat/completions", body))
    return out


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    names = ("motet_spec_draft_tokens", "motet_spec_accepted_tokens")
    return {n: float(m.group(1)) if (m := re.search(rf"^{n} (\S+)$", text, re.M)) else 0.0 for n in names}


def run_mode(mode: str, args, loads: dict) -> list[dict]:
    server_args = ["--max-num-seqs", str(max(args.clients)), *MODES[mode], *args.server_args]
    if args.threads:
        server_args += ["--threads", str(args.threads)]
    rows = []
    with ManagedServer(server_args, model=args.model_path) as server:
        warm = requests_for("chat", 2, args.model, 4, 0)
        asyncio.run(run_level(server.base_url, warm, 2))
        for (workload, c), reqs in loads.items():
            if mode == "jump-forward" and workload not in GRAMMAR_WORKLOADS:
                continue
            before = spec_counters(server.url)
            records, duration = asyncio.run(run_level(server.base_url, reqs, c))
            after = spec_counters(server.url)
            s = summarize(records, duration, c)
            drafted = after["motet_spec_draft_tokens"] - before["motet_spec_draft_tokens"]
            accepted = after["motet_spec_accepted_tokens"] - before["motet_spec_accepted_tokens"]
            row = {"mode": mode, "workload": workload, "clients": c, "completed": s["completed"],
                   "requests": s["requests"], "errors": s["errors"], "tpot_p50_ms": 1e3 * s["tpot_s"]["p50"],
                   "tpot_mean_ms": 1e3 * s["tpot_s"]["mean"], "tokens_per_s": s["output_token_throughput"],
                   "ttft_p50_s": s["ttft_s"]["p50"], "drafted": drafted,
                   "acceptance": accepted / drafted if drafted else None}  # fmt: skip
            rows.append(row)
            print(f"{mode:>12} {workload:>10} c={c:<3d} done {s['completed']}/{s['requests']} "
                  f"TPOT p50 {row['tpot_p50_ms']:.1f} ms, {row['tokens_per_s']:.1f} tok/s"
                  + (f", acceptance {row['acceptance']:.2f}" if drafted else ""), flush=True)  # fmt: skip
    return rows


def markdown(report: dict) -> str:
    rows = report["rows"]
    by = {(r["mode"], r["workload"], r["clients"]): r for r in rows}
    lines = [
        "# Speculative decoding: on vs off",
        "",
        f"{report['config']['max_tokens']} max output tokens; greedy; {report['machine']}.",
        "TPOT is the p50 per request of (E2E - TTFT) / (tokens - 1); `x` is off's TPOT over the mode's.",
        "",
        "| workload | clients | off TPOT ms | ngram TPOT ms | x | jump-fwd TPOT ms | x | off tok/s | ngram tok/s "
        "| jump-fwd tok/s | acceptance |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
    for workload in report["config"]["workloads"]:
        for c in report["config"]["clients"]:
            off, on, jf = (by.get((m, workload, c)) for m in ("off", "ngram", "jump-forward"))
            if off is None:
                continue
            x = lambda r, off=off: r and r["tpot_p50_ms"] and off["tpot_p50_ms"] / r["tpot_p50_ms"]  # noqa: E731
            lines.append(
                f"| {workload} | {c} | {fmt(off['tpot_p50_ms'])} | {fmt(on and on['tpot_p50_ms'])} "
                f"| {fmt(x(on), '{:.2f}x')} | {fmt(jf and jf['tpot_p50_ms'])} | {fmt(x(jf), '{:.2f}x')} "
                f"| {fmt(off['tokens_per_s'])} | {fmt(on and on['tokens_per_s'])} "
                f"| {fmt(jf and jf['tokens_per_s'])} | {fmt(on and on['acceptance'], '{:.2f}')} |"
            )
    return "\n".join(lines + [""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="the model name sent in requests")
    p.add_argument("--model-path", default=None, help="--model for the servers this script starts")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=None, help="per level (default: max(4, 2 x clients))")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="evals/reports")
    p.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="passed to every `motet serve`"
    )
    args = p.parse_args(argv)

    loads = {
        (w, c): requests_for(w, args.requests or max(4, 2 * c), args.model, args.max_tokens, args.seed + c)
        for w in args.workloads
        for c in args.clients
    }
    rows = [row for mode in args.modes for row in run_mode(mode, args, loads)]
    report = {"config": {"clients": args.clients, "workloads": args.workloads, "modes": args.modes,
                         "max_tokens": args.max_tokens, "requests": args.requests, "threads": args.threads,
                         "server_args": args.server_args},
              "machine": machine(), "rows": rows}  # fmt: skip
    write_report(Path(args.output_dir), "spec_bench", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
