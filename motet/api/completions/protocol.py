"""The chat and completions families' wire format: /v1/chat/completions and /v1/completions requests,
responses, stream chunks and logprobs (pydantic), on the shared request rules of motet/api/protocol.py.

The vLLM-style extras (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, bad_words,
allowed_token_ids, truncate_prompt_tokens, prompt_logprobs, return_token_ids, continue_final_message, ...)
are accepted and honoured, with vLLM's semantics.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from motet.api.errors import UNSUPPORTED_FIELD, echo
from motet.api.protocol import Usage, _OpenAINoOps, _Request
from motet.grammar.tool_calls import MAX_TOOL_CALLS

# Data a chat template may read, passed through `chat_template_kwargs`, with its type. Anything else,
# a replacement template above all, is refused: the template is the model's, rendered by the server.
CHAT_TEMPLATE_KWARGS: dict[str, type] = {"enable_thinking": bool, "thinking": bool}
# Under `motet serve --trust-request-chat-template` a request may bring its own template (`chat_template`,
# or `chat_template_kwargs.chat_template`), rendered within bounds (motet/engine/template_worker.py), and any
# data it reads, except the names `apply_chat_template` itself takes (the request has its own fields for
# those). The flag reaches the validators as this key of the validation context.
TRUST_REQUEST_CHAT_TEMPLATE = "trust_request_chat_template"
MAX_CHAT_TEMPLATE_CHARS = 128 << 10  # the longest models' templates are ~20 KB
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "max_chars",
    }
)
# vLLM's words, so that a client written for vLLM recognizes the refusal.
UNTRUSTED_CHAT_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
# A request's own id (`request_id`, or the X-Request-Id header) is echoed in the response's id and header.
REQUEST_ID_MAX_CHARS = 256


def check_request_id(value: str, where: str = "request_id") -> str:
    """A client's request id: 1 to REQUEST_ID_MAX_CHARS printable ASCII characters (it goes into a header)."""
    if not 0 < len(value) <= REQUEST_ID_MAX_CHARS or not all(" " <= c <= "~" for c in value):
        raise ValueError(f"{where} must be 1 to {REQUEST_ID_MAX_CHARS} printable ASCII characters")
    return value


def _trusted(info: ValidationInfo) -> bool:
    return bool((info.context or {}).get(TRUST_REQUEST_CHAT_TEMPLATE))


