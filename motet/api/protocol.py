"""OpenAI wire format: request and response models (pydantic).

A request field motet does not know is refused (400 naming it), never ignored. OpenAI's fields that do
not change the output (`user`, `metadata`, `store`, the prompt-cache hints, ...) are accepted and
unused; the ones motet knows but cannot honour (`logit_bias`, `audio`, `reasoning_effort`, ...) are
refused unless they hold their no-op value (`null`, `"auto"`, ...). The vLLM-style sampling extras (top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, ...) are accepted and honoured. Types are strict: a
string is never coerced into a number or a boolean (`"n": "2"` is a 400). Ranges are checked once, by
`engine.sampling_params.SamplingParams`, whose errors name the field.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from motet.api.errors import UNSUPPORTED_FIELD, echo
from motet.grammar.tool_calls import MAX_TOOL_CALLS


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    # Fields motet knows but cannot honour: name -> (the values that ask for nothing, what to do instead).
    # Refused with a 400 naming the field when set to anything else; dropped before validation otherwise.
    unsupported: ClassVar[dict[str, tuple[tuple, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data):
        if not isinstance(data, dict) or not cls.unsupported:
            return data
        for name, (no_ops, why) in cls.unsupported.items():
            if name in data and not any(data[name] == v and type(data[name]) is type(v) for v in no_ops):
                # api.errors names the field: this error's location, then ctx["field"]
                raise PydanticCustomError(
                    UNSUPPORTED_FIELD, "not supported by this server; {why}", {"field": name, "why": why}
                )
        return {k: v for k, v in data.items() if k not in cls.unsupported}


# OpenAI's limits on `metadata` (its API reference: "Set of 16 key-value pairs ... Keys are strings with a
# maximum length of 64 characters. Values are strings with a maximum length of 512 characters.")
METADATA_MAX_PAIRS, METADATA_MAX_KEY_CHARS, METADATA_MAX_VALUE_CHARS = 16, 64, 512
SAFETY_IDENTIFIER_MAX_CHARS = 128  # OpenAI's documented maximum
ID_MAX_CHARS = 128  # an id a request names (previous_response_id): motet's are 37 characters, OpenAI's ~55


class _OpenAINoOps(_Request):
    """OpenAI's optional fields that do not change the output: accepted (type-checked, within OpenAI's
    limits) and unused."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None  # chat: OpenAI's own storage of completions; motet keeps none
    prompt_cache_key: str | None = None  # motet's prefix cache needs no hint
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = Field(None, max_length=SAFETY_IDENTIFIER_MAX_CHARS)

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is None:
            return v
        if len(v) > METADATA_MAX_PAIRS:
            raise PydanticCustomError(
                "metadata_limit",
                "at most {limit} key-value pairs are allowed, got {n}",
                {"limit": METADATA_MAX_PAIRS, "n": len(v)},
            )
        for key, value in v.items():
            for what, text, limit in (
                ("key {key}", key, METADATA_MAX_KEY_CHARS),
                ("the value of {key}", value, METADATA_MAX_VALUE_CHARS),
            ):
                if len(text) > limit:
                    raise PydanticCustomError(
                        "metadata_limit",
                        what + " is {n} characters long; at most {limit} are allowed",
                        {"key": echo(key), "n": len(text), "limit": limit},
                    )
        return v


# Data a chat template may read, passed through `chat_template_kwargs`, with its type. Anything else,
# a replacement template above all, is refused: the template is the model's, rendered by the server.
CHAT_TEMPLATE_KWARGS: dict[str, type] = {"enable_thinking": bool, "thinking": bool}


