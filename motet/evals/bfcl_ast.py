"""BFCL's AST check: do a response's tool calls match a case's ground truth?

The Berkeley Function Calling Leaderboard (gorilla, bfcl_eval/eval_checker/ast_eval/ast_checker.py)
scores a call by comparing its name and arguments with a "possible answer": per expected call
`{func_name: {param: [allowed values...]}}`. This module follows its rules on JSON tool calls:

- the name must match, every required parameter (of the function's schema) must be present, no
  parameter may be unknown to the schema or to the answer, and a parameter the answer lists without
  `""` among its values must be given (`""` marks an optional parameter that may be omitted);
- a value must be of the declared type (BFCL's Python types: integer, float, string, boolean, array /
  tuple, dict; `any` is not checked), an int is accepted for a float; a value of the answer's type
  instead passes too (BFCL's "variable" case: the answer holds a string where a number is declared);
- strings compare after BFCL's standardization (case-insensitive, without spaces and ``,./-_*^``,
  single quotes as double quotes), here also inside lists and dicts;
- a dict parameter's answer is `{key: [allowed values...]}`, a list of dicts' answer a list of those,
  matched in order; deeper values compare recursively;
- several expected calls (the parallel categories) match the calls in any order, one to one (BFCL
  matches greedily; a full bipartite matching never rejects what a greedy one would accept);
- no ground truth (irrelevance) is correct exactly when no call is made.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_PUNCT = re.compile(r"[ ,./\-_*^]")
# BFCL's declared types (and their JSON Schema names) -> the Python type a JSON value must have.
_PY_TYPES: dict[str, type] = {
    "string": str,
    "integer": int,
    "float": float,
    "number": float,
    "boolean": bool,
    "array": list,
    "tuple": list,
    "dict": dict,
    "object": dict,
}


@dataclass
class Call:
    name: str
    arguments: Any  # the parsed JSON arguments (a dict when well formed)


def standardize(s: str) -> str:
    """BFCL's string standardization: "April 1, 2024" and "april 1 2024" compare equal."""
    return _PUNCT.sub("", s).lower().replace("'", '"')


def check(calls: list[Call], ground_truth: list[dict] | None, functions: list[dict]) -> str | None:
    """None when the calls match the ground truth, else why not."""
    if not ground_truth:
        return None if not calls else f"expected no call, got {len(calls)}"
    if len(calls) != len(ground_truth):
        return f"expected {len(ground_truth)} call(s), got {len(calls)}"
    specs = {f["name"]: f for f in functions}
    errors = [[check_call(c, expected, specs) for c in calls] for expected in ground_truth]
    if len(calls) == 1:
        return errors[0][0]
    if _perfect_matching([[e is None for e in row] for row in errors]):
        return None
    for i, row in enumerate(errors):
        if all(e is not None for e in row):  # say why, against a call of the right name if there is one
            why = next((e for e in row if not e.startswith("wrong function")), row[0])
            return f"no call matches expected call {i + 1}: {why}"
    return "the calls cannot be matched one to one with the expected calls"


def _perfect_matching(ok: list[list[bool]]) -> bool:
    """Whether every row (expected call) can be given its own column (call) with ok[row][col]."""
    owner: dict[int, int] = {}

    def assign(row: int, seen: set[int]) -> bool:
        for col, good in enumerate(ok[row]):
            if good and col not in seen:
                seen.add(col)
                if col not in owner or assign(owner[col], seen):
                    owner[col] = row
                    return True
        return False

    return all(assign(row, set()) for row in range(len(ok)))


def check_call(call: Call, expected: dict, specs: dict[str, dict]) -> str | None:
    """One call against one expected call `{func_name: {param: [allowed...]}}`."""
    ((name, answer),) = expected.items()
    if call.name != name:
        return f"wrong function: expected {name}, got {call.name}"
    if not isinstance(call.arguments, dict):
        return f"{name}: the arguments are not a JSON object"
    params = (specs.get(name) or {}).get("parameters") or {}
    props = params.get("properties") or {}
    for p in params.get("required") or []:
        if p not in call.arguments:
            return f"{name}: missing required parameter {p!r}"
    for p, value in call.arguments.items():
        if p not in props or p not in answer:
            return f"{name}: unexpected parameter {p!r}"
        if (err := check_value(value, answer[p], props[p])) is not None:
            return f"{name}.{p}: {err}"
    for p, allowed in answer.items():
        if p not in call.arguments and "" not in allowed:
            return f"{name}: missing parameter {p!r}"
    return None


def check_value(value: Any, allowed: list, schema: dict) -> str | None:
    """A parameter's value against its allowed values and declared schema; None when it passes."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    want = _PY_TYPES.get(declared) if isinstance(declared, str) else None
    if want is float and type(value) is int:
        value = float(value)
    answer_type = next((type(a) for a in allowed if a != ""), None)
    variable = want is not None and answer_type is not None and answer_type is not want
    if want is not None and type(value) is not want:
        if answer_type is None or type(value) is not answer_type:
            return f"{type(value).__name__} where {declared} is declared"
        variable = True
    if variable:  # the answer names a variable (a string) where a value is declared: compare as is
        return None if value in allowed else f"{value!r} is not among {allowed!r}"
    if want is list and (err := _check_items(value, allowed, schema)) is not None:
        return err
    if any(matches(value, a, schema) for a in allowed):
        return None
    return f"{value!r} is not among {allowed!r}"


def _check_items(value: list, allowed: list, schema: dict) -> str | None:
    """BFCL checks an array's items against the declared item type (one level deep)."""
    items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
    want = _PY_TYPES.get(items.get("type")) if isinstance(items.get("type"), str) else None
    if want is None:
        return None
    for a in allowed:
        if not isinstance(a, list):
            continue
        answer_type = next((type(x) for x in a if x != ""), None)
        if all(
            type(x) is want or (want is float and type(x) is int) or type(x) is answer_type for x in value
        ):
            return None
    return f"items are not all {items['type']}"


def matches(value: Any, answer: Any, schema: dict | None = None) -> bool:
    """One value against one allowed answer, recursively (strings standardized, numbers by value)."""
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(answer, dict):
        return isinstance(value, dict) and _matches_dict(value, answer, schema)
    if isinstance(answer, list):
        items = schema.get("items") if isinstance(schema.get("items"), dict) else None
        return (
            isinstance(value, list)
            and len(value) == len(answer)
            and all(matches(v, a, items) for v, a in zip(value, answer, strict=True))
        )
    if isinstance(answer, str):
        return isinstance(value, str) and standardize(value) == standardize(answer)
    if isinstance(answer, bool) or isinstance(value, bool):
        return type(value) is type(answer) and value == answer
    if isinstance(answer, int | float):
        return isinstance(value, int | float) and value == answer
    return value == answer


def _matches_dict(value: dict, answer: dict, schema: dict) -> bool:
    """A dict against `{key: [allowed values...]}` (BFCL's dict answers) or a literal dict."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    for key, v in value.items():
        if key not in answer:
            return False
        a = answer[key]
        as_allowed = isinstance(a, list) and any(matches(v, x, props.get(key)) for x in a)
        if not (as_allowed or matches(v, a, props.get(key))):
            return False
    return all(key in value or (isinstance(a, list) and "" in a) for key, a in answer.items())
