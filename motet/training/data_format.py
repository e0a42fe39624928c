"""Training files in OpenAI's fine-tuning formats, read line by line and checked before anything is trained.

Supervised (`method` "supervised"): one chat a line,

    {"messages": [{"role": "system" | "developer" | "user" | "assistant" | "tool", "content": ...}, ...],
     "tools": [...], "parallel_tool_calls": true}

an assistant message may carry `tool_calls` and a `weight` (0: not trained on, 1: trained on, the default); at
least one assistant message is trained on. Preference pairs (`method` "dpo"):

    {"input": {"messages": [...], "tools": [...]},
     "preferred_output": [{"role": "assistant", ...}], "non_preferred_output": [{"role": "assistant", ...}]}

Every refusal is a `DataError` naming the line (from 1) and what to fix, as OpenAI's file validation does. What a
line may hold is bounded before it is parsed: at most `max_line_bytes` bytes (a line that long could not fit the
context anyway); then it is read as a request body is (motet/json_input.py): no NaN or Infinity, nesting within
its depth, and text that is valid Unicode (a lone surrogate escape such as \\ud800 is JSON, but no tokenizer
encodes it), the error naming the field (`messages[0].content`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from motet import json_input
from motet.grammar.tool_calls import Tool, ToolError, check_name, validate_tools

METHODS = ("supervised", "dpo")
ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "weight"}
_CHAT_KEYS = {"messages", "tools", "parallel_tool_calls"}
_PAIR_KEYS = {"input", "preferred_output", "non_preferred_output"}
MAX_CHARS_PER_TOKEN = 32  # as the serving checks read a prompt (motet/engine/request_checks.py)


class DataError(ValueError):
    """A training file that cannot be trained on: `line` (from 1; None: the file as a whole) and the reason."""

    def __init__(self, message: str, line: int | None = None):
        super().__init__(f"Line {line}: {message}" if line is not None else message)
        self.line, self.reason = line, message


@dataclass
class ChatExample:
    """A supervised example: its messages (as the file has them, `weight` taken out), tools, and which of its
    assistant messages are trained on (one bool per assistant message, in order)."""

    line: int
    messages: list[dict]
    tools: list[Tool] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)


@dataclass
class PreferenceExample:
    """A DPO pair: the conversation so far, and the preferred and the other answer (one assistant message each)."""

    line: int
    messages: list[dict]
    preferred: dict
    non_preferred: dict
    tools: list[Tool] = field(default_factory=list)


Example = ChatExample | PreferenceExample


def max_line_bytes(max_model_len: int) -> int:
    """The longest line an example that fits a context of `max_model_len` tokens can take (with room for the
    JSON around its text: escapes, keys)."""
    return max_model_len * MAX_CHARS_PER_TOKEN * 2


def read_examples(source: BinaryIO, method: str, max_bytes: int, max_examples: int) -> Iterator[Example]:
    """The file's examples in order (blank lines skipped); DataError at the first line that is not one."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, not {method!r}")
    number = count = 0
    while True:
        raw = source.readline(max_bytes + 1)
        if not raw:
            break
        number += 1
        if len(raw) > max_bytes and not raw.endswith(b"\n"):
            raise DataError(
                f"the line is longer than {max_bytes} bytes, more than an example that fits the model's context "
                "can take",
                number,
            )
        if not raw.strip():
            continue
        count += 1
        if count > max_examples:
            raise DataError(f"the file holds more than {max_examples} examples, the most a job may train on")
        value = parse_line(raw, number)
        yield chat_example(value, number) if method == "supervised" else preference_example(value, number)
    if count == 0:
        raise DataError("the file holds no examples")


def parse_line(raw: bytes, number: int) -> dict:
    """The line's object, read with a request body's bounds (motet/json_input.py): no NaN or Infinity, nesting
    within MAX_DEPTH levels, and text that is valid Unicode (a lone surrogate escape parses, but no tokenizer
    can encode it)."""
    value = _json(raw, "the line", number)
    if not isinstance(value, dict):
        raise DataError(f"expected a JSON object, got {_kind(value)}", number)
    return value


