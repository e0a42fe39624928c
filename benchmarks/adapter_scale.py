"""Many tenants' adapters at once, served: throughput and TTFT against the base model as the number of
distinct adapters in the traffic grows.

One `motet serve` (default settings, plus --server-args). N random rank-`--rank` adapters (q_proj and
v_proj by default) are uploaded through `POST /v1/adapters`, cumulatively: the first 8, then up to 64, ...
For each N and each concurrency, `--rounds` rounds of: the base model, then uniform traffic, then Zipf(1.0)
traffic (adapter k with weight 1/k), each `--requests` chat requests (at least 3 per client) of
`--max-tokens` output tokens (ignore_eos), every adapter request naming an adapter drawn from the N. Each
adapter run is measured against the base run of its round (both sides in one run, a minute apart), and the
rounds' median ratio and range are reported (this 2-core VM is noisy: one run's tokens/s varies by +-10%).
Reported per run: output tokens/s, TTFT p50/p99, their ratios to the base model's, the distinct adapters the
traffic named, adapter disk loads, pool placements and hits from `/metrics` (`motet_lora_*`), and the
resident adapter bytes sampled every 0.25 s against their bound.

Then, at the largest N, a cold-adapter probe: Zipf traffic keeps `--cold-clients` requests in flight while
probe requests alternate between an adapter never requested (on disk only: cold) and the hottest adapter
(warm), one at a time; reported: the cold probes' TTFT against the warm probes' p50. And outputs unchanged:
greedy answers of `--equality-adapters` adapters spread over the Zipf order and `--equality-base` base-model
requests (some with a JSON schema, some asking for a passage back so that speculation drafts), all sent at
once under the same Zipf load, against each sent alone to the idle server; `--peft-sample` of them against
PEFT (transformers + peft, fp32).

    python -m benchmarks.adapter_scale                                   # the whole study (~20 min)
    python -m benchmarks.adapter_scale --adapters 8 64 --concurrency 16  # a quick look
    python -m benchmarks.adapter_scale --server-args --max-loras 8       # the old fixed slots

Writes adapter_scale-TIME.json, .md and .png under --output-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import save

from benchmarks import chat_body
from motet.evals.lora_reference import lora_config, random_lora_factors
from motet.evals.report import table
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import Record, machine, make_prompts, one_request, stats, write_report
from motet.lora.adapter import TARGET_MODULES
from motet.lora.peft_format import CONFIG_FILE, WEIGHTS_FILE

MODEL = "SmolLM2-135M-Instruct"


# -- adapters ---------------------------------------------------------------------------------------------------
class Shape:
    """SmolLM2-135M's shapes (read from the server's model config when it is another model)."""

    def __init__(self, cfg: dict):
        self.hidden_size = cfg["hidden_size"]
        self.intermediate_size = cfg["intermediate_size"]
        self.num_hidden_layers = cfg["num_hidden_layers"]
        self.num_attention_heads = cfg["num_attention_heads"]
        self.num_key_value_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def adapter_files(base: Shape, rank: int, targets: list[str], seed: int) -> dict[str, bytes]:
    """A PEFT adapter's two files: random factors, B small enough that outputs stay fluent but differ."""
    tensors = random_lora_factors(base, targets, rank, seed, b_std=0.02)
    config = lora_config(rank, targets)
    return {CONFIG_FILE: json.dumps(config).encode(), WEIGHTS_FILE: save(tensors)}


async def upload(url: str, names: list[str], base: Shape, args) -> float:
    """Upload the adapters `names` (4 at a time); seconds taken."""
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(4)
    async with httpx.AsyncClient(base_url=url, timeout=600) as c:

        async def one(name: str) -> None:
            files = adapter_files(base, args.rank, args.targets, seed=int(name[1:]))
            async with sem:
                r = await c.post(
                    "/v1/adapters", data={"name": name}, files=[("files", (f, d)) for f, d in files.items()]
                )
            if r.status_code != 200:
                raise RuntimeError(f"uploading {name}: HTTP {r.status_code} {r.text[:300]}")

        await asyncio.gather(*(one(n) for n in names))
    return time.perf_counter() - t0


# -- traffic ----------------------------------------------------------------------------------------------------
def draw(names: list[str], count: int, traffic: str, rng: random.Random) -> list[str]:
    if traffic == "uniform":
        return [rng.choice(names) for _ in range(count)]
    weights = [1 / (k + 1) for k in range(len(names))]  # Zipf(1.0): the k-th adapter with weight 1/k
    return rng.choices(names, weights, k=count)


