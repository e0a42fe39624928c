"""BFCL tool calling: valid calls and AST accuracy per category, `required` vs `auto`, constrained or not.

Each case of the data set (`--data`, JSON Lines `{id, category, question, function, ground_truth}`; default
the BFCL dev set shipped in motet/evals/data) is sent as one chat request with the case's functions as
OpenAI tools, greedy, in three modes:

- `required`: tool_choice "required" (the server constrains the output to calls of the tools);
- `auto`: tool_choice "auto", calls constrained once the model starts one;
- `auto-unconstrained`: tool_choice "auto" with the motet extension `guided_tool_calls: false` (calls are
  parsed from the text but never constrained).

Per mode, overall and per category: the call rate; validity (the response carries tool calls, each of a
known tool with JSON-object arguments that validate against the tool's normalized schema); AST accuracy
against the ground truth, BFCL's way (motet/evals/bfcl_ast.py; irrelevance cases are right with no call);
unsupported requests (HTTP 400), prompts over the context window, and errors. BFCL's parameter schemas
say "dict", "float", ...: the server normalizes them; --send-normalized sends JSON Schema types instead
(for servers that do not).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from motet.evals import report
from motet.evals.bfcl_ast import Call, check
from motet.evals.context import (
    EvalContext,
    add_penalty_arguments,
    chat_answer,
    penalties,
)

NAME = "bfcl"
NEEDS_SERVER = True
MODES = {
    "required": {"tool_choice": "required"},
    "auto": {"tool_choice": "auto"},
    "auto-unconstrained": {"tool_choice": "auto", "extra_body": {"guided_tool_calls": False}},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bfcl options")
    g.add_argument("--max-tokens", type=int, default=384, help="completion budget per request")
    g.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    g.add_argument("--categories", nargs="+", default=None, help="only these categories")
    g.add_argument("--send-normalized", action="store_true", help="send JSON Schema types, not BFCL's")
    g.add_argument(
        "--parallel-tool-calls",
        choices=["unset", "true", "false", "by-category"],
        default="unset",
        help="send parallel_tool_calls (unset: the server's default; by-category: true for BFCL's parallel "
        "categories, false for the others, where the ground truth is one call)",
    )
    g.add_argument(
        "--max-tool-calls",
        type=int,
        default=None,
        help="send max_tool_calls (the calls one response may hold) with parallel_tool_calls true",
    )
    add_penalty_arguments(g)
    g.add_argument("--request-timeout", type=float, default=600, help="seconds per request")


# -- scoring --------------------------------------------------------------------------------------------
def _normalized(schema: dict) -> tuple[dict | None, str]:
    from motet.grammar.schema_normalize import normalize_schema
    from motet.grammar.specs import GrammarError

    try:
        return normalize_schema(schema or {"type": "object"}), ""
    except GrammarError as e:
        return None, str(e)


def tool_call_validity(calls: list[dict], functions: dict[str, dict]) -> str | None:
    """None when every call names a known tool with a JSON object that its normalized schema accepts."""
    import jsonschema
    from jsonschema.validators import validator_for

    for c in calls:
        spec = functions.get(c["name"])
        if spec is None:
            return f"unknown tool {c['name']!r}"
        if not isinstance(c["arguments"], dict):
            return f"{c['name']}: arguments are not a JSON object"
        schema, why = _normalized(spec.get("parameters") or {})
        if schema is None:
            return f"{c['name']}: unusable schema: {why}"
        try:
            error = jsonschema.exceptions.best_match(
                validator_for(schema)(schema).iter_errors(c["arguments"])
            )
        except Exception as e:  # a schema the validator cannot use
            return f"{c['name']}: validator: {type(e).__name__}: {e}"
        if error is not None:
            return f"{c['name']}: {error.message[:200]}"
    return None


def parse_calls(tool_calls) -> list[dict]:
    """OpenAI tool calls -> [{name, arguments (parsed, or None when not JSON), raw}]."""
    out = []
    for tc in tool_calls or []:
        raw = tc.function.arguments or ""
        try:
            args = json.loads(raw) if raw.strip() else {}
        except ValueError:
            args = None
        out.append({"name": tc.function.name, "arguments": args, "raw": raw[:300]})
    return out


def score(
    record: dict, mode: str, status: str, finish=None, calls=(), content: str = "", error: str = ""
) -> dict:
    calls = list(calls)
    functions = {f["name"]: f for f in record["function"]}
    item = report.scored_item(
        record,
        mode,
        status,
        finish,
        error,
        called=bool(calls),
        n_calls=len(calls),
        valid=False,
        ast=False,
        calls=calls,
        content=content[:300],
    )
    if status != "ok":
        return item
    validity = tool_call_validity(calls, functions) if calls else "no tool call"
    item["valid"] = validity is None
    ast = check([Call(c["name"], c["arguments"]) for c in calls], record["ground_truth"], record["function"])
    item["ast"] = ast is None
    item["validity_error"], item["ast_error"] = validity, ast
    return item


# -- running --------------------------------------------------------------------------------------------
def tools_of(record: dict, normalized: bool) -> list[dict]:
    tools = []
    for f in record["function"]:
        params = f.get("parameters") or {"type": "object", "properties": {}}
        if normalized:
            params = _normalized(params)[0] or params
        fn = {"name": f["name"], "description": f.get("description", ""), "parameters": params}
        tools.append({"type": "function", "function": fn})
    return tools


async def _one(client, ctx: EvalContext, record: dict, mode: str) -> dict:
    kwargs = {
        "model": ctx.model,
        "messages": record["question"][0],
        "tools": tools_of(record, ctx.args.send_normalized),
        "max_tokens": ctx.args.max_tokens,
        "temperature": 0,
        **MODES[mode],
    }
    if ctx.args.parallel_tool_calls == "by-category":
        kwargs["parallel_tool_calls"] = "parallel" in record["category"]
    elif ctx.args.parallel_tool_calls != "unset":
        kwargs["parallel_tool_calls"] = ctx.args.parallel_tool_calls == "true"
    if ctx.args.max_tool_calls is not None and kwargs.get("parallel_tool_calls", True):
        kwargs["extra_body"] = {**kwargs.get("extra_body", {}), "max_tool_calls": ctx.args.max_tool_calls}
    penalties(ctx, kwargs)
    status, choice, error, timing = await chat_answer(client, kwargs)
    if choice is None:
        return score(record, mode, status, error=error)
    calls = parse_calls(choice.message.tool_calls)
    return score(record, mode, status, choice.finish_reason, calls, choice.message.content or "") | timing


def aggregate(items: list[dict]) -> dict:
    n = len(items)
    count = lambda pred: sum(1 for i in items if pred(i))
    called = count(lambda i: i["called"])
    valid = count(lambda i: i["valid"])
    finished = [i for i in items if i["status"] == "ok" and i["finish_reason"] != "length"]
    return {
        "n": n,
        "call_rate": report.rate(called, n),
        "validity": report.rate(valid, n),  # responses with calls, all of them valid
        "validity_of_called": report.rate(valid, called),
        # of the responses that ended on their own (not cut by max_tokens): the grammar's share
        "validity_of_finished": report.rate(sum(i["valid"] for i in finished), len(finished)),
        "ast_correct": count(lambda i: i["ast"]),
        "ast_accuracy": report.rate(count(lambda i: i["ast"]), n),
        **report.status_rates(items),
    }


def run(ctx: EvalContext) -> dict:
    return report.run_by_mode(
        ctx, "bfcl", "bfcl", _one, aggregate, "cases", max_tool_calls=ctx.args.max_tool_calls
    )


failure = report.items_failure


# -- reporting ------------------------------------------------------------------------------------------
OVERALL = {
    "cases": lambda o: str(o["n"]),
    "AST accuracy": lambda o: report.pct(o["ast_accuracy"]),
    "valid": lambda o: report.pct(o["validity"]),
    "valid of called": lambda o: report.pct(o["validity_of_called"]),
    "valid of finished": lambda o: report.pct(o.get("validity_of_finished")),
    "call rate": lambda o: report.pct(o["call_rate"]),
    **report.STATUS_COLUMNS,
}
VALIDITY = {"validity": "valid", "validity_of_called": "valid of called",
            "validity_of_finished": "valid of finished", "call_rate": "call rate",
            "ast_accuracy": "AST accuracy"}  # fmt: skip


def compare_markdown(runs: dict[str, dict]) -> str:
    series = report.mode_series(runs)
    cfg = next(iter(runs.values()))["config"]
    return "\n".join(
        [
            f"BFCL slice: {cfg['cases']} cases from `{cfg['data']}`, greedy, max {cfg['max_tokens']} tokens, "
            + (f"at most {cfg['max_tool_calls']} calls per response, " if cfg.get("max_tool_calls") else "")
            + f"{cfg['concurrency']} requests in flight.",
            "",
            "## AST accuracy per category",
            "",
            report.category_table(series, "ast_accuracy", "cases"),
            "",
            "## Overall",
            "",
            "Valid: the response carries tool calls and each names a tool with arguments its schema accepts "
            "(share of all responses, of those with calls, and of those not cut off by max_tokens).",
            "",
            report.overall_table(series, OVERALL),
        ]
    )


def compare_plots(runs: dict[str, dict], out_dir: Path) -> list[Path]:
    series = report.mode_series(runs)
    paths = [report.category_bars(series, "ast_accuracy", "AST accuracy", "BFCL AST accuracy per category",
                                  out_dir / "bfcl_ast_accuracy.png")]  # fmt: skip
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    values = {name: [m["overall"].get(k) for k in VALIDITY] for name, m in series}
    report.grouped_bars(ax, list(VALIDITY.values()), values, "share of responses", "BFCL tool calls per mode",
                        value_fmt=".2f", ylim=(0, 1.1))  # fmt: skip
    paths.append(report.save(fig, out_dir / "bfcl_validity.png"))
    return paths


def summary(results: dict) -> str:
    return report.mode_summary(
        results,
        18,
        lambda o: (
            f"AST {report.pct(o['ast_accuracy'])}, valid {report.pct(o['validity'])} "
            f"({report.pct(o.get('validity_of_finished'))} of finished, {report.pct(o['truncation_rate'])} "
            f"truncated), calls {report.pct(o['call_rate'])}, unsupported {report.pct(o['unsupported_rate'])}, "
            f"errors {report.pct(o['error_rate'])}"
        ),
    )