def _json(text: bytes | str, what: str, number: int):
    """`text` parsed and checked as motet/json_input.py reads a request body; a DataError naming `what` and
    where in it, otherwise."""
    try:
        return json_input.parse(text, what)
    except json_input.JSONBoundsError as e:  # "WHAT is nested ...", "WHAT holds invalid Unicode ... at x"
        at = f" (at {_brief(e.param)})" if e.param and e.param not in str(e) else ""
        raise DataError(f"{e}{at}", number) from None
    except ValueError as e:  # "WHAT is not valid JSON: ..."
        raise DataError(str(e), number) from None


def _chat(value: dict, prefix: str, number: int) -> tuple[list[Tool], list[dict]]:
    """A chat's fields (messages, tools, parallel_tool_calls) checked: its tools and messages. `prefix`: where the
    chat stands in the line ("" for a supervised example, "input." for a preference pair's input), for the errors."""
    _known_keys(value, _CHAT_KEYS, prefix, number)
    if "messages" not in value:
        raise DataError(f"missing the `{prefix}messages` key", number)
    tools = _tools(value.get("tools"), f"{prefix}tools", number)
    _parallel(value, f"{prefix}parallel_tool_calls", number)
    return tools, _messages(value["messages"], f"{prefix}messages", number)


def chat_example(value: dict, number: int) -> ChatExample:
    if "input" in value and "messages" not in value:
        raise DataError('a preference pair: supervised fine-tuning reads chats ({"messages": [...]})', number)
    tools, messages = _chat(value, "", number)
    trained = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            weight = m.pop("weight", 1)
            if weight not in (0, 1) or isinstance(weight, bool):
                raise DataError(f"messages[{i}].weight must be 0 or 1, not {_shown(weight)}", number)
            trained.append(weight == 1)
        elif "weight" in m:
            raise DataError(f"messages[{i}].weight: only assistant messages have a weight", number)
    if not trained:
        raise DataError("no assistant message: an example needs at least one to train on", number)
    if not any(trained):
        raise DataError("every assistant message has weight 0: nothing to train on", number)
    return ChatExample(number, messages, tools, trained)


def preference_example(value: dict, number: int) -> PreferenceExample:
    if "messages" in value and "input" not in value:
        raise DataError(
            "a chat: DPO reads preference pairs (input, preferred_output, non_preferred_output)", number
        )
    _known_keys(value, _PAIR_KEYS, "", number)
    for key in ("input", "preferred_output", "non_preferred_output"):
        if key not in value:
            raise DataError(f"missing the `{key}` key", number)
    given = value["input"]
    if not isinstance(given, dict):
        raise DataError(f"input must be an object, got {_kind(given)}", number)
    tools, messages = _chat(given, "input.", number)
    if messages[-1]["role"] == "assistant":
        raise DataError("input.messages ends with an assistant message: the outputs are the answers", number)
    if any("weight" in m for m in messages):
        raise DataError("input.messages: weights are for supervised examples", number)
    outputs = {}
    for key in ("preferred_output", "non_preferred_output"):
        out = value[key]
        if not isinstance(out, list) or len(out) != 1:
            raise DataError(f"{key} must be a list of one assistant message", number)
        (message,) = _messages(out, key, number)
        if message["role"] != "assistant" or "weight" in message:
            raise DataError(f"{key}[0] must be an assistant message (without a weight)", number)
        outputs[key] = message
    if outputs["preferred_output"] == outputs["non_preferred_output"]:
        raise DataError("preferred_output and non_preferred_output are the same answer", number)
    return PreferenceExample(
        number, messages, outputs["preferred_output"], outputs["non_preferred_output"], tools
    )