def _text_content(content: list, where: str) -> str:
    """OpenAI content parts -> their text; only text parts are supported."""
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError(f"{where}[{j}] must be an object with a string 'type'")
        if part["type"] != "text":
            raise ValueError(
                f"{where}[{j}]: content of type {echo(part['type'])} is not supported, only 'text'"
            )
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    return "".join(texts)


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # padding against length side channels: no output change


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` (motet/api/structured.py turns it into a grammar spec)."""

    unsupported = {
        "whitespace_pattern": ((None,), "disable_any_whitespace: true asks for compact JSON"),
        "disable_fallback": ((None, False), "motet always tries its other grammar backends"),
    }

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None


# What each kind of request refuses; shared by chat and completions where both have the field.
_LOGIT_BIAS = {"logit_bias": ((None, {}), "logit biases are not applied; use guided_choice or a grammar")}


class _SamplingFields(_OpenAINoOps):
    """Fields common to chat and completions."""

    unsupported = _LOGIT_BIAS

    model: str
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=0)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    speculative: bool = True  # motet: False opts the request out of speculative decoding (same output)
    cache_salt: str | None = None  # vLLM: prefix-cache blocks are shared only among requests of one salt
    # structured output (motet/api/structured.py): OpenAI's response_format, vLLM's guided_* extras
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's newer spelling of the guided_* fields

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        return [v] if isinstance(v, str) else v


class ChatCompletionRequest(_SamplingFields):
    unsupported = _LOGIT_BIAS | {
        "audio": ((None,), "only text output is produced"),
        "modalities": ((None, ["text"]), "only text output is produced"),
        "functions": ((None,), "send `tools` (the deprecated `functions` are not read)"),
        "function_call": ((None,), "send `tool_choice` (the deprecated `function_call` is not read)"),
        "prediction": ((None,), "predicted outputs are not used"),
        "reasoning_effort": (
            (None,),
            "a model's reasoning is set by its chat template (chat_template_kwargs)",
        ),
        "verbosity": ((None,), "the model's verbosity cannot be set"),
        "web_search_options": ((None,), "there is no web search"),
        "moderation": ((None,), "there is no moderation"),
        "service_tier": ((None, "auto", "default"), "there is one service tier"),
    }

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # validated in motet/api/structured.py, where errors can name the tool
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI Responses API's bound on the calls of one response (a small model may loop calls).
    max_tool_calls: int | None = Field(None, ge=1, le=MAX_TOOL_CALLS)
    guided_tool_calls: bool = True  # motet: False parses tool calls without constraining them

    @field_validator("messages")
    @classmethod
    def _messages(cls, v):
        for i, m in enumerate(v):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}] needs a string 'role'")
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text, joined
                m["content"] = _text_content(content, f"messages[{i}].content")
            elif content is not None and not isinstance(content, str):
                raise ValueError(f"messages[{i}].content must be a string or a list of content parts")
            if m.get("name") is not None and not isinstance(m["name"], str):
                raise ValueError(f"messages[{i}].name must be a string")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        for key, value in (v or {}).items():
            kind = CHAT_TEMPLATE_KWARGS.get(key)
            if kind is None:
                known = ", ".join(CHAT_TEMPLATE_KWARGS)
                raise ValueError(
                    f"{echo(key)} is not accepted: only data the model's template reads may be passed "
                    f"({known}); a chat template cannot be supplied per request"
                )
            if not isinstance(value, kind):
                raise ValueError(f"{echo(key)} must be a {kind.__name__}")
        return v


class CompletionRequest(_SamplingFields):
    unsupported = _LOGIT_BIAS | {
        "suffix": ((None, ""), "insertion after a suffix is not supported"),
        "best_of": ((None, 1), "use n (every choice is returned)"),
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v


# -- responses --------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "motet"
    parent: str | None = None  # an adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AdapterCard(BaseModel):
    id: str  # the name requests use as `model`
    object: Literal["adapter"] = "adapter"
    created: int
    owned_by: str  # the tenant; "motet" for the server's shared adapters (--lora)
    parent: str  # the base model
    size_bytes: int


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterCard]


class LoadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/load_lora_adapter."""

    unsupported = {"load_inplace": ((None, False), "unload the adapter first, then load the new one")}
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Request):
    """vLLM's POST /v1/unload_lora_adapter (adapters are named, never numbered, here)."""

    unsupported = {"lora_int_id": ((None,), "name the adapter with lora_name")}
    lora_name: str = Field(min_length=1)


class AdapterDeleted(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    deleted: bool = True


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
