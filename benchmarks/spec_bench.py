"""Speculative decoding on vs off, served, in one run: TPOT and output tokens/s per workload and client count.

Workloads (streamed chat completions, greedy):
  extraction  JSON extraction from a given document under a strict JSON schema (values copy the document)
  bfcl        BFCL tool calls (tool_choice "required"; the shipped BFCL dev set, BFCL's "dict" types
              normalized to JSON Schema as motet/evals/suites/bfcl.py does)
  chat        free chat: a short story, fixed length (ignore_eos)
  edit        a multi-turn edit: the model is asked to repeat its previous answer with one word changed
Modes: `off`, `ngram` (--speculative ngram), and `jump-forward` (--jump-forward, the grammar's forced strings
appended without sampling; on the grammar workloads only). Every mode has its own server, all started
together; each level (workload, clients) runs on each mode's server back to back, in an order that rotates
with the repeat, so the two sides of a ratio are measured minutes apart, not a mode's whole run apart (this
machine's speed drifts). No request is sent twice to a server: every level and repeat has its own
documents, tool cases, story prompts and edit answers (speculation remembers a scope's recent outputs, and
a repeated request would find its own answer there). Writes spec_bench-TIME.json and .md under
--output-dir.

    python -m benchmarks.spec_bench --clients 1 4 16 --repeats 3          # the full run
    python -m benchmarks.spec_bench --clients 1 --requests 2 --max-tokens 32 --workloads extraction chat
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
from pathlib import Path

import httpx

from motet.evals.datasets import dev_set_path, read_jsonl
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import machine, run_level, summarize, write_report
from motet.evals.suites.bfcl import tools_of

WORKLOADS = ("extraction", "bfcl", "chat", "edit")
MODES = {
    "off": ["--speculative", "off"],
    "ngram": ["--speculative", "ngram"],
    "jump-forward": ["--jump-forward", "--speculative", "off"],
}
GRAMMAR_WORKLOADS = ("extraction", "bfcl")
BFCL = dev_set_path("bfcl")

FIRST = ["Alice", "Bruno", "Chen", "Dalia", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia", "Kofi",
         "Lena", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tomoko"]  # fmt: skip
LAST = ["Martin", "Okafor", "Nakamura", "Silva", "Kowalski", "Haddad", "Berg", "Novak", "Rossi", "Dubois",
        "Jensen", "Moreau", "Petrov", "Tanaka", "Varga", "Weber", "Yilmaz", "Zhang", "Costa", "Lindqvist"]  # fmt: skip
CITIES = ["Lyon", "Osaka", "Porto", "Gdansk", "Accra", "Tunis", "Bergen", "Brno", "Turin", "Quebec", "Ghent",
          "Cusco", "Dakar", "Kyoto", "Split", "Graz", "Leeds", "Aarhus", "Bilbao", "Perth"]  # fmt: skip
ITEMS = ["green tea", "walnut bread", "olive oil", "blue notebooks", "rice noodles", "wool socks", "dark coffee",
         "goat cheese", "paper lanterns", "pine soap"]  # fmt: skip
STREETS = ["Harbour Street", "Mill Lane", "Station Road", "Cedar Avenue", "Market Square", "Bridge Street"]
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
    "Our team meeting is moved to {day} at {hour} pm in the {room} on the {floor} floor. Please bring the "
    "{report}, the draft of the customer survey, and your notes from the supplier visit. If you cannot attend, "
    "send a short written update to {lead} before noon, and we will share the minutes with everyone by "
    "{later} morning."
)
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]
ROOMS = ["large conference room", "small meeting room", "library", "training room", "boardroom"]
FLOORS = ["first", "second", "third", "fourth", "fifth"]
REPORTS = ["quarterly budget report", "sales forecast", "hiring plan", "travel schedule", "supplier list"]


def document(rng: random.Random) -> tuple[str, str]:
    first, last, city = rng.choice(FIRST), rng.choice(LAST), rng.choice(CITIES)
    email = f"{first.lower()}.{last.lower()}@example.com"
    order = f"{rng.randint(2, 9)} packs of {rng.choice(ITEMS)} and {rng.randint(1, 5)} jars of honey"
    doc = (
        f"Customer record {rng.randint(1000, 9999)}. The customer {first} {last} wrote to us from {city} "
        f"using the address {email}. They placed an order for {order}, to be shipped to "
        f"{rng.randint(2, 99)} {rng.choice(STREETS)}, {city}. Delivery note: please leave the parcel with the "
        f"neighbour at number {rng.randint(1, 40)} if nobody answers the door."
    )
    return doc, "Extract the customer's name, email, city, street address, order and delivery note as JSON."


def edit_messages(rng: random.Random) -> list[dict]:
    """A message, then the ask to repeat it with one of its words changed."""
    day, later = rng.sample(DAYS, 2)
    words = {"day": day, "hour": str(rng.randint(1, 5)), "room": rng.choice(ROOMS), "floor": rng.choice(FLOORS),
             "report": rng.choice(REPORTS), "lead": f"{rng.choice(FIRST)} {rng.choice(LAST)}", "later": later}  # fmt: skip
    answer = ANSWER.format(**words)
    old = rng.choice([day, words["room"], words["floor"], words["report"]])
    new = {day: later, words["room"]: "cafeteria", words["floor"]: "ground", words["report"]: "annual review"}
    return [
        {"role": "user", "content": "Write a short message telling the team about the moved meeting."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": f"Repeat your previous answer word for word, but change '{old}' to "
                                    f"'{new[old]}'."},
    ]  # fmt: skip


def chat_body(model: str, messages: list[dict], max_tokens: int, **extra) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}  # fmt: skip


def bfcl_records(seed: int) -> list[dict]:
    records = read_jsonl(BFCL)
    records = [r for r in records if r["category"] != "irrelevance"]
    random.Random(seed).shuffle(records)
    return records


def requests_for(
    workload: str, n: int, model: str, max_tokens: int, seed: int, records: list[dict], first: int
) -> list[tuple[str, dict]]:
    """n requests of the workload; `first`: where this level starts in the shuffled BFCL cases (levels
    take disjoint slices)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if workload == "extraction":
            doc, ask = document(rng)
            fmt = {"type": "json_schema", "json_schema": {"name": "customer", "schema": EXTRACTION_SCHEMA,
                                                          "strict": True}}  # fmt: skip
            body = chat_body(model, [{"role": "user", "content": f"{doc}\n\n{ask}"}], max_tokens,
                             response_format=fmt)  # fmt: skip
        elif workload == "bfcl":
            r = records[(first + i) % len(records)]
            body = chat_body(
                model, r["question"][0], max_tokens, tools=tools_of(r, True), tool_choice="required"
            )
        elif workload == "chat":
            ask = (f"Write a short story about {rng.choice(TOPICS)}. The main character is called "
                   f"{rng.choice(FIRST)}, and it takes place near {rng.choice(CITIES)}.")  # fmt: skip
            body = chat_body(model, [{"role": "user", "content": ask}], max_tokens, ignore_eos=True)
        else:
            body = chat_body(model, edit_messages(rng), max_tokens)
        out.append(("/chat/completions", body))
    return out


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    names = ("motet_spec_draft_tokens", "motet_spec_accepted_tokens")
    return {n: float(m.group(1)) if (m := re.search(rf"^{n} (\S+)$", text, re.M)) else 0.0 for n in names}


