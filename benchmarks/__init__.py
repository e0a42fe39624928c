"""How the project measures itself: benchmarks against peers (HF transformers, llama.cpp's server), studies
and their reports (benchmarks/reports/). Not installed with motet; run from the repository root as
`python -m benchmarks.NAME`. What users run is `motet eval` (motet/evals/)."""

import json
from pathlib import Path

from motet.evals.serving_bench import GREEDY


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
            **GREEDY, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **extra}  # fmt: skip


def nearest_rank(values: list[float], q: float) -> float | None:
    """The `q` quantile of `values` by nearest rank (one of the values, not interpolated; None when empty)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# The CPU flags that decide which kernels (motet's, torch's oneDNN, vLLM's, llama.cpp's) run bf16 and int8 in
# hardware (/proc/cpuinfo's and lscpu's names).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


def cpu_info() -> dict:
    """The CPU as lscpu names it (/proc/cpuinfo's model name where lscpu is missing), its logical CPUs, and which
    of CPU_FLAGS it has."""
    import os
    import shutil
    import subprocess

    model, flags = None, set()
    if shutil.which("lscpu"):
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}
        ).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name" and model is None:
                model = value.strip()
            elif key.strip() == "Flags":
                flags = set(value.split())
    cpuinfo = Path("/proc/cpuinfo")
    if (model is None or not flags) and cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return {"model": model, "cpus": os.cpu_count(), "flags": {f: f in flags for f in CPU_FLAGS}}


def cpu_line(info: dict) -> str:
    """cpu_info() in one line: the model, the CPUs and the flags it has and lacks."""
    have = [f for f, on in info["flags"].items() if on]
    lacks = [f for f, on in info["flags"].items() if not on]
    return (
        f"{info['model']}, {info['cpus']} CPUs; has {', '.join(have) or 'none'} of these flags; "
        f"lacks {', '.join(lacks) or 'none'}"
    )