def _template_text(value, info: ValidationInfo):
    if not _trusted(info):
        raise PydanticCustomError("untrusted_chat_template", UNTRUSTED_CHAT_TEMPLATE)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CHAT_TEMPLATE_CHARS:
        raise ValueError(f"a chat template must be a string of 1 to {MAX_CHAT_TEMPLATE_CHARS} characters")
    return value


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
    continuous_usage_stats: bool = False  # vLLM: with include_usage, every chunk carries the usage so far


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` (motet/grammar/structure.py turns it into a grammar spec)."""

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


class SamplingKnobs(_Request):
    """The sampling fields the Responses API takes as chat does, OpenAI's and vLLM's: a Responses request passes
    each on to the chat request it runs (motet/api/responses/request.py)."""

    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    cache_salt: str | None = None  # vLLM: prefix-cache blocks are shared only among requests of one salt


class _SamplingFields(_OpenAINoOps, SamplingKnobs):
    """Fields common to chat and completions."""

    unsupported = _LOGIT_BIAS

    model: str
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM-style extras
    min_tokens: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    speculative: bool = True  # motet: False opts the request out of speculative decoding (same output)
    bad_words: list[str] | None = (
        None  # vLLM: token sequences that never appear (motet/engine/worker/token_masks.py)
    )
    allowed_token_ids: list[int] | None = None  # vLLM: the only tokens that may be sampled
    truncate_prompt_tokens: int | None = None  # vLLM: keep the prompt's last N tokens (-1: as many as fit)
    prompt_logprobs: int | None = None  # vLLM: each prompt token's logprob and rank, plus the top N
    return_token_ids: bool | None = None  # vLLM: prompt_token_ids and token_ids in the response
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprobs' tokens as "token_id:N"
    request_id: str | None = None  # vLLM: the response's id is made from it (the X-Request-Id header wins)
    # vLLM: lower is sooner; it orders the tenant's own requests only, never one tenant before another
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    # structured output (motet/grammar/structure.py): OpenAI's response_format, vLLM's guided_* extras
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

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v):
        if v is not None and v != -1 and v < 1:
            raise ValueError("must be -1 (as many tokens as fit) or a number of tokens >= 1")
        return v

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, v):
        return v if v is None else check_request_id(v)

    @model_validator(mode="after")
    def _stream_extras(self):
        if self.prompt_logprobs is not None and self.stream:
            raise PydanticCustomError(
                UNSUPPORTED_FIELD,
                "prompt_logprobs are not available when stream=True",
                {"field": "prompt_logprobs"},
            )
        return self


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
    }

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM: the last message is left open for the model to continue (with add_generation_prompt false)
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM: the tokenizer's special tokens on top of the template's
    echo: bool = False  # vLLM: the last message's content, when it has the response's role, leads the answer
    chat_template: str | None = None  # vLLM: the request's own template (--trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # validated in motet/grammar/structure.py, where errors can name the tool
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

    @field_validator("chat_template")
    @classmethod
    def _template(cls, v, info: ValidationInfo):
        return v if v is None else _template_text(v, info)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v, info: ValidationInfo):
        for key, value in (v or {}).items():
            if key == "chat_template":
                _template_text(value, info)
                continue
            kind = CHAT_TEMPLATE_KWARGS.get(key)
            if kind is None and _trusted(info) and key not in RESERVED_TEMPLATE_KWARGS:
                continue  # data a trusted request's template reads
            if kind is None:
                known = ", ".join(CHAT_TEMPLATE_KWARGS)
                why = (
                    "it is a parameter of the rendering itself (send the request field, if any)"
                    if key in RESERVED_TEMPLATE_KWARGS
                    else f"only data the model's template reads may be passed ({known}); a chat template "
                    "cannot be supplied per request unless the server trusts them"
                )
                raise ValueError(f"{echo(key)} is not accepted: {why}")
            if not isinstance(value, kind):
                raise ValueError(f"{echo(key)} must be a {kind.__name__}")
        return v

    @model_validator(mode="after")
    def _generation_prompt(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise PydanticCustomError(
                UNSUPPORTED_FIELD,
                "cannot be combined with add_generation_prompt, which is true unless set to false (the last "
                "message is continued, so no new one is started)",
                {"field": "continue_final_message"},
            )
        return self

    @property
    def template(self) -> str | None:
        """The request's own chat template, if it brought one (validated above)."""
        return self.chat_template or (self.chat_template_kwargs or {}).get("chat_template")


class CompletionRequest(_SamplingFields):
    unsupported = _LOGIT_BIAS | {
        "suffix": ((None, ""), "insertion after a suffix is not supported"),
        "best_of": ((None, 1), "use n (every choice is returned)"),
    }

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM: the tokenizer's special tokens (BOS) before a text prompt

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v


# -- responses --------------------------------------------------------------------------------------------
def _extra(description: str):
    """A vLLM extra of a response: in the JSON only when the request asked for it (not null otherwise)."""
    return Field(None, description=description, exclude_if=lambda v: v is None)


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
    role: str = "assistant"  # with add_generation_prompt false, the last message's (vLLM)
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _extra("vLLM's return_token_ids: the output's token ids")


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int | None = None  # 1: the likeliest token
    decoded_token: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = _extra("vLLM's return_token_ids: the prompt's token ids")
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = _extra(
        "vLLM's prompt_logprobs: per prompt token (none for the first), its own and the top ones, by token id"
    )


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = _extra("vLLM's return_token_ids: this chunk's token ids")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # with vLLM's continuous_usage_stats, on every chunk
    prompt_token_ids: list[int] | None = _extra("vLLM's return_token_ids: on a choice's first chunk")


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
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = _extra(
        "vLLM's prompt_logprobs (also with echo and logprobs): per prompt token, by token id"
    )
    prompt_token_ids: list[int] | None = _extra(
        "vLLM's return_token_ids (streamed: in a choice's first chunk)"
    )
    token_ids: list[int] | None = _extra("vLLM's return_token_ids: the output's (streamed: this chunk's)")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
