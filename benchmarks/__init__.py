"""How the project measures itself: benchmarks against peers (HF transformers, llama.cpp's server), studies
and their reports (benchmarks/reports/). Not installed with motet; run from the repository root as
`python -m benchmarks.NAME`. What users run is `motet eval` (motet/evals/)."""

import json
from pathlib import Path


def write_report(out: Path, report: dict, summary: str, name: str | None = None) -> None:
    """A benchmark's report: results.json and summary.md under `out`, the summary printed. With `name`,
    NAME.json and NAME.md instead (reports that share a folder: the GPU machine's $OUT)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name or 'results'}.json").write_text(json.dumps(report, indent=2))
    (out / f"{name or 'summary'}.md").write_text(summary)
    print(summary)
    print(f"report: {out}")


def chat_body(model: str, content: str, max_tokens: int, **extra) -> dict:
    """A streamed chat request of one user message with a fixed output length (greedy, ignore_eos): the chat
    twin of motet.evals.serving_bench.completion_body. `extra`: more fields (logprobs=True)."""
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **extra}  # fmt: skip


def nearest_rank(values: list[float], q: float) -> float | None:
    """The `q` quantile of `values` by nearest rank (one of the values, not interpolated; None when empty)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]
