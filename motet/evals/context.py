"""What a suite gets to run with: the server to talk to, the data and limits, the report directory.

`motet eval` builds one EvalContext per server it evaluates (two with --compare-url) and hands it to the
suite's `run`. Suites talk to the server only through `base_url` (any OpenAI-compatible server), so a
suite never knows whether `motet eval` started the server itself (`managed`) or was pointed at one.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from motet.evals.datasets import dev_set_path, read_jsonl

if TYPE_CHECKING:
    import openai
    from tqdm import tqdm


@dataclass
class EvalContext:
    base_url: str  # OpenAI base URL incl. /v1, e.g. "http://127.0.0.1:8000/v1"
    model: str  # base model name to send in requests
    api_key: str | None
    data: Path | None  # --data (None: the suite's default)
    limit: int | None  # --limit
    concurrency: int  # --concurrency
    out_dir: Path  # the report directory of this run
    args: argparse.Namespace  # all parsed flags, suite-specific ones included
    managed: bool  # True when `motet eval` started the server itself
    label: str = ""  # which server this is, in progress bars and comparisons
    # the base model's checkpoint (a name or a path) where motet eval knows it: what it started its server with
    model_path: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def progress(self, total: int, desc: str) -> tqdm:
        from tqdm import tqdm

        prefix = f"[{self.label}] " if self.label else ""
        return tqdm(total=total, desc=prefix + desc, file=sys.stderr, dynamic_ncols=True, leave=False)

    def client(self, timeout: float = 600) -> openai.OpenAI:
        import openai

        return openai.OpenAI(
            base_url=self.base_url, api_key=self.api_key or "none", timeout=timeout, max_retries=0
        )

    def async_client(self, timeout: float = 600) -> openai.AsyncOpenAI:
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key or "none", timeout=timeout, max_retries=0
        )

    def map_requests(
        self, desc: str, fn: Callable[..., Awaitable], items: list[tuple], timeout: float = 600
    ) -> list:
        """`await fn(client, *item)` for every item with one async client, at most `concurrency` in flight,
        under a progress bar; the results in the items' order."""

        async def run_all() -> list:
            client = self.async_client(timeout)
            sem = asyncio.Semaphore(self.concurrency)
            bar = self.progress(len(items), desc)

            async def gated(item):
                async with sem:
                    out = await fn(client, *item)
                bar.update(1)
                return out

            try:
                return await asyncio.gather(*(gated(item) for item in items))
            finally:
                bar.close()
                await client.close()

        return asyncio.run(run_all())


def default_data(name: str) -> Path:
    """The dev set shipped with motet ("jsonschemabench" or "bfcl"), or a clear error naming --data."""
    path = dev_set_path(name)
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {path}: pass the data set with --data FILE")
    return path


def round_robin(records: list[dict], limit: int | None, key: str = "category") -> list[dict]:
    """The first `limit` records taken round-robin across `key` (all without a limit), so a small slice
    still spans every category."""
    if limit is None or limit >= len(records):
        return records
    by_key: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_key[r[key]].append(r)
    out: list[dict] = []
    for i in range(max(map(len, by_key.values()))):
        out += [by_key[k][i] for k in sorted(by_key) if i < len(by_key[k])]
    return out[:limit]


def load_records(path: Path, limit: int | None, categories: list[str] | None) -> list[dict]:
    """A data set's records (JSON Lines with a "category"), only `categories` where given, `limit` of them
    round-robin across categories."""
    records = read_jsonl(path)
    if categories:
        if unknown := set(categories) - {r["category"] for r in records}:
            raise ValueError(f"--categories: no records of {sorted(unknown)} in {path}")
        records = [r for r in records if r["category"] in categories]
    return round_robin(records, limit)


def request_failure(e: Exception) -> tuple[str, str]:
    """(status, message) of a request the server refused: "too_long" (the prompt is over the context window),
    "unsupported" (another 400), else "error"."""
    import openai

    code, message = api_error(e)
    if isinstance(e, openai.BadRequestError):
        return ("too_long" if code == "context_length_exceeded" else "unsupported"), message
    return "error", f"{type(e).__name__}: {message}"


async def chat_answer(client: openai.AsyncOpenAI, kwargs: dict) -> tuple[str, Any, str, dict]:
    """One chat completion: (status, its first choice, error message, timing). Status "ok" with the choice, or
    `request_failure`'s status and message with None; timing has the completion's tokens and the latency (an item
    of a suite scored per mode takes both, `report.status_rates` reads the latency)."""
    import openai

    t0 = time.perf_counter()
    try:
        r = await client.chat.completions.create(**kwargs)
    except openai.OpenAIError as e:
        status, message = request_failure(e)
        return status, None, message, {}
    timing = {"completion_tokens": r.usage.completion_tokens if r.usage else None}
    return "ok", r.choices[0], "", timing | {"latency_s": time.perf_counter() - t0}


def api_error(e: Exception) -> tuple[str | None, str]:
    """(code, message) of an OpenAI client error, from the server's `{"error": {...}}` body if any."""
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("error", body), dict):
        body = body.get("error", body)
        return body.get("code"), str(body.get("message") or e)[:300]
    return getattr(e, "code", None), str(e)[:300]


def add_penalty_arguments(g: argparse._ArgumentGroup) -> None:
    """Sampling penalties: greedy decoding on a small model loops (the same key or array item until
    max_tokens); a penalty is the client-side knob that breaks such loops."""
    g.add_argument("--frequency-penalty", type=float, default=None, help="OpenAI frequency_penalty")
    g.add_argument(
        "--repetition-penalty", type=float, default=None, help="vLLM's repetition_penalty (extra body)"
    )


def penalties(ctx: EvalContext, kwargs: dict) -> dict:
    """Add the penalties of add_penalty_arguments that were given to a chat request's kwargs."""
    if ctx.args.frequency_penalty is not None:
        kwargs["frequency_penalty"] = ctx.args.frequency_penalty
    if ctx.args.repetition_penalty is not None:
        kwargs["extra_body"] = {
            **kwargs.get("extra_body", {}),
            "repetition_penalty": ctx.args.repetition_penalty,
        }
    return kwargs
