"""Rendering a chat history with tools and tool calls into plain messages the chat template can take (the
Hermes format of motet/grammar/tool_calls.py: tools in the system prompt, calls as <tool_call> blocks).

A tool's result is a `tool` turn, as Hermes-2-Pro was trained on and vLLM's Hermes template writes it:

    <tool_response>
    {"name": "get_weather", "content": "Sunny."}
    </tool_response>

(the name from the call the result answers; several results of one parallel call share the turn). A small
model shown results in a user turn instead tends to begin its answer by echoing `<tool_response>`: measured
on SmolLM2-135M-Instruct, 3 of 20 sampled answers as a user turn, 0 of 20 as a tool turn. A template that
cannot write a `tool` turn (one that refuses roles other than system, user and assistant) gets a user turn.
"""

from __future__ import annotations

import functools
import json
import re

from motet import json_input
from motet.grammar.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    RESPONSE_BEGIN,
    RESPONSE_END,
    TOOLS_SYSTEM_PROMPT,
    Tool,
    tool_error,
)

# ---------------------------------------------------------------------------------------------------
# Prompt rendering


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a Jinja chat template renders `tools` itself (then pass tools to it instead)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


@functools.lru_cache(maxsize=16)
def template_renders_role(chat_template: str | None, role: str) -> bool:
    """Whether a Jinja chat template writes a turn of `role` under that name (ChatML-style templates write
    any role; others refuse the roles they do not know, or drop them)."""
    if not chat_template:
        return False
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, **_: json.dumps(value)
    asked, answered, probe = "\x01asked\x01", "\x01answered\x01", "\x01probe\x01"
    messages = [
        {"role": "user", "content": asked},
        {"role": "assistant", "content": answered},
        {"role": role, "content": probe},
    ]
    try:
        text = env.from_string(chat_template).render(messages=messages, add_generation_prompt=True)
    except Exception:  # the template's own refusal, or anything it needs that a probe does not give it
        return False
    start, end = text.find(answered), text.find(probe)
    return 0 <= start < end and role in text[start + len(answered) : end]


def tools_system_prompt(tools: list[Tool], prompt: str = TOOLS_SYSTEM_PROMPT) -> str:
    lines = "\n".join(json.dumps(t.openai_dict(), ensure_ascii=False) for t in tools)
    return prompt.format(tools=lines)


def decoded_json(text, param: str | None = None):
    """JSON text a history gives inside its JSON (a call's `arguments`, a tool result's content) as its value, read
    as a request body is (motet/json_input.py `parse`); text that is no JSON stays text (a model's malformed call
    is shown again as it wrote it); a value other than text is itself. JSON past a body's bounds (a lone surrogate
    escape such as \\ud800 parses, but no tokenizer encodes it; nesting past 64 levels) is a ToolError naming
    `param`, where the text was given; without `param` (comparing two answers' calls) it stays text too."""
    if not isinstance(text, str):
        return text
    try:
        return json_input.parse(text, "its JSON")
    except json_input.JSONBoundsError as e:
        if param is None:
            return text
        raise tool_error(param, str(e)) from None
    except ValueError:
        return text


def format_call(name: str, arguments) -> str:
    """One Hermes call block; `arguments` is the call's JSON value (`decoded_json`), or text that is no JSON."""
    args = json.dumps(arguments, ensure_ascii=False)
    return (
        f'{CALL_BEGIN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CALL_END}'
    )


