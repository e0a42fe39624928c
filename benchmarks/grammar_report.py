"""Grammar backend report over JSONSchemaBench: compile coverage, correctness and speed.

    python -m benchmarks.grammar_report [--data FILE (default: the shipped JSONSchemaBench dev set)] [--limit N]
                                   [--out reports/grammar] [--timeout 10] [--model-dir DIR] [--workers N]

For every schema and configuration (xgrammar, xgrammar with strict=False, llguidance, outlines):
compile it (through `GrammarCache`, with the time limit), then feed each test instance,
`json.dumps(data)` tokenized with the real tokenizer, token by token through a matcher, timing
`fill_bitmask` before each token and checking that the mask agrees with `accept_token`. An instance
is accepted when every token is accepted and then the stop token is. Valid instances should be
accepted and invalid ones rejected (the dataset's labels are the reference). "fallback" is derived: the
result of the first backend in the server's fallback order (grammar.specs.BACKEND_NAMES) that compiled,
compile times of the ones tried before added; "<backend>+fallback" starts from that backend instead.

Work runs in a forked child process; a compilation that overruns its time limit keeps a thread
busy, so the child then exits and a fresh one continues from the next unit (and a crash or hang
only loses one unit). With --limit, schemas are taken round-robin across categories.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks import nearest_rank, write_report
from motet.evals.datasets import dev_set_path, read_jsonl
from motet.evals.report import table

CONFIGS = {  # name -> (backend, strict)
    "xgrammar": ("xgrammar", True),
    "xgrammar_nonstrict": ("xgrammar", False),
    "llguidance": ("llguidance", True),
    "outlines": ("outlines", True),
}
DEFAULT_DATA = dev_set_path("jsonschemabench")
UNIT_SLACK_S = 300.0  # watchdog beyond the compile limit, for running the instances


def load_records(path: Path, limit: int | None) -> list[dict]:
    recs = read_jsonl(path)
    if limit is None or limit >= len(recs):
        return recs
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        by_cat[r["category"]].append(r)
    out: list[dict] = []
    i = 0
    while len(out) < limit:  # round-robin so a small limit still spans every category
        for cat in sorted(by_cat):
            if i < len(by_cat[cat]) and len(out) < limit:
                out.append(by_cat[cat][i])
        i += 1
    return out


def run_instance(
    compiled, ids: list[int], stop_id: int, bitmask, mask_times: list[float]
) -> tuple[bool, int]:
    """Feed `ids` then the stop token; returns (accepted, mask/accept disagreements)."""
    from motet.grammar.backend import bitmask_allows

    m = compiled.matcher()
    mismatches = 0
    for t in [*ids, stop_id]:
        t0 = time.perf_counter()
        m.fill_bitmask(bitmask, 0)
        mask_times.append(time.perf_counter() - t0)
        allowed = bitmask_allows(bitmask, 0, t)
        ok = m.accept_token(t)
        mismatches += allowed != ok
        if not ok:
            return False, mismatches
    return m.is_terminated(), mismatches


def evaluate(ctx: dict, rec: dict, config: str) -> dict:
    from motet.grammar.specs import GrammarError, JsonSchemaSpec

    backend, strict = CONFIGS[config]
    res: dict = {"id": rec["id"], "category": rec["category"], "config": config}
    t0 = time.perf_counter()
    try:
        compiled = ctx["cache"].compile(
            JsonSchemaSpec(rec["schema"], strict=strict), ctx["tok"], backend, ctx["timeout"]
        )
    except GrammarError as e:
        res.update(status=e.reason, error=str(e)[:300], compile_s=time.perf_counter() - t0)
        return res
    res.update(status="ok", compile_s=time.perf_counter() - t0)
    mask_times: list[float] = []
    tests, mismatches = [], 0
    for t in rec["tests"]:
        ids = ctx["hf_tok"].encode(json.dumps(t["data"]), add_special_tokens=False)
        accepted, mm = run_instance(compiled, ids, ctx["tok"].stop_token_ids[0], ctx["bitmask"], mask_times)
        tests.append([bool(t["valid"]), accepted])
        mismatches += mm
    res.update(tests=tests, mask_mismatches=mismatches, mask_us=[round(x * 1e6, 2) for x in mask_times])
    return res


def child(ctx: dict, units: list[tuple[int, str]], start: int, wfd: int, log_path: Path) -> None:
    # Backends print warnings from C++ straight to fd 2: keep them out of the terminal.
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 2)
    out = os.fdopen(wfd, "w", buffering=1)
    for k in range(start, len(units)):
        ri, config = units[k]
        out.write(json.dumps({"begin": k}) + "\n")
        res = evaluate(ctx, ctx["records"][ri], config)
        out.write(json.dumps({"unit": k, **res}) + "\n")
        if res["status"] == "timeout":  # its thread is still compiling: leave, a new child goes on
            break
    out.flush()
    from motet.grammar.regex_worker import shutdown

    shutdown()
    os._exit(0)


def run_units(ctx: dict, units: list[tuple[int, str]], log_path: Path) -> list[dict]:
    results: dict[int, dict] = {}
    k = 0
    t_start = time.time()
    while k < len(units):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(rfd)
            try:
                child(ctx, units, k, wfd, log_path)
            finally:
                os._exit(1)
        os.close(wfd)
        buf, current, deadline = b"", None, time.monotonic() + ctx["timeout"] + UNIT_SLACK_S
        while True:
            ready, _, _ = select.select([rfd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:  # hung: kill it, record the unit, go on after it
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(rfd, 1 << 20)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if "begin" in msg:
                    current = msg["begin"]
                    deadline = time.monotonic() + ctx["timeout"] + UNIT_SLACK_S
                else:
                    results[msg.pop("unit")] = msg
                    current = None
                    done = len(results)
                    if done % 100 == 0:
                        print(f"  {done}/{len(units)} units, {time.time() - t_start:.0f}s", file=sys.stderr)
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
        if current is None and (not results or max(results) < k):
            current = k  # died before starting a unit: blame the first one, so we move on
        if current is not None:  # the child died or hung inside this unit
            ri, config = units[current]
            rec = ctx["records"][ri]
            why = "hang" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else "crash"
            results[current] = {"id": rec["id"], "category": rec["category"], "config": config, "status": why}
        k = max(results) + 1
    return [results[i] for i in range(len(units))]


def run_sharded(ctx: dict, units: list[tuple[int, str]], log_path: Path, workers: int) -> list[dict]:
    """run_units over `workers` interleaved shards at once, each in a forked process of its own (a machine
    with many cores: every config shares the same contention, so their figures stay comparable)."""
    if workers <= 1:
        return run_units(ctx, units, log_path)
    shards = [list(range(w, len(units), workers)) for w in range(workers)]
    pids = []
    for w, idx in enumerate(shards):
        pid = os.fork()
        if pid == 0:
            try:
                res = run_units(ctx, [units[i] for i in idx], log_path)
                log_path.with_suffix(f".shard{w}.json").write_text(json.dumps(res))
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    results: list[dict | None] = [None] * len(units)
    for w, idx in enumerate(shards):
        shard_file = log_path.with_suffix(f".shard{w}.json")
        for i, r in zip(idx, json.loads(shard_file.read_text()), strict=True):
            results[i] = r
        shard_file.unlink()
    return results  # type: ignore[return-value]


def fallback_order(first: str) -> list[str]:
    from motet.grammar.specs import BACKEND_NAMES

    return [first] + [b for b in BACKEND_NAMES if b != first]


def with_fallback(results: list[dict], order: list[str], name: str) -> list[dict]:
    """Derive a fallback configuration: per schema, the first backend of `order` that compiled (the last
    one's failure where none did), with the compile times of the ones tried before it added."""
    by = {(r["id"], r["config"]): r for r in results}
    out = []
    for r in results:
        if r["config"] != order[0]:
            continue
        spent = 0.0
        for backend in order:
            b = by.get((r["id"], backend))
            if b is None:
                continue
            if b["status"] == "ok" or backend == order[-1]:
                out.append({**b, "config": name, "compile_s": spent + b.get("compile_s", 0)})
                break
            spent += b.get("compile_s", 0)
    return out


def summarize(results: list[dict]) -> dict:
    n = len(results)
    ok = [r for r in results if r["status"] == "ok"]
    pairs = [t for r in ok for t in r["tests"]]
    valid = [acc for v, acc in pairs if v]
    invalid = [acc for v, acc in pairs if not v]
    compile_ms = [r["compile_s"] * 1e3 for r in ok]
    mask_us = [x for r in ok for x in r["mask_us"]]

    def share(a: int, b: int) -> float | None:
        return round(a / b, 4) if b else None

    return {
        "schemas": n,
        "compiled": len(ok),
        "compiled_share": share(len(ok), n),
        "status": dict(Counter(r["status"] for r in results)),
        "valid_instances": len(valid),
        "valid_accepted_share": share(sum(valid), len(valid)),
        "invalid_instances": len(invalid),
        "invalid_rejected_share": share(len(invalid) - sum(invalid), len(invalid)),
        "compile_ms_p50": nearest_rank(compile_ms, 0.5),
        "compile_ms_p99": nearest_rank(compile_ms, 0.99),
        "mask_us_p50": nearest_rank(mask_us, 0.5),
        "mask_us_p99": nearest_rank(mask_us, 0.99),
        "masked_tokens": len(mask_us),
        "mask_mismatches": sum(r["mask_mismatches"] for r in ok),
    }


def fmt(x, kind: str) -> str:
    if x is None:
        return "-"
    if kind == "share":
        return f"{100 * x:.1f}%"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def markdown(report: dict) -> str:
    cfgs = report["configs"]
    overall = []
    for c in cfgs:
        s = report["overall"][c]
        fails = ", ".join(f"{k} {v}" for k, v in sorted(s["status"].items()) if k != "ok") or "-"
        overall.append([
            c, fmt(s["compiled_share"], "share"), f"{fmt(s['valid_accepted_share'], 'share')} ({s['valid_instances']})",
            f"{fmt(s['invalid_rejected_share'], 'share')} ({s['invalid_instances']})",
            f"{fmt(s['compile_ms_p50'], 'n')} / {fmt(s['compile_ms_p99'], 'n')}",
            f"{fmt(s['mask_us_p50'], 'n')} / {fmt(s['mask_us_p99'], 'n')}", s["mask_mismatches"], fails,
        ])  # fmt: skip
    shares = ("compiled_share", "valid_accepted_share", "invalid_rejected_share")
    per_category = [
        [
            f"{cat} ({per[cfgs[0]]['schemas']})",
            *(" / ".join(fmt(per[c][k], "share") for k in shares) for c in cfgs),
        ]
        for cat, per in sorted(report["per_category"].items())
    ]
    header = ["config", "compiled", "valid accepted", "invalid rejected", "compile p50 / p99 (ms)",
              "mask p50 / p99 (µs)", "mask/accept mismatches", "not compiled"]  # fmt: skip
    lines = [
        "# Grammar backends on JSONSchemaBench",
        "",
        f"Data: `{report['data']}`, {report['schemas']} schemas, {report['instances']} test instances"
        f" ({report['selection']}). Compile limit {report['timeout_s']:g}s; whitespace <= 1 char between JSON"
        f" tokens; instances fed as `json.dumps(data)`. Run took {report['elapsed_s']:.0f}s on {report['host']}.",
        "",
        table(header, overall, "l" * len(header)),
        "",
        "Valid accepted / invalid rejected are over the instances of schemas that compiled.",
        "",
        "## Per category: compiled / valid accepted / invalid rejected",
        "",
        table(["category", *cfgs], per_category, "l" * (1 + len(cfgs))),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("reports/grammar"))
    ap.add_argument("--timeout", type=float, default=10.0, help="compile time limit per schema (s)")
    ap.add_argument("--model-dir", type=Path, default=None, help="HF model dir (default: motet pull)")
    ap.add_argument("--workers", type=int, default=1, help="shards run at once (one core each)")
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from motet.grammar.backend import GrammarTokenizer, allocate_bitmask
    from motet.grammar.cache import GrammarCache

    model_dir = args.model_dir
    if model_dir is None:
        from motet.engine.weights.model_store import pull

        model_dir = pull(progress=False)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hf_tok = AutoTokenizer.from_pretrained(model_dir)
    tok = GrammarTokenizer(hf_tok, vocab_size=cfg.get("vocab_size"))
    cache = GrammarCache(max_entries=4)
    _ = cache.backend("outlines", tok).vocabulary  # built once here, shared by every forked child
    _ = cache.backend("llguidance", tok).llg_tokenizer

    records = load_records(args.data, args.limit)
    units = [(i, c) for i in range(len(records)) for c in CONFIGS]
    ctx = {
        "records": records,
        "cache": cache,
        "tok": tok,
        "hf_tok": hf_tok,
        "timeout": args.timeout,
        "bitmask": allocate_bitmask(1, tok.vocab_size),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "backend_stderr.log"
    log_path.write_text("")
    print(f"{len(records)} schemas x {len(CONFIGS)} configs", file=sys.stderr)
    t0 = time.time()
    results = run_sharded(ctx, units, log_path, args.workers)
    elapsed = time.time() - t0
    from motet.grammar.specs import DEFAULT_BACKEND

    starts = [DEFAULT_BACKEND] + [b for b in ("xgrammar", "llguidance") if b != DEFAULT_BACKEND]
    fallbacks = {"fallback" if b == DEFAULT_BACKEND else f"{b}+fallback": fallback_order(b) for b in starts}
    for name, order in fallbacks.items():
        results += with_fallback(results, order, name)

    configs = ["xgrammar", "llguidance", "outlines", *fallbacks, "xgrammar_nonstrict"]
    by_cfg: dict[str, list[dict]] = defaultdict(list)
    by_cat: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        by_cfg[r["config"]].append(r)
        by_cat[r["category"]][r["config"]].append(r)
    gaps = {
        c: [
            {"id": r["id"], "status": r["status"], **({"error": r["error"]} if "error" in r else {})}
            | (
                {
                    "valid_rejected": sum(v and not a for v, a in r["tests"]),
                    "invalid_accepted": sum(a and not v for v, a in r["tests"]),
                }
                if r["status"] == "ok"
                else {}
            )
            for r in by_cfg[c]
            if r["status"] != "ok" or any(v != a for v, a in r["tests"])
        ]
        for c in configs
    }
    report = {
        "data": str(args.data),
        "selection": f"--limit {args.limit}, round-robin over categories" if args.limit else "all",
        "schemas": len(records),
        "instances": sum(len(r["tests"]) for r in records),
        "timeout_s": args.timeout,
        "elapsed_s": elapsed,
        "host": f"{os.cpu_count()} CPUs, {args.workers} workers",
        "tokenizer": str(model_dir),
        "configs": configs,
        "overall": {c: summarize(by_cfg[c]) for c in configs},
        "per_category": {cat: {c: summarize(per[c]) for c in configs} for cat, per in by_cat.items()},
        "gaps": gaps,
    }
    write_report(args.out, report, markdown(report), name="grammar_report")
    return report


if __name__ == "__main__":
    main()