# -- the parts ---------------------------------------------------------------------------------------------------
def _messages(value, where: str, number: int) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"{where} must be a non-empty list of messages", number)
    out = []
    calls: list[str] = []  # the ids of the calls made so far, which a tool message answers
    for i, m in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{at} must be an object, got {_kind(m)}", number)
        _known_keys(m, _MESSAGE_KEYS, f"{at}.", number)
        role = m.get("role")
        if role not in ROLES:
            raise DataError(f"{at}.role: unknown role {_shown(role)} (one of {', '.join(ROLES)})", number)
        content = m.get("content")
        if role == "assistant" and m.get("tool_calls"):
            calls += _tool_calls(m["tool_calls"], f"{at}.tool_calls", number)
            if content is not None:
                _text(content, f"{at}.content", number)
        elif content is None:
            raise DataError(f"{at} has no content", number)
        else:
            _text(content, f"{at}.content", number)
        if "tool_calls" in m and role != "assistant":
            raise DataError(f"{at}.tool_calls: only assistant messages call tools", number)
        if role == "tool":
            _answered(m, calls, at, number)
        if "name" in m and not isinstance(m["name"], str):
            raise DataError(f"{at}.name must be a string", number)
        out.append(dict(m))
    return out


def _text(content, where: str, number: int) -> None:
    if isinstance(content, str):
        return
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return
    raise DataError(f"{where} must be a string or a list of text parts", number)


def _tool_calls(calls, where: str, number: int) -> list[str]:
    """The calls checked (each function's name by the rule of a tool's name, which serving's formats write and
    parse back: motet/grammar/tool_calls.py `check_name`); their ids."""
    if not isinstance(calls, list):
        raise DataError(f"{where} must be a list", number)
    ids = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(f"{where}[{j}] must be {{'function': {{'name', 'arguments'}}}}", number)
        try:
            check_name(fn["name"], f"{where}[{j}].function.name")
        except ToolError as e:
            raise DataError(str(e), number) from None
        if "id" in call:
            if not isinstance(call["id"], str):
                raise DataError(f"{where}[{j}].id must be a string", number)
            ids.append(call["id"])
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):  # JSON in a string: read as the line is
            arguments = _json(arguments, f"{where}[{j}].function.arguments", number)
        if not isinstance(arguments, dict):
            raise DataError(f"{where}[{j}].function.arguments must be a JSON object", number)
    return ids


def _answered(message: dict, calls: list[str], at: str, number: int) -> None:
    """A tool message answers a call made before it: its `tool_call_id` is one of `calls` (the ids so far), or,
    without one, it names its tool (`name`)."""
    answered = message.get("tool_call_id")
    if answered is None and isinstance(message.get("name"), str):
        return
    if not isinstance(answered, str):
        raise DataError(f"{at}: a tool message needs the `tool_call_id` of the call it answers", number)
    if answered not in calls:
        made = (
            f"the calls before it: {_brief(', '.join(map(json.dumps, calls)), 80)}"
            if calls
            else "no call before it"
        )
        raise DataError(f"{at}.tool_call_id: {_shown(answered)} answers no call ({made})", number)


def _tools(value, where: str, number: int) -> list[Tool]:
    if value is None:
        return []
    try:
        return validate_tools(value)
    except ToolError as e:
        raise DataError(f"{where}: {e}", number) from None


def _parallel(value: dict, where: str, number: int) -> None:
    if "parallel_tool_calls" in value and not isinstance(value["parallel_tool_calls"], bool):
        raise DataError(f"{where} must be true or false", number)


def _known_keys(value: dict, known: set[str], prefix: str, number: int) -> None:
    if unknown := sorted(set(value) - known):
        raise DataError(
            f"unknown key `{prefix}{_brief(unknown[0])}` (expected {', '.join(sorted(known))})", number
        )


def _kind(value) -> str:
    kinds = {list: "a list", str: "a string", dict: "an object", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def _shown(value) -> str:
    return _brief(json.dumps(value))


def _brief(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."