async def run(url: str, models: list[str], prompts: list[str], concurrency: int, max_tokens: int):
    """Each request names models[i]; at most `concurrency` in flight. (records, seconds)"""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:

        async def gated(model, prompt):
            async with sem:
                return await one_request(c, "/v1/chat/completions", chat_body(model, prompt, max_tokens))

        t0 = time.perf_counter()
        records = await asyncio.gather(*(gated(m, p) for m, p in zip(models, prompts, strict=True)))
        return records, time.perf_counter() - t0


def summary(records: list[Record], seconds: float, models: list[str]) -> dict:
    ok = [r for r in records if r.ok]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "distinct_models": len(set(models)),
        "seconds": seconds,
        "tokens_per_s": sum(r.output_tokens for r in ok) / seconds,
        "ttft_s": stats([r.ttft for r in ok]),
        "tpot_s": stats([r.tpot for r in ok if r.tpot is not None]),
    }


# -- the server's own counters -----------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(motet_lora_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


def lora_metrics(url: str) -> dict[str, float]:
    """The `motet_lora_*` samples of /metrics (labels folded into the name)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m[1] + (m[2] or "")] = float(m[3])
    return out


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """Samples the resident adapter bytes (and the server's RSS) every `period` s while a run goes on."""

    def __init__(self, url: str, pid: int, period: float = 0.25):
        self.url, self.pid, self.period = url, pid, period
        self.resident: list[float] = []
        self.bound: float | None = None
        self.rss: list[int] = []

    async def __call__(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            m = await asyncio.to_thread(lora_metrics, self.url)
            if "motet_lora_resident_bytes" in m:
                self.resident.append(m["motet_lora_resident_bytes"])
                self.bound = m.get("motet_lora_memory_bytes")
            self.rss.append(rss_bytes(self.pid))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.period)


async def measured(url: str, sampler: Sampler, models, prompts, concurrency, max_tokens):
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(stop))
    try:
        return await run(url, models, prompts, concurrency, max_tokens)
    finally:
        stop.set()
        await sampling


COUNTERS = ("motet_lora_disk_loads", "motet_lora_placements", "motet_lora_evictions", "motet_lora_hits",
            "motet_lora_misses")  # fmt: skip


def delta(after: dict, before: dict) -> dict:
    """Counters' growth over a run (the `... so far` series), gauges as they are after it."""
    return {k: v - before.get(k, 0.0) if k in COUNTERS else v for k, v in after.items()}


# -- the cold-adapter probe ---------------------------------------------------------------------------------------
async def cold_probe(url: str, names: list[str], cold: list[str], args) -> dict:
    """Zipf load over `names` with `--cold-clients` in flight; probes alternate cold / warm (names[0])."""
    rng = random.Random(args.seed + 7)
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=args.cold_clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as c:

        async def load_client(i: int) -> None:
            while not done.is_set():
                model = draw(names, 1, "zipf", rng)[0]
                prompt = make_prompts(1, args.prompt_words, rng.randrange(1 << 30))[0]
                await one_request(c, "/v1/chat/completions", chat_body(model, prompt, args.max_tokens))

        clients = [asyncio.create_task(load_client(i)) for i in range(args.cold_clients)]
        await asyncio.sleep(args.cold_warmup)
        probes: dict[str, list[float]] = {"cold": [], "warm": []}
        errors = []
        for i, name in enumerate(cold):
            for kind, model in (("warm", names[0]), ("cold", name)):
                prompt = make_prompts(1, args.prompt_words, 10_000 + 2 * i + (kind == "cold"))[0]
                rec = await one_request(c, "/v1/chat/completions", chat_body(model, prompt, args.max_tokens))
                if rec.ok:
                    probes[kind].append(rec.ttft)
                else:
                    errors.append(rec.error)
                await asyncio.sleep(0.5)
        done.set()
        await asyncio.gather(*clients)
    warm_p50 = stats(probes["warm"])["p50"]
    return {
        "load_clients": args.cold_clients,
        "cold_ttft_s": stats(probes["cold"]) | {"max": max(probes["cold"], default=math.nan)},
        "warm_ttft_s": stats(probes["warm"]),
        "cold_p50_over_warm_p50": stats(probes["cold"])["p50"] / warm_p50,
        "cold_max_over_warm_p50": max(probes["cold"], default=math.nan) / warm_p50,
        "errors": errors[:3],
    }


