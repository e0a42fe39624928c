"""The report directory of a `motet eval` run, and small helpers suites share to fill it.

A run writes `results.json` (every server's results, as the suites returned them, plus how they were
obtained), `summary.md` (the suite's Markdown) and the suite's PNG plots. With two servers
(--compare-url) the Markdown and plots show both side by side: a suite may define
`compare_markdown(runs)` / `compare_plots(runs, out_dir)` over `{label: results}` (which then render a
single run too, as `{"": results}`); otherwise the Markdown gets a generic table of every numeric figure
of both runs, and each run's plots are drawn.

Suites render from the JSON round trip of their results (NaN and infinities become null), so what the
report shows is exactly what results.json holds; `fmt` prints null as a dash.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from motet.evals.context import default_data, load_records


@dataclass
class Run:
    """One server's results in a report."""

    label: str
    base_url: str
    model: str
    managed: bool
    server_args: list[str] = field(default_factory=list)
    seconds: float = 0.0
    results: dict = field(default_factory=dict)


# -- values ---------------------------------------------------------------------------------------------
def clean(obj: Any) -> Any:
    """A JSON-safe copy: non-finite floats become None, tuples lists, anything else odd its str()."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean(v) for v in obj]
    if obj is None or isinstance(obj, str | int | bool):
        return obj
    return str(obj)


def fmt(x: float | None, spec: str = ".2f", scale: float = 1.0, missing: str = "–") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return missing
    return format(x * scale, spec)


def pct(x: float | None, digits: int = 1) -> str:
    return fmt(x, f".{digits}f", 100.0) + ("%" if x is not None else "")


def rate(num: int, den: int) -> float | None:
    return num / den if den else None


def table(header: list[str], rows: list[list[str]], align: str | None = None) -> str:
    """A Markdown table; `align` is one of l/r per column (default: first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def flatten(obj: Any, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a results dict by its dotted path (lists of records are skipped)."""
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        out[prefix] = obj
    return out


# -- plots ----------------------------------------------------------------------------------------------
def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(
    ax,
    groups: list[str],
    series: dict[str, list[float | None]],
    ylabel: str,
    title: str = "",
    value_fmt: str | None = None,
    ylim: tuple[float, float] | None = None,
) -> None:
    """Bars per group, one color per series (missing values are left out)."""
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, ys, width, label=name)
        if value_fmt:
            labels = [format(v, value_fmt) if v is not None else "" for v in values]
            ax.bar_label(bars, labels=labels, fontsize=7, padding=1, rotation=90 if len(groups) > 6 else 0)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(
        groups, rotation=45 if len(groups) > 6 else 0, ha="right" if len(groups) > 6 else "center"
    )
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(axis="y", alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)


# -- suites scored per mode and category (jsonschema, bfcl) ------------------------------------------------
# Their results hold {"modes": {mode: {"overall": {...}, "categories": {category: {...}}}}}, with "n" in each.
def run_by_mode(ctx, suite: str, dataset: str, one, aggregate, count_name: str, **config) -> dict:
    """Such a suite's run: each record of the data set (--data, else the `dataset` dev set; --categories,
    --limit) asked in each of --modes by `one(client, ctx, record, mode)`, the modes interleaved so that all
    see the same server conditions; its results {"config" (with `config`), "modes" (`by_mode`), "items"}."""
    path = ctx.data or default_data(dataset)
    records = load_records(path, ctx.limit, ctx.args.categories)
    modes = list(ctx.args.modes)
    t0 = time.perf_counter()
    requests = [(ctx, r, m) for r in records for m in modes]
    items = ctx.map_requests(suite, one, requests, timeout=ctx.args.request_timeout)
    return {
        "config": {
            "data": str(path),
            count_name: len(records),
            "modes": modes,
            "model": ctx.model,
            "max_tokens": ctx.args.max_tokens,
            **config,
            "concurrency": ctx.concurrency,
            "seconds": time.perf_counter() - t0,
        },
        "modes": by_mode(items, modes, aggregate),
        "items": items,
    }


def items_failure(results: dict) -> str | None:
    """Such a suite's `failure`: every request of the run failed (a wrong model, a server that refuses all)."""
    items = results["items"]
    if items and all(i["status"] == "error" for i in items):
        return f"all {len(items)} requests failed, e.g. {items[0]['error']}"
    return None


def scored_item(record: dict, mode: str, status: str, finish: str | None, error: str, **scores) -> dict:
    """A scored item: what `by_mode` and `status_rates` read of it (the record's id and category, the mode, the
    request's status and finish reason, its error), then the suite's own `scores`."""
    common = {"id": record["id"], "category": record["category"], "mode": mode, "status": status}
    return {**common, "finish_reason": finish, "error": error, **scores}


def by_mode(items: list[dict], modes: list[str], aggregate) -> dict:
    """The scored items (each with "mode" and "category") as {mode: {"overall", "categories"}}, by `aggregate`."""
    out = {}
    for mode in modes:
        mine = [i for i in items if i["mode"] == mode]
        cats = sorted({i["category"] for i in mine})
        out[mode] = {
            "overall": aggregate(mine),
            "categories": {c: aggregate([i for i in mine if i["category"] == c]) for c in cats},
        }
    return out


def status_rates(items: list[dict]) -> dict:
    """The shares of items cut off by max_tokens and refused (unsupported, prompt too long, other errors), and
    the mean latency: the figures every such suite reports (its items' "status", "finish_reason",
    "latency_s")."""
    n = len(items)
    count = lambda pred: sum(1 for i in items if pred(i))
    latency = [i["latency_s"] for i in items if i.get("latency_s") is not None]
    return {
        "truncation_rate": rate(count(lambda i: i["finish_reason"] == "length"), n),
        "unsupported_rate": rate(count(lambda i: i["status"] == "unsupported"), n),
        "too_long_rate": rate(count(lambda i: i["status"] == "too_long"), n),
        "error_rate": rate(count(lambda i: i["status"] == "error"), n),
        "mean_latency_s": sum(latency) / len(latency) if latency else None,
    }


# The overall table's columns of `status_rates`.
STATUS_COLUMNS = {
    "truncated": lambda o: pct(o["truncation_rate"]),
    "unsupported": lambda o: pct(o["unsupported_rate"]),
    "prompt too long": lambda o: pct(o["too_long_rate"]),
    "errors": lambda o: pct(o["error_rate"]),
    "mean latency (s)": lambda o: fmt(o["mean_latency_s"]),
}


def mode_series(runs: dict[str, dict]) -> list[tuple[str, dict]]:
    """(column name, one mode's results) for every server and mode; the server's label only when comparing."""
    return [
        (f"{label} {mode}" if len(runs) > 1 else mode, res["modes"][mode])
        for label, res in runs.items()
        for mode in res["modes"]
    ]


def mode_summary(results: dict, width: int, line) -> str:
    """A by-mode suite's `summary`: a line a mode, its name padded to `width`, then `line` of its overall results."""
    return "\n".join(f"{mode:{width}s} {line(m['overall'])}" for mode, m in results["modes"].items())


def category_table(series: list[tuple[str, dict]], metric: str, count_name: str) -> str:
    """`metric` per category (rows) and series (columns), then overall."""
    cats = sorted({c for _, m in series for c in m["categories"]})
    cell = lambda m, c: (m["categories"].get(c) or {}).get(metric)
    rows = [[c, str(max((m["categories"].get(c) or {}).get("n", 0) for _, m in series)),
             *(pct(cell(m, c)) for _, m in series)] for c in cats]  # fmt: skip
    n = max(m["overall"]["n"] for _, m in series)
    rows.append(["**overall**", str(n), *(pct(m["overall"][metric]) for _, m in series)])
    return table(["category", count_name, *(name for name, _ in series)], rows)


def overall_table(series: list[tuple[str, dict]], columns: dict) -> str:
    """One row per series: `columns` maps a header to a cell of the overall results."""
    rows = [[name, *(cell(m["overall"]) for cell in columns.values())] for name, m in series]
    return table(["mode", *columns], rows)


def category_bars(series: list[tuple[str, dict]], metric: str, ylabel: str, title: str, path: Path) -> Path:
    plt = pyplot()
    cats = sorted({c for _, m in series for c in m["categories"]})
    groups = [*cats, "overall"]
    values = {
        name: [*((m["categories"].get(c) or {}).get(metric) for c in cats), m["overall"][metric]]
        for name, m in series
    }
    width = 0.55 * len(groups) + 0.12 * len(groups) * len(series)
    fig, ax = plt.subplots(figsize=(min(18, max(8, width)), 5))
    grouped_bars(ax, groups, values, ylabel, title, ylim=(0, 1.05))
    return save(fig, path)


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def failure(suite: ModuleType, results: dict) -> str | None:
    """Why a run measured nothing (its requests failed wholesale), from the suite's optional `failure`; None: it
    measured something."""
    check = getattr(suite, "failure", None)
    return check(results) if check is not None else None


# -- the report -----------------------------------------------------------------------------------------
def header(suite: str, runs: list[Run], argv: list[str]) -> str:
    lines = [
        f"# motet eval {suite}",
        "",
        f"`motet eval {shlex.join(argv)}` — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
    ]
    for r in runs:
        if not r.base_url:
            where = "in this process, no server"
        else:
            where = f"at {r.base_url}, " + ("started by motet eval" if r.managed else "a running server")
        extra = f", server args `{' '.join(r.server_args)}`" if r.server_args else ""
        lines.append(f"- **{r.label}**: model `{r.model}` ({where}{extra}); {r.seconds:.0f} s")
    return "\n".join(lines) + "\n"


def generic_compare_markdown(suite: ModuleType, runs: dict[str, dict]) -> str:
    labels = list(runs)
    flat = {label: flatten(res) for label, res in runs.items()}
    keys = list(dict.fromkeys(k for f in flat.values() for k in f))
    rows = [[f"`{k}`", *(fmt(flat[label].get(k), ".4g") for label in labels)] for k in keys]
    parts = ["## Side by side", "", table(["figure", *labels], rows)]
    for label, res in runs.items():
        parts += ["", f"## {label}", "", suite.markdown(res)]
    return "\n".join(parts)


def write(out_dir: Path, suite: ModuleType, runs: list[Run], argv: list[str]) -> str:
    """Write results.json, summary.md and the plots; return the summary to print."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in runs:
        r.results = json.loads(json.dumps(clean(r.results)))
    doc = {
        "suite": suite.NAME,
        "argv": argv,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": [asdict(r) for r in runs],
    }
    (out_dir / "results.json").write_text(json.dumps(doc, indent=1))

    # a single run renders as {"": results}: no server label in its columns
    by_label = {r.label: r.results for r in runs} if len(runs) > 1 else {"": runs[0].results}
    if hasattr(suite, "compare_markdown"):
        body = suite.compare_markdown(by_label)
    elif len(runs) == 1:
        body = suite.markdown(runs[0].results)
    else:
        body = generic_compare_markdown(suite, by_label)
    if hasattr(suite, "compare_plots"):
        pngs = suite.compare_plots(by_label, out_dir)
    elif len(runs) == 1:
        pngs = suite.plots(runs[0].results, out_dir)
    else:
        pngs = []
        for r in runs:
            sub = out_dir / _slug(r.label)
            sub.mkdir(exist_ok=True)
            pngs += suite.plots(r.results, sub)
    figures = "\n".join(f"![{p.stem}]({p.relative_to(out_dir).as_posix()})" for p in pngs)
    (out_dir / "summary.md").write_text(
        header(suite.NAME, runs, argv) + "\n" + body.rstrip() + "\n\n" + figures + "\n"
    )

    lines = []
    for r in runs:
        text = suite.summary(r.results).rstrip()
        lines.append(f"[{r.label}]\n{text}" if len(runs) > 1 else text)
    return "\n".join(lines)


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label) or "run"
