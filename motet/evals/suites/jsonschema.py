"""JSONSchemaBench: does the server's output comply with a JSON schema, constrained and unconstrained?

For each schema of the data set (`--data`, JSON Lines `{id, category, schema, tests}`; default the dev set
the JSONSchemaBench dev set shipped in motet/evals/data) one chat request asks for a JSON value matching the schema (the
schema is in the prompt), twice: constrained (`response_format` json_schema, strict) and unconstrained
(no response_format; the first JSON value in the text is taken). Greedy decoding, --max-tokens tokens.

Per category and overall, for each mode: compliance (the output finished, `finish_reason` "stop", and
validates against the schema, formats checked), the same among finished outputs, truncation rate
(`finish_reason` "length"), unsupported-schema rate (HTTP 400 from the server), prompts over the context
window (400 context_length_exceeded), and other errors. With --limit, schemas are taken round-robin
across categories so a small slice still spans them.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from motet.evals import report
from motet.evals.context import (
    EvalContext,
    add_penalty_arguments,
    chat_answer,
    penalties,
)

NAME = "jsonschema"
NEEDS_SERVER = True
MODES = ("constrained", "unconstrained")
PROMPT = (
    "Generate a JSON value that conforms to the following JSON Schema. Reply with the JSON only, "
    "no explanation.\n\nJSON Schema:\n{schema}"
)
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("jsonschema options")
    g.add_argument("--max-tokens", type=int, default=384, help="completion budget per request")
    g.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    g.add_argument("--categories", nargs="+", default=None, help="only these categories")
    g.add_argument("--request-timeout", type=float, default=600, help="seconds per request")
    add_penalty_arguments(g)


# -- scoring --------------------------------------------------------------------------------------------
def extract_json(text: str):
    """The first JSON value in free text: the whole text, a ```json fence, or from the first { or [."""
    decoder = json.JSONDecoder()
    stripped = text.strip()
    candidates = [stripped, *(m.group(1).strip() for m in _FENCE.finditer(text))]
    for c in candidates:
        try:
            return True, json.loads(c)
        except ValueError:
            pass
    for i, ch in enumerate(text):
        if ch in "{[":
            try:
                return True, decoder.raw_decode(text, i)[0]
            except ValueError:
                continue
    return False, None


def validate(schema: dict, instance) -> tuple[bool, str]:
    """(valid, why not) with the schema's own draft and format checking; an unusable schema is invalid."""
    from jsonschema.validators import validator_for

    try:
        cls = validator_for(schema)
        errors = list(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(instance))
    except Exception as e:  # unresolvable $ref, a schema the library cannot use
        return False, f"validator: {type(e).__name__}: {str(e)[:160]}"
    return (not errors), (errors[0].message[:200] if errors else "")


def score(record: dict, mode: str, status: str, finish: str | None, text: str, error: str = "") -> dict:
    item = report.scored_item(
        record, mode, status, finish, error, parsed=False, valid=False, compliant=False, text=text[:300]
    )
    if status != "ok":
        return item
    if mode == "constrained":
        try:
            item["parsed"], value = True, json.loads(text)
        except ValueError:
            value = None
    else:
        item["parsed"], value = extract_json(text)
    if item["parsed"]:
        item["valid"], why = validate(record["schema"], value)
        if not item["valid"]:
            item["error"] = why
    item["compliant"] = item["valid"] and finish == "stop"
    return item


# -- running --------------------------------------------------------------------------------------------
def request_kwargs(ctx: EvalContext, record: dict, mode: str) -> dict:
    schema_text = json.dumps(record["schema"], separators=(",", ":"))
    kwargs = {
        "model": ctx.model,
        "messages": [{"role": "user", "content": PROMPT.format(schema=schema_text)}],
        "max_tokens": ctx.args.max_tokens,
        "temperature": 0,
    }
    if mode == "constrained":
        kwargs["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": record["schema"], "strict": True},
        }
    return penalties(ctx, kwargs)


async def _one(client, ctx: EvalContext, record: dict, mode: str) -> dict:
    status, choice, error, timing = await chat_answer(client, request_kwargs(ctx, record, mode))
    if choice is None:
        return score(record, mode, status, None, "", error)
    return score(record, mode, status, choice.finish_reason, choice.message.content or "") | timing


def aggregate(items: list[dict]) -> dict:
    n = len(items)
    finished = sum(1 for i in items if i["status"] == "ok" and i["finish_reason"] == "stop")
    compliant = sum(1 for i in items if i["compliant"])
    tokens = [i["completion_tokens"] for i in items if i.get("completion_tokens") is not None]
    return {
        "n": n,
        "compliant": compliant,
        "compliance": report.rate(compliant, n),
        "compliance_of_finished": report.rate(compliant, finished),
        "finished": finished,
        "mean_completion_tokens": sum(tokens) / len(tokens) if tokens else None,
        **report.status_rates(items),
    }


def run(ctx: EvalContext) -> dict:
    return report.run_by_mode(ctx, "jsonschema", "jsonschemabench", _one, aggregate, "schemas")


failure = report.items_failure


# -- reporting ------------------------------------------------------------------------------------------
OVERALL = {
    "schemas": lambda o: str(o["n"]),
    "compliance": lambda o: report.pct(o["compliance"]),
    "of finished": lambda o: report.pct(o["compliance_of_finished"]),
    "mean tokens": lambda o: report.fmt(o["mean_completion_tokens"], ".0f"),
    **report.STATUS_COLUMNS,
}


def compare_markdown(runs: dict[str, dict]) -> str:
    series = report.mode_series(runs)
    cfg = next(iter(runs.values()))["config"]
    return "\n".join(
        [
            f"JSONSchemaBench slice: {cfg['schemas']} schemas from `{cfg['data']}`, greedy, "
            f"max {cfg['max_tokens']} tokens, {cfg['concurrency']} requests in flight.",
            "",
            "## Compliance per category (finished and valid)",
            "",
            report.category_table(series, "compliance", "schemas"),
            "",
            "## Overall",
            "",
            report.overall_table(series, OVERALL),
        ]
    )


def compare_plots(runs: dict[str, dict], out_dir: Path) -> list[Path]:
    series = report.mode_series(runs)
    title = "JSONSchemaBench compliance per category"
    return [report.category_bars(series, "compliance", "compliance (finished and valid)", title,
                                 out_dir / "jsonschema_compliance.png")]  # fmt: skip


def summary(results: dict) -> str:
    return report.mode_summary(
        results,
        13,
        lambda o: (
            f"compliance {report.pct(o['compliance'])} ({o['compliant']}/{o['n']}), "
            f"truncated {report.pct(o['truncation_rate'])}, unsupported {report.pct(o['unsupported_rate'])}, "
            f"too long {report.pct(o['too_long_rate'])}, errors {report.pct(o['error_rate'])}"
        ),
    )