def _text(content, param: str) -> str:
    """Message content as a string: None -> "", OpenAI text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise tool_error(param, "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise tool_error(param, f"expected a string or a list of text parts, got {type(content).__name__}")


def _assistant_text(msg: dict, i: int, fmt=None) -> str:
    text = _text(msg.get("content"), f"messages[{i}].content")
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise tool_error(f"messages[{i}].tool_calls", "expected a list")
    blocks = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise tool_error(f"messages[{i}].tool_calls[{j}]", "expected {'function': {'name', 'arguments'}}")
        arguments = decoded_json(
            fn.get("arguments") or {}, f"messages[{i}].tool_calls[{j}].function.arguments"
        )
        blocks.append((fn["name"], arguments))
    if fmt is None:  # Hermes
        blocks = [format_call(name, args) for name, args in blocks]
    else:
        blocks = [fmt.calls_text(blocks)] if blocks else []
    return "\n".join([text, *blocks] if text else blocks)  # Qwen2.5: content, then "\n" + each call


def _tool_result(msg: dict, i: int, names: dict) -> str:
    """One result as a `<tool_response>` block naming its tool (the message's `name`, else the name of the
    call its `tool_call_id` answers); JSON objects and arrays are shown as JSON, other text as a string."""
    text = _text(msg.get("content"), f"messages[{i}].content")
    value = decoded_json(text, f"messages[{i}].content")
    result = value if isinstance(value, dict | list) else text
    name = msg.get("name") if isinstance(msg.get("name"), str) else names.get(msg.get("tool_call_id"))
    body = ({"name": name} if name else {}) | {"content": result}
    return f"{RESPONSE_BEGIN}\n{json.dumps(body, ensure_ascii=False)}\n{RESPONSE_END}"


def _call_names(messages: list) -> dict:
    """tool_call_id -> the name of the function it called, from the assistant messages' calls."""
    names = {}
    for msg in messages:
        calls = msg.get("tool_calls") if isinstance(msg, dict) else None
        for call in calls if isinstance(calls, list) else []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(call.get("id"), str):
                names[call["id"]] = fn["name"]
    return names


def render_messages(messages: list[dict], tools: list[Tool], tool_role: str = "tool", fmt=None) -> list[dict]:
    """Rewrite an OpenAI history (tool calls, tool results) into plain role/content messages for a
    template without tool support: results in turns of `tool_role` ("user" where the template cannot
    write a tool turn: `template_renders_role`); with tools, their system prompt is prepended
    (after the user's own system message text when there is one). `fmt`: the tool-call format
    (motet/grammar/tool_formats/) whose calls and system prompt are written; None: Hermes. Results
    are `<tool_response>` blocks in every format."""
    out: list[dict] = []
    prev_tool = False
    names = _call_names(messages)
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise tool_error(f"messages[{i}]", "expected an object")
        role = msg.get("role")
        if role == "tool":
            block = _tool_result(msg, i, names)
            if prev_tool:  # consecutive results (one parallel call's) share one turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": tool_role, "content": block})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_text(msg, i, fmt)})
        else:
            out.append({"role": role, "content": _text(msg.get("content"), f"messages[{i}].content")})
        prev_tool = role == "tool"
    if tools:
        prompt = tools_system_prompt(tools, TOOLS_SYSTEM_PROMPT if fmt is None else fmt.system_prompt)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def template_messages(
    messages: list[dict], tools: list[Tool], fmt, chat_template: str | None, trusted_template: bool = True
) -> tuple[list[dict], dict]:
    """The messages a chat template is given for an OpenAI history, and extra template arguments: the history
    as it is with the tools where the template renders tools itself, else rewritten by `render_messages` in the
    tool-call format `fmt` (tools in the system prompt, calls as the model writes them). What serving renders for
    a request (motet/grammar/structure.py) and what training renders for an example (motet/training/) alike.
    `trusted_template`: the template is the operator's (the model's own), which may be rendered here to find
    whether it writes a `tool` turn; a request's own template renders only in its bounded helper
    (motet/engine/template_worker.py), so its tool results go in a user turn. ToolError: a malformed history."""
    if template_supports_tools(chat_template):
        return messages, ({"tools": [t.openai_dict() for t in tools]} if tools else {})
    has_results = any(isinstance(m, dict) and m.get("role") == "tool" for m in messages)
    probe = has_results and trusted_template
    tool_role = "tool" if probe and template_renders_role(chat_template, "tool") else "user"
    return render_messages(messages, tools, tool_role, fmt), {}