def run_level_on(mode: str, server: ManagedServer, workload: str, c: int, rep: int, reqs) -> dict:
    before = spec_counters(server.url)
    records, duration = asyncio.run(run_level(server.base_url, reqs, c))
    after = spec_counters(server.url)
    s = summarize(records, duration, c)
    drafted = after["motet_spec_draft_tokens"] - before["motet_spec_draft_tokens"]
    accepted = after["motet_spec_accepted_tokens"] - before["motet_spec_accepted_tokens"]
    row = {"mode": mode, "workload": workload, "clients": c, "repeat": rep, "completed": s["completed"],
           "requests": s["requests"], "errors": s["errors"], "tpot_p50_ms": 1e3 * s["tpot_s"]["p50"],
           "tpot_mean_ms": 1e3 * s["tpot_s"]["mean"], "tokens_per_s": s["output_token_throughput"],
           "ttft_p50_s": s["ttft_s"]["p50"], "drafted": drafted,
           "acceptance": accepted / drafted if drafted else None}  # fmt: skip
    print(f"{mode:>12} {workload:>10} c={c:<3d} rep {rep} done {s['completed']}/{s['requests']} "
          f"TPOT p50 {row['tpot_p50_ms']:.1f} ms, {row['tokens_per_s']:.1f} tok/s"
          + (f", acceptance {row['acceptance']:.2f}" if drafted else ""), flush=True)  # fmt: skip
    return row


