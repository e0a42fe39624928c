"""The Responses API's request (`POST /v1/responses`), and its translation into the chat request the rest
of the server already serves.

A Responses request is a chat request in other clothes: `instructions` is the system message, the input
items (and, through `previous_response_id`, the stored conversation before them) are the messages,
`text.format` is `response_format`, function tools and `tool_choice` are the chat ones, and
`max_output_tokens` is `max_completion_tokens`. So it is translated once, here, and runs the chat path
(motet/api/completions/generation.py `chat_spec`, motet/grammar/structure.py, grammar/); errors that path raises about a chat field are
renamed to the Responses field they came from. As everywhere, a field motet does not know, or cannot
honour, is refused by name (motet/api/protocol.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from motet.api import protocol as P
from motet.api.completions.protocol import ChatCompletionRequest, SamplingKnobs
from motet.api.errors import APIError, echo
from motet.grammar.tool_calls import MAX_TOOL_CALLS, ToolError
from motet.grammar.tool_prompt import decoded_json


class TextConfig(P._Request):
    unsupported = {"verbosity": ((None,), "the model's verbosity cannot be set")}
    format: dict[str, Any] | None = None


class ReasoningConfig(P._Request):
    unsupported = {
        "effort": ((None,), "a model's reasoning is set by its chat template; it cannot be set per request"),
        "summary": ((None,), "reasoning comes back in full as reasoning_text, never summarized"),
        "generate_summary": ((None,), "reasoning comes back in full as reasoning_text, never summarized"),
    }


class ResponsesStreamOptions(P._Request):
    include_obfuscation: bool | None = None  # padding against length side channels: no output change


class ResponsesRequest(P._OpenAINoOps, SamplingKnobs):
    unsupported = {
        "background": ((None, False), "a response is answered within its request"),
        "conversation": ((None,), "send previous_response_id (there are no conversation objects)"),
        "prompt": ((None,), "there are no stored prompt templates; send instructions and input"),
        "include": ((None, []), "no extra output data is available"),
        "truncation": ((None, "disabled"), "an input longer than the context is refused, never truncated"),
        "top_logprobs": ((None, 0), "logprobs are available from /v1/chat/completions"),
        "moderation": ((None,), "there is no moderation"),
        "context_management": ((None,), "the context is never compacted"),
    }

    model: str
    input: str | list[Any] = Field(min_length=1)  # items checked by _input_items, below
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=P.ID_MAX_CHARS)
    store: bool | None = None  # None: stored (OpenAI's default)
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    tools: list[Any] | None = None  # validated by grammar.tool_calls, whose errors name the tool
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1, le=MAX_TOOL_CALLS)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)

    @field_validator("input")
    @classmethod
    def _input_items(cls, v):
        """The items are checked as they are parsed (an APIError naming `input[i]...`), so that everything
        after (the response store, the chat request) reads only well-formed items."""
        if isinstance(v, list):
            to_messages(v)
        return v

    @property
    def stored(self) -> bool:
        return self.store is not False

    @property
    def text_format(self) -> dict:
        return (self.text.format if self.text else None) or {"type": "text"}


# -- input items -> chat messages -----------------------------------------------------------------------------
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal", "summary_text": "text"}
# The keys each input item and content part may have (what a client echoes back from an output included);
# any other key is refused, as every request field is.
_ITEM_KEYS = {
    "message": ("type", "role", "content", "id", "status", "phase"),
    "function_call": ("type", "call_id", "name", "arguments", "id", "status"),
    "function_call_output": ("type", "call_id", "output", "id", "status"),
    "reasoning": ("type", "id", "summary", "content", "encrypted_content", "status"),
}
_PART_KEYS = ("type", "text", "refusal", "annotations", "logprobs")
_ONLY_TEXT = "content of type {value} is not supported, only text ({known})"
_ITEM_TYPES = "input items of type {value} are not supported, only {known}"


def _known_keys(obj: dict, known: tuple[str, ...], where: str) -> None:
    for key in obj:
        if key not in known:
            raise APIError(
                400, f"Unrecognized request argument supplied: {where}.{key}", param=f"{where}.{key}"
            )


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


def _text(content, where: str) -> str:
    """A message's content (a string or content parts) as its text; only text parts are supported."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "expected a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _bad(f"{where}[{j}]", f"expected an object, got {_json_type(part)}")
        key = _TEXT_PARTS[_string(part.get("type"), f"{where}[{j}].type", _TEXT_PARTS, _ONLY_TEXT)]
        _known_keys(part, _PART_KEYS, f"{where}[{j}]")
        if not isinstance(part.get(key), str):
            raise _bad(f"{where}[{j}].{key}", "expected a string")
        texts.append(part[key])
    return "".join(texts)