# -- outputs unchanged under load -------------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PASSAGE = "The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly."


def probe_body(model: str, kind: str, i: int) -> dict:
    """A greedy, non-streamed request: `chat`, `json` (a JSON schema: grammar masks and forced-token drafts) or
    `repeat` (asks for a passage back: prompt-lookup drafts, so speculation verifies them)."""
    if kind == "json":
        content = f"Describe person number {i} as JSON with a name and an age."
    elif kind == "repeat":
        content = f"Repeat this sentence exactly, twice: {PASSAGE}"
    else:
        content = make_prompts(1, 24, 50_000 + i)[0]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 48 if kind == "json" else 32}  # fmt: skip
    if kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    return body


def probes(names: list[str], count: int, base: int) -> list[tuple[str, str, dict]]:
    """(model, kind, body): `count` adapters spread over `names` (hot and cold ones of a Zipf order) and `base`
    base-model requests; every 8th a JSON schema, every 8th (offset 4) a repeat."""
    picks = [names[i * len(names) // count] for i in range(count)] + [MODEL] * base
    kinds = ["json" if i % 8 == 0 else "repeat" if i % 8 == 4 else "chat" for i in range(len(picks))]
    return [(m, k, probe_body(m, k, i)) for i, (m, k) in enumerate(zip(picks, kinds, strict=True))]


async def answer(c: httpx.AsyncClient, body: dict) -> dict:
    r = await c.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        return {"error": f"HTTP {r.status_code} {r.text[:200]}"}
    choice = r.json()["choices"][0]
    return {"content": choice["message"]["content"], "finish_reason": choice["finish_reason"]}


async def equality(url: str, names: list[str], args) -> dict:
    """The probes' greedy answers all at once under Zipf load over `names`, then each alone on the idle server."""
    items = probes(names, args.equality_adapters, args.equality_base)
    rng = random.Random(args.seed + 11)
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=200)) as c:

        async def load_client() -> None:
            while not done.is_set():
                model = draw(names, 1, "zipf", rng)[0]
                prompt = make_prompts(1, args.prompt_words, rng.randrange(1 << 30))[0]
                await one_request(c, "/v1/chat/completions", chat_body(model, prompt, args.max_tokens))

        before = spec_metrics(url)
        clients = [asyncio.create_task(load_client()) for _ in range(args.cold_clients)]
        await asyncio.sleep(args.cold_warmup)
        loaded = await asyncio.gather(*(answer(c, body) for _, _, body in items))
        done.set()
        await asyncio.gather(*clients)
        spec = {k: v - before.get(k, 0.0) for k, v in spec_metrics(url).items()}
        alone = [await answer(c, body) for _, _, body in items]
    rows = []
    for (model, kind, body), a, b in zip(items, loaded, alone, strict=True):
        row = {"model": model, "kind": kind, "body": body, "under_load": a, "alone": b,
               "equal": a == b and "error" not in a}  # fmt: skip
        if kind == "json" and "content" in a:
            row["valid_json"] = _valid(a["content"])
        rows.append(row)
    return {
        "probes": rows,
        "equal": sum(r["equal"] for r in rows),
        "total": len(rows),
        "json_valid": sum(r.get("valid_json", False) for r in rows),
        "json_total": sum(r["kind"] == "json" for r in rows),
        "speculation_during_load": spec,
    }


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), PERSON)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def spec_metrics(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith(("motet_spec_draft_tokens ", "motet_spec_accepted_tokens ")):
            name, value = line.split()
            out[name] = float(value)
    return out


def peft_check(model_path: str | None, base: Shape, rows: list[dict], args) -> dict:
    """A sample of the probes' adapters against PEFT (transformers + peft, fp32, greedy): the same answer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from motet.engine.weights.model_store import resolve_model

    path = resolve_model(model_path)
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    sample = [r for r in rows if r["model"] != MODEL and r["kind"] == "chat"][: args.peft_sample]
    out, model = [], None
    with tempfile.TemporaryDirectory(prefix="motet-peft-") as tmp:
        for r in sample:
            d = Path(tmp) / r["model"]
            d.mkdir()
            for f, data in adapter_files(base, args.rank, args.targets, seed=int(r["model"][1:])).items():
                (d / f).write_bytes(data)
            if model is None:
                model = PeftModel.from_pretrained(hf, str(d), adapter_name=r["model"]).eval()
            else:
                model.load_adapter(str(d), adapter_name=r["model"])
            model.set_adapter(r["model"])
            body = r["body"]
            ids = tok.apply_chat_template(body["messages"], add_generation_prompt=True, return_tensors="pt")
            ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=body["max_tokens"], do_sample=False)
            text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
            out.append({"model": r["model"], "peft": text, "motet": r["alone"].get("content"),
                        "equal": text == r["alone"].get("content")})  # fmt: skip
    return {"sample": out, "equal": sum(o["equal"] for o in out), "total": len(out)}


# -- the study ----------------------------------------------------------------------------------------------------
def study(server: ManagedServer, base: Shape, args) -> dict:
    url = server.url
    names = [f"a{i}" for i in range(max(args.adapters) + args.cold_probes)]
    cold = names[max(args.adapters) :]  # uploaded with the largest N, never in the traffic
    rng = random.Random(args.seed)
    sampler = Sampler(url, server.proc.pid)
    asyncio.run(run(url, [MODEL] * 4, make_prompts(4, 8, 99), 4, 4))  # warm-up
    runs, uploaded, upload_s = [], 0, 0.0
    for n in sorted(args.adapters):
        batch = names[uploaded:n] + (cold if n == max(args.adapters) else [])
        upload_s += asyncio.run(upload(url, batch, base, args))
        uploaded = n
        print(f"{n} adapters uploaded ({upload_s:.0f} s so far)", flush=True)
        for c, rnd in [(c, r) for c in args.concurrency for r in range(args.rounds)]:
            count = max(args.requests, 3 * c)
            for traffic in ("base", *args.traffic):
                prompts = make_prompts(count, args.prompt_words, rng.randrange(1 << 30))
                models = [MODEL] * count if traffic == "base" else draw(names[:n], count, traffic, rng)
                before = lora_metrics(url)
                sampler.resident, sampler.rss = [], []
                records, seconds = asyncio.run(measured(url, sampler, models, prompts, c, args.max_tokens))
                row = {"adapters": n, "concurrency": c, "traffic": traffic, "round": rnd}
                row |= summary(records, seconds, models)
                row["lora_metrics"] = delta(lora_metrics(url), before)
                row["resident_bytes_max"] = max(sampler.resident, default=None)
                row["resident_bound_bytes"] = sampler.bound
                row["server_rss_max_bytes"] = max(sampler.rss, default=None)
                runs.append(row)
                print(
                    f"N={n:5d} c={c:3d} {traffic:8s} {row['tokens_per_s']:6.1f} tok/s TTFT p50/p99 "
                    f"{row['ttft_s']['p50']:.2f}/{row['ttft_s']['p99']:.2f} s "
                    f"distinct={row['distinct_models']} errors={row['errors']}",
                    flush=True,
                )
    probe = asyncio.run(cold_probe(url, names[: max(args.adapters)], cold, args)) if cold else None
    same = asyncio.run(equality(url, names[: max(args.adapters)], args)) if args.equality_adapters else None
    if same and args.peft_sample:
        same["peft"] = peft_check(args.model_path, base, same["probes"], args)
    runs = ratios(runs)
    return {"runs": runs, "summary": aggregate(runs), "cold_probe": probe, "equality": same,
            "upload_seconds": upload_s}  # fmt: skip


def ratios(runs: list[dict]) -> list[dict]:
    """Each adapter run against the base run of its round (the one just before it)."""
    base = None
    for row in runs:
        if row["traffic"] == "base":
            base = row
            continue
        row["share_of_base"] = row["tokens_per_s"] / base["tokens_per_s"]
        row["ttft_p50_over_base"] = row["ttft_s"]["p50"] / base["ttft_s"]["p50"]
        row["ttft_p99_over_base"] = row["ttft_s"]["p99"] / base["ttft_s"]["p99"]
        row["base_tokens_per_s"] = base["tokens_per_s"]
        row["base_ttft_s"] = base["ttft_s"]
    return runs


def aggregate(runs: list[dict]) -> list[dict]:
    """Per (adapters, clients, traffic): the rounds' median and range of each ratio, and their summed counters."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["traffic"] != "base":
            groups.setdefault((r["adapters"], r["concurrency"], r["traffic"]), []).append(r)
    out = []
    for (n, c, traffic), rows in groups.items():
        row = {"adapters": n, "concurrency": c, "traffic": traffic, "rounds": len(rows)}
        for key in ("share_of_base", "ttft_p50_over_base", "ttft_p99_over_base", "tokens_per_s",
                    "base_tokens_per_s"):  # fmt: skip
            values = sorted(r[key] for r in rows)
            row[key] = {"median": statistics.median(values), "min": values[0], "max": values[-1]}
        for key in ("ttft_s", "base_ttft_s"):
            row[key] = {q: statistics.median(r[key][q] for r in rows) for q in ("p50", "p99")}
        row["distinct_models"] = max(r["distinct_models"] for r in rows)
        row["lora"] = {
            k.removeprefix("motet_lora_"): sum(r["lora_metrics"].get(k, 0) for r in rows) for k in COUNTERS
        }
        row["resident_bytes_max"] = max((r["resident_bytes_max"] or 0) for r in rows)
        row["resident_bound_bytes"] = rows[0]["resident_bound_bytes"]
        out.append(row)
    return out


def markdown(report: dict) -> str:
    cfg = report["config"]
    rows = []
    for r in report["summary"]:
        share, p99 = r["share_of_base"], r["ttft_p99_over_base"]
        lora = r["lora"]
        bound = r["resident_bound_bytes"]
        mem = f"{r['resident_bytes_max'] / 1e6:.0f} / {bound / 1e6:.0f}" if bound else "-"
        rows.append([
            r["adapters"], r["concurrency"], r["traffic"], r["distinct_models"], f"{r['tokens_per_s']['median']:.1f}",
            f"{100 * share['median']:.0f}% [{100 * share['min']:.0f}-{100 * share['max']:.0f}]",
            f"{r['ttft_s']['p50']:.2f} / {r['ttft_s']['p99']:.2f}",
            f"{r['base_ttft_s']['p50']:.2f} / {r['base_ttft_s']['p99']:.2f}",
            f"{p99['median']:.2f} [{p99['min']:.2f}-{p99['max']:.2f}]",
            f"{lora['disk_loads']:.0f} / {lora['placements']:.0f} / {lora['hits']:.0f}", mem,
        ])  # fmt: skip
    header = ["adapters", "clients", "traffic", "distinct", "tok/s", "share of base", "TTFT p50 / p99 (s)",
              "base TTFT p50 / p99 (s)", "TTFT p99 / base", "disk loads / placements / hits",
              "resident max / bound (MB)"]  # fmt: skip
    lines = [
        "# Adapter scale",
        "",
        f"`motet serve {' '.join(cfg['server_args'])}`; rank-{cfg['rank']} adapters on {', '.join(cfg['targets'])} "
        f"uploaded through `POST /v1/adapters`; {cfg['max_tokens']}-token chat answers (ignore_eos), prompts of "
        f"~{cfg['prompt_words']} words; each adapter run against the base model run of its round; "
        f"{cfg['rounds']} round(s): the median, and the range in brackets.",
        "",
        table(header, rows, "rrlrrrrrrrr"),
    ]
    base = [r for r in report["runs"] if r["traffic"] == "base"]
    for c in sorted({r["concurrency"] for r in base}):
        tps = [r["tokens_per_s"] for r in base if r["concurrency"] == c]
        lines.append("")
        lines.append(
            f"Base model at {c} clients: {min(tps):.1f} .. {max(tps):.1f} tok/s over {len(tps)} runs."
        )
    p = report.get("cold_probe")
    if p:
        lines += [
            "",
            f"Cold adapters under load ({p['load_clients']} Zipf clients): cold TTFT p50 "
            f"{p['cold_ttft_s']['p50']:.2f} s, max {p['cold_ttft_s']['max']:.2f} s; warm p50 "
            f"{p['warm_ttft_s']['p50']:.2f} s: cold p50 / warm p50 {p['cold_p50_over_warm_p50']:.2f}, "
            f"cold max / warm p50 {p['cold_max_over_warm_p50']:.2f}. Errors: {p['errors']}",
        ]
    e = report.get("equality")
    if e:
        spec = e["speculation_during_load"]
        lines += [
            "",
            f"Outputs under load: {e['equal']} / {e['total']} greedy answers ({e['total'] - cfg['equality_base']} adapters "
            f"spread over the Zipf order, base-model requests among them; {e['json_total']} with a JSON schema, "
            f"{e['json_valid']} valid) equal to each alone; draft tokens verified during the load "
            f"{spec.get('motet_spec_draft_tokens', 0):.0f}, accepted {spec.get('motet_spec_accepted_tokens', 0):.0f}.",
        ]
        if "peft" in e:
            lines.append(
                f"PEFT (transformers, fp32, greedy): {e['peft']['equal']} / {e['peft']['total']} equal."
            )
        lines += [f"- differs: {r['model']} {r['kind']}: {r['under_load']} vs {r['alone']}" for r in e["probes"]
                  if not r["equal"]]  # fmt: skip
    rss = max((r["server_rss_max_bytes"] or 0) for r in report["runs"])
    lines += ["", f"Server RSS at most {rss / 1e9:.2f} GB. Uploads took {report['upload_seconds']:.0f} s. "
              f"Machine: {report['machine']}", ""]  # fmt: skip
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    runs = [r for r in report["runs"] if r["traffic"] != "base"]
    for key in sorted({(r["concurrency"], r["traffic"]) for r in runs}):
        rows = sorted(
            (r for r in runs if (r["concurrency"], r["traffic"]) == key), key=lambda r: r["adapters"]
        )
        xs = [r["adapters"] for r in rows]
        label = f"{key[1]}, {key[0]} clients"
        left.plot(xs, [100 * r["share_of_base"] for r in rows], marker="o", label=label)
        right.plot(xs, [r["ttft_p99_over_base"] for r in rows], marker="o", label=label)
    left.axhline(85, color="grey", linestyle=":")
    right.axhline(1.5, color="grey", linestyle=":")
    for ax, title in ((left, "tokens/s, % of the base model's"), (right, "TTFT p99 / base model's")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("adapters uploaded")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    path.write_bytes(buf.getvalue())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, nargs="+", default=[8, 64, 256, 1024])
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--traffic", nargs="+", choices=["uniform", "zipf"], default=["uniform", "zipf"])
    p.add_argument("--requests", type=int, default=96, help="per run (at least 3 per client)")
    p.add_argument("--rounds", type=int, default=2, help="base / uniform / Zipf rounds per adapter count")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument(
        "--targets",
        nargs="+",
        default=["q_proj", "v_proj"],
        help="the adapters' modules, or `all`: all seven projections (PEFT's all-linear, what users train now)",
    )
    p.add_argument(
        "--cold-probes", type=int, default=8, help="cold adapters probed at the largest N (0: none)"
    )
    p.add_argument("--cold-clients", type=int, default=16, help="Zipf clients in flight during the probe")
    p.add_argument("--cold-warmup", type=float, default=10, help="seconds of load before the first probe")
    p.add_argument(
        "--equality-adapters",
        type=int,
        default=32,
        help="adapters whose answers under load are compared with each alone, at the largest N (0: none)",
    )
    p.add_argument("--equality-base", type=int, default=8, help="base-model requests among them")
    p.add_argument("--peft-sample", type=int, default=4, help="of them checked against PEFT")
    p.add_argument("--model-path", default=None, help="--model for the server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="benchmarks/reports/adapter_scale")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed to `motet serve`")
    args = p.parse_args(argv)
    if args.targets == ["all"]:
        args.targets = list(TARGET_MODULES)

    out = Path(args.output_dir)
    with tempfile.TemporaryDirectory(prefix="motet-adapter-scale-") as tmp:
        log = Path(tmp) / "server.log"
        server = ManagedServer(args.server_args, model=args.model_path, log_path=log).start()
        try:
            base = Shape(_model_config(args.model_path))
            result = study(server, base, args)
        finally:
            server.stop(120)
            out.mkdir(parents=True, exist_ok=True)
            (out / "server.log").write_text(
                log.read_text(errors="replace")[-200_000:] if log.exists() else ""
            )
    report = {"config": vars(args) | {"output_dir": str(out)}, "machine": machine(), **result}
    write_report(out, "adapter_scale", report, markdown(report))
    plot(report, out / f"adapter_scale-{time.strftime('%Y%m%d-%H%M%S')}.png")
    return 0


def _model_config(model_path: str | None) -> dict:
    from motet.engine.weights.model_store import resolve_model

    return json.loads((Path(resolve_model(model_path)) / "config.json").read_text())


if __name__ == "__main__":
    sys.exit(main())