def run(args, loads: dict) -> list[dict]:
    """Every mode's server up at once; each level on each mode in turn, the order rotating per repeat."""
    servers = {}
    try:
        for mode in args.modes:
            server_args = ["--max-num-seqs", str(max(args.clients)), *MODES[mode], *args.server_args]
            if args.threads:
                server_args += ["--threads", str(args.threads)]
            servers[mode] = ManagedServer(server_args, model=args.model_path).start()
            warm = [("/chat/completions", chat_body(args.model, [{"role": "user", "content": "Hi"}], 4))] * 2
            asyncio.run(run_level(servers[mode].base_url, warm, 2))
        rows = []
        for (workload, c, rep), reqs in loads.items():
            modes = [m for m in args.modes if m != "jump-forward" or workload in GRAMMAR_WORKLOADS]
            shift = rep % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                rows.append(run_level_on(mode, servers[mode], workload, c, rep, reqs))
        return rows
    finally:
        for server in servers.values():
            server.stop()


def summary(rows: list[dict]) -> list[dict]:
    """Per (workload, clients): each mode's median TPOT and tok/s over the repeats, and the ratio of off's
    TPOT to the mode's, repeat by repeat (median, min, max)."""
    by = {}
    for r in rows:
        by.setdefault((r["workload"], r["clients"]), {}).setdefault(r["mode"], {})[r["repeat"]] = r
    out = []
    for (workload, c), modes in by.items():
        entry = {"workload": workload, "clients": c, "modes": {}}
        off = modes.get("off", {})
        for mode, reps in modes.items():
            vals = list(reps.values())
            m = {"tpot_p50_ms": statistics.median(r["tpot_p50_ms"] for r in vals),
                 "tokens_per_s": statistics.median(r["tokens_per_s"] for r in vals),
                 "acceptance": statistics.median(a) if (a := [r["acceptance"] for r in vals
                                                              if r["acceptance"] is not None]) else None}  # fmt: skip
            ratios = [off[k]["tpot_p50_ms"] / r["tpot_p50_ms"] for k, r in reps.items() if k in off]
            if mode != "off" and ratios:
                m["x"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
            entry["modes"][mode] = m
        out.append(entry)
    return out


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        "# Speculative decoding: on vs off",
        "",
        f"{cfg['max_tokens']} max output tokens; greedy; {cfg['repeats']} repeat(s), modes interleaved per "
        f"level; {report['machine']}.",
        "TPOT is the p50 per request of (E2E - TTFT) / (tokens - 1), the median over repeats; `x` is off's "
        "TPOT over the mode's in the same repeat: median [min-max].",
        "",
        "| workload | clients | off TPOT ms | ngram TPOT ms | x | jump-fwd TPOT ms | x | off tok/s | ngram tok/s "
        "| jump-fwd tok/s | acceptance |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731

    def x(m):
        if not m or "x" not in m:
            return "-"
        r = m["x"]
        return f"{r['median']:.2f}x" + (f" [{r['min']:.2f}-{r['max']:.2f}]" if r["min"] != r["max"] else "")

    for e in report["summary"]:
        off, on, jf = (e["modes"].get(m) for m in ("off", "ngram", "jump-forward"))
        if off is None:
            continue
        lines.append(
            f"| {e['workload']} | {e['clients']} | {fmt(off['tpot_p50_ms'])} | {fmt(on and on['tpot_p50_ms'])} "
            f"| {x(on)} | {fmt(jf and jf['tpot_p50_ms'])} | {x(jf)} | {fmt(off['tokens_per_s'])} "
            f"| {fmt(on and on['tokens_per_s'])} | {fmt(jf and jf['tokens_per_s'])} "
            f"| {fmt(on and on['acceptance'], '{:.2f}')} |"
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
    p.add_argument("--repeats", type=int, default=1, help="runs of every level, each with new requests")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="benchmarks/reports")
    p.add_argument(
        "--server-args", nargs=argparse.REMAINDER, default=[], help="passed to every `motet serve`"
    )
    args = p.parse_args(argv)

    records = bfcl_records(args.seed) if "bfcl" in args.workloads else []
    loads, first = {}, 0
    for rep in range(args.repeats):
        for w in args.workloads:
            for c in args.clients:
                n = args.requests or max(4, 2 * c)
                seed = args.seed + 1000 * rep + 10 * c + WORKLOADS.index(w)
                loads[(w, c, rep)] = requests_for(w, n, args.model, args.max_tokens, seed, records, first)
                first += n if w == "bfcl" else 0
    rows = run(args, loads)
    report = {"config": {"clients": args.clients, "workloads": args.workloads, "modes": args.modes,
                         "max_tokens": args.max_tokens, "requests": args.requests, "repeats": args.repeats,
                         "threads": args.threads, "server_args": args.server_args},
              "machine": machine(), "rows": rows, "summary": summary(rows)}  # fmt: skip
    write_report(Path(args.output_dir), "spec_bench", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