def to_messages(items: list[dict], first_index: int = 0) -> list[dict]:
    """Chat messages for input items: messages, function calls (consecutive ones: one assistant turn) and
    their outputs; reasoning items are the model's own past thoughts and are not shown to it again (as
    chat templates drop them). Errors name `input[i]`, counting from `first_index` (the stored conversation
    before the request's own input has negative indexes: it was checked when it was stored)."""
    messages: list[dict] = []
    for n, item in enumerate(items):
        where = f"input[{n - first_index}]"
        if not isinstance(item, dict):
            raise _bad(where, "expected an object")
        kind = _string(item.get("type", "message"), f"{where}.type", _ITEM_KEYS, _ITEM_TYPES)
        _known_keys(item, _ITEM_KEYS[kind], where)
        if kind == "message":
            role = _ROLES[_string(item.get("role"), f"{where}.role", _ROLES)]
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _bad(f"{where}.{key}", "expected a string")
            _prompt_json(item["arguments"], f"{where}.arguments")
            call = {"id": item["call_id"], "type": "function"}
            call["function"] = {"name": item["name"], "arguments": item["arguments"]}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":  # the text before its calls
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}.call_id", "expected a string")
            output = _text(item.get("output"), f"{where}.output")
            _prompt_json(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        # (a reasoning item: skipped)
    return messages


def _prompt_json(text: str, param: str) -> None:
    """JSON text the prompt will read as its value (motet/grammar/tool_prompt.py `decoded_json`: a call's
    arguments, a call's output) refused here, under the item's own name, where no prompt can hold it (the chat
    request's refusal could name only `input`: its messages do not map onto the items one to one)."""
    try:
        decoded_json(text, param)
    except ToolError as e:
        raise APIError(400, str(e), param=e.param) from None


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"Invalid '{param}': {message}", param=param)


def _json_type(value) -> str:
    """The JSON type of a parsed value, as an error names it."""
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _string(value, param: str, known: dict, refusal: str = "expected one of {known}, got {value}") -> str:
    """`value` if it is one of `known`'s keys, else a 400 naming `param` (`refusal` says why). A request's
    value is looked up only once it is known to be a string: a list or an object is not hashable."""
    if not isinstance(value, str):
        raise _bad(param, f"expected a string, got {_json_type(value)}")
    if value not in known:
        raise _bad(param, refusal.format(known=", ".join(known), value=echo(value)))
    return value


# -- the chat request ---------------------------------------------------------------------------------------
def _response_format(fmt: dict) -> dict | None:
    """`text.format` as a chat `response_format` (the same grammar, from the same code)."""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _bad("text.format", 'expected an object with a "type"')
    kind = fmt["type"]
    if kind == "json_schema":
        known = ("type", "name", "schema", "strict", "description")
        for key in fmt:
            if key not in known:
                raise APIError(
                    400, f"Unrecognized request argument supplied: text.format.{key}", f"text.format.{key}"
                )
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return fmt  # text, json_object: the same shape on both APIs (unknown types are refused there)


def _tool_choice(choice):
    """Responses' `{"type": "function", "name": ...}` as the chat form."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        extra = set(choice) - {"type", "name"}
        if extra:
            key = sorted(extra)[0]
            raise APIError(
                400, f"Unrecognized request argument supplied: tool_choice.{key}", f"tool_choice.{key}"
            )
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise _bad("tool_choice", f"tool_choice of type {echo(choice.get('type'))} is not supported")
    return choice


_FUNCTION_TOOL_KEYS = ("type", "name", "description", "parameters", "strict")


def _check_tools(tools) -> None:
    """A function tool's keys beyond what motet reads are refused (grammar.tool_calls checks the rest)."""
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("type") == "function" and "function" not in tool:
            _known_keys(tool, _FUNCTION_TOOL_KEYS, f"tools[{i}]")


def chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request that serves `req`, after the stored conversation `history` (input items)."""
    _check_tools(req.tools)
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += to_messages([*history, *input_items(req)], first_index=len(history))
    if not messages:
        raise _bad("input", "expected at least one message")
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "response_format": _response_format(req.text_format),
    }
    optional = {
        "tools": req.tools or None,  # `tools: []` is no tools, as OpenAI reads it (the Agents SDK sends it)
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_tool_calls": req.max_tool_calls,
        "max_completion_tokens": req.max_output_tokens,
        **{name: getattr(req, name) for name in SamplingKnobs.model_fields},
    }
    body |= {k: v for k, v in optional.items() if v is not None}
    return ChatCompletionRequest.model_validate(body)


# A chat field an error names -> the Responses field it came from (longest first: prefixes match).
_RENAMED = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def renamed(e: APIError) -> APIError:
    """An error about a chat field, about the Responses field it came from instead."""
    for chat, responses in _RENAMED:
        if e.param is not None and (e.param == chat or e.param.startswith((chat + ".", chat + "["))):
            e.message = e.message.replace(chat, responses, 1)
            e.param = responses + e.param[len(chat) :]
            if chat == "messages":  # message indexes do not map onto input items one to one
                e.param = "input"
            break
    return e
