"""vLLM's POST /tokenize and POST /detokenize, with vLLM's request and response shapes.

/tokenize takes a completion prompt (`prompt`, `add_special_tokens` default true) or chat `messages`
(`add_generation_prompt` default true, `continue_final_message`, `add_special_tokens` default false,
`chat_template_kwargs`, `tools`) and answers `{"count", "max_model_len", "tokens", "token_strs"}`. Chat
messages are rendered as /v1/chat/completions renders them (motet/api/completions/generation.py `chat_spec`: the same
template arguments, the same tool prompt), so the ids are the ones a chat request with those messages is
given. /detokenize takes `tokens` and answers `{"prompt"}` (special tokens included, as vLLM decodes).
`model` is optional (the base model); an adapter's name works too (adapters share the base tokenizer).
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio.to_thread
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from motet.api import protocol as P
from motet.api.completions.generation import chat_spec
from motet.api.completions.protocol import ChatCompletionRequest
from motet.api.errors import APIError
from motet.api.openapi import operation
from motet.api.request_body import read_json
from motet.api.state import ServerState
from motet.engine.request_checks import RequestError


class TokenizeCompletionRequest(P._Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(P._Request):
    unsupported = {
        "chat_template": ((None,), "the model's own chat template is used"),
        "mm_processor_kwargs": ((None, {}), "only text is supported"),
        "media_io_kwargs": ((None, {}), "only text is supported"),
    }
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes the special tokens itself
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None


class DetokenizeRequest(P._Request):
    model: str | None = None
    tokens: list[int]


async def _accept(request: Request, model):
    state: ServerState = request.app.state.motet
    state.check_ready()
    tenant = state.auth.tenant(request.headers.get("authorization"))
    body = await read_json(request, state.max_body_bytes)
    if model is None:  # /tokenize: chat when it sends messages, as vLLM's union tells them apart
        model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    req = model.model_validate(body)
    adapter = await state.resolve_adapter(tenant, req.model) if req.model is not None else None
    return state, tenant, req, adapter


def _chat_text(state: ServerState, tenant: str, adapter, req: TokenizeChatRequest) -> str:
    """The prompt text a chat request with these messages is given (motet/actors/ingress_actor.py renders
    it)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    chat = ChatCompletionRequest.model_validate(
        {
            "model": req.model or state.model_name,
            "messages": req.messages,
            "add_generation_prompt": req.add_generation_prompt,
            **({"chat_template_kwargs": req.chat_template_kwargs} if req.chat_template_kwargs else {}),
            **({"tools": req.tools} if req.tools else {}),
        }
    )
    spec, _, _, _ = chat_spec(state, tenant, adapter, chat, f"tok-{uuid.uuid4().hex}")
    kwargs = dict(spec.chat_template_kwargs)
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        return state.system.model.render_chat(spec.messages, **kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None


@operation("vLLM: a prompt's or chat's token ids", tag="Tokenization",
           body=(TokenizeCompletionRequest, TokenizeChatRequest),
           example=lambda model: {"model": model, "prompt": "Hello, world!"})  # fmt: skip
async def tokenize(request: Request) -> Response:
    state, tenant, req, adapter = await _accept(request, None)
    model = state.system.model
    chat = isinstance(req, TokenizeChatRequest)

    def run() -> list[int]:
        text = _chat_text(state, tenant, adapter, req) if chat else req.prompt
        try:
            model.check_text(text, "messages" if chat else "prompt")
        except RequestError as e:
            raise APIError(400, str(e), param=e.param, code=e.code) from None
        return model.encode(text, add_special_tokens=req.add_special_tokens)

    ids = await anyio.to_thread.run_sync(run)
    body = {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = model.tokenizer.hf.convert_ids_to_tokens(ids)
    return JSONResponse(body)


@operation("vLLM: token ids' text", tag="Tokenization", body=DetokenizeRequest,
           example=lambda model: {"model": model, "tokens": [1, 2, 3]})  # fmt: skip
async def detokenize(request: Request) -> Response:
    state, _, req, _ = await _accept(request, DetokenizeRequest)
    model = state.system.model
    vocab_size = model.tokenizer.vocab_size
    if bad := [t for t in req.tokens if not 0 <= t < vocab_size]:
        raise APIError(
            400,
            f"tokens: {bad[0]} is not a token id of this model (0 to {vocab_size - 1})",
            param="tokens",
        )
    text = await anyio.to_thread.run_sync(lambda: model.decode(req.tokens, skip_special_tokens=False))
    return JSONResponse({"prompt": text})
