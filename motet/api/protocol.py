"""OpenAI wire format, what every route family shares: the request base and its rules, OpenAI's no-op
fields, usage, the model list and the error body (pydantic). Each family's own models are beside its
routes (motet/api/completions/protocol.py, motet/api/adapters/protocol.py, motet/api/responses/request.py).

A request field motet does not know is refused (400 naming it), never ignored. OpenAI's fields that do
not change the output (`user`, `metadata`, `store`, the prompt-cache hints, ...) are accepted and
unused; the ones motet knows but cannot honour (`logit_bias`, `audio`, `reasoning_effort`, ...) are
refused unless they hold their no-op value (`null`, `"auto"`, ...). Types are strict: a
string is never coerced into a number or a boolean (`"n": "2"` is a 400). Ranges are checked once, by
`engine.sampling_params.SamplingParams`, whose errors name the field.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from motet.api.errors import UNSUPPORTED_FIELD, echo


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
SERVICE_TIERS = ("auto", "default", "flex")
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
    # OpenAI's processing tier: "flex" is batch work, which yields to interactive requests (motet/engine/core/latency.py);
    # "auto" and "default" are interactive. There is no faster tier than the default.
    service_tier: str | None = None

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, v):
        if v is not None and v not in SERVICE_TIERS:
            raise PydanticCustomError(
                UNSUPPORTED_FIELD,
                "not supported by this server; {why}",
                {"why": f"the service tiers are {', '.join(SERVICE_TIERS)}"},
            )
        return v

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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
