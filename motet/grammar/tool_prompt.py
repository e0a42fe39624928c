"""Rendering a chat history with tools and tool calls into plain messages the chat template can take (the
Hermes format of motet/grammar/tool_calls.py: tools in the system prompt, calls as <tool_call> blocks, results as
<tool_response> blocks in a user turn)."""

from __future__ import annotations

import contextlib
import json
import re

from motet.grammar.tool_calls import CALL_BEGIN, CALL_END, TOOLS_SYSTEM_PROMPT, Tool, tool_error

# ---------------------------------------------------------------------------------------------------
# Prompt rendering


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a Jinja chat template renders `tools` itself (then pass tools to it instead)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def tools_system_prompt(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps(t.openai_dict(), ensure_ascii=False) for t in tools)
    return TOOLS_SYSTEM_PROMPT.format(tools=lines)


def format_call(name: str, arguments) -> str:
    """One Hermes call block; `arguments` is a dict or its JSON text (kept as a string if not JSON)."""
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments)
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


def _assistant_text(msg: dict, i: int) -> str:
    text = _text(msg.get("content"), f"messages[{i}].content")
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise tool_error(f"messages[{i}].tool_calls", "expected a list")
    blocks = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise tool_error(f"messages[{i}].tool_calls[{j}]", "expected {'function': {'name', 'arguments'}}")
        blocks.append(format_call(fn["name"], fn.get("arguments") or {}))
    return "\n".join([text, *blocks] if text else blocks)  # Qwen2.5: content, then "\n" + each call


def render_messages(messages: list[dict], tools: list[Tool]) -> list[dict]:
    """Rewrite an OpenAI history (tool calls, tool results) into plain role/content messages for a
    template without tool support; with tools, their Hermes system prompt is prepended (after the
    user's own system message text when there is one)."""
    out: list[dict] = []
    prev_tool = False
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise tool_error(f"messages[{i}]", "expected an object")
        role = msg.get("role")
        if role == "tool":
            block = (
                f"<tool_response>\n{_text(msg.get('content'), f'messages[{i}].content')}\n</tool_response>"
            )
            if prev_tool:  # consecutive results share one user turn (as Qwen2.5)
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif role == "assistant":
            out.append({"role": "assistant", "content": _assistant_text(msg, i)})
        else:
            out.append({"role": role, "content": _text(msg.get("content"), f"messages[{i}].content")})
        prev_tool = role == "tool"
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
