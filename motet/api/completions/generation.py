"""What every generation route (chat, completions, the Responses API, /tokenize's chats) does with a request
before it streams: readiness, auth and the body (`accept_request`), the request as a GenerateSpec with one
SamplingParams per choice (`chat_spec`, `generate_spec`, `build_params`), and its submission to the actors
(`submit`). The routes themselves, side by side over this: motet/api/completions/routes.py,
motet/api/responses/routes.py, motet/api/tokenization.py.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import uuid
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from motet.actors.messages import Admission, GenerateSpec
from motet.actors.serving_errors import ServingError
from motet.api import rate_limits, tracing
from motet.api import usage as usage_records
from motet.api.asgi import BATCH_SCOPE_KEY
from motet.api.auth import Principal
from motet.api.completions import protocol as P
from motet.api.completions.chat_output import ChatOutput
from motet.api.errors import APIError, from_serving_error, from_structure_error, from_value_error
from motet.api.request_body import read_json
from motet.api.state import ServerState
from motet.engine.sampling_params import SamplingParams
from motet.grammar.reasoning import ReasoningFormat, reasoning_format, template_reasoning
from motet.grammar.structure import Structure, StructureError, prompt_messages, structured_output
from motet.grammar.tool_formats import ToolFormat, tool_format

log = logging.getLogger("motet.api")
# Whether the request being handled is batch work (set by accept_request, read where its specs are made).
background: contextvars.ContextVar[bool] = contextvars.ContextVar("motet_background", default=False)

_PARAM_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {
    "max_completion_tokens",
    "top_logprobs",
}
REQUEST_ID_HEADER = "X-Request-Id"
# The request fields SamplingParams takes as they are, by the same name (declared once, in each): the others are
# the request's own (max_tokens, logprobs, skip_special_tokens: made here) or the grammar's (grammar/structure.py).
_PASSED_ON = tuple(
    f.name
    for f in dataclasses.fields(SamplingParams)
    if f.name in P._SamplingFields.model_fields
    and f.name not in ("max_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens", "seed")
)


# -- request plumbing -------------------------------------------------------------------------------------
def build_params(
    req: P._SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    structure: Structure | None = None,
    defaults: dict | None = None,
):
    """One SamplingParams per choice (seed + i for choice i, so choices differ but stay reproducible). A
    field the request omits takes `defaults` (the model's generation config), else SamplingParams' own (OpenAI's
    and vLLM's defaults)."""
    defaults = defaults or {}
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")
    calls = structure is not None and structure.tool_mode != "none"
    drop_output = max_tokens == 0  # prompt logprobs only: generate one token, then drop it
    engine_max = 1 if drop_output else max_tokens
    base = {
        name: value
        for name in _PASSED_ON
        if (value := getattr(req, name)) is not None or (value := defaults.get(name)) is not None
    }
    base |= dict(
        max_tokens=engine_max or max(1, req.min_tokens or 0),  # None: ingress sets the rest of the context
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        # the formats' markers are special tokens in some models (GPT-OSS's): their text keeps them
        skip_special_tokens=req.skip_special_tokens and not (structure and structure.keeps_special_tokens),
        grammar=structure.spec if structure else None,
        grammar_backend=structure.backend if structure else None,
        reasoning=structure.engine_reasoning if structure else None,
        bound_reasoning=structure is not None and structure.bounds_reasoning,
        stop_on_repeated_tool_call=calls and structure.tool_format.stop_repeated_calls,
    )
    try:
        params = [
            SamplingParams(**base, seed=None if req.seed is None else req.seed + i) for i in range(req.n)
        ]
    except ValueError as e:
        raise from_value_error(e, _PARAM_FIELDS) from None
    return params, engine_max, drop_output


WARNING_HEADER = "X-Motet-Warning"
MAX_WARNING_CHARS = 1024


def with_warnings(response: Response, structure: Structure, rid: str) -> Response:
    """Say what the request's grammar does not enforce (structure.warnings): in a response header, as
    printable ASCII (schemas' property names may hold anything), and in the log."""
    if structure.warnings:
        text = "; ".join(structure.warnings)
        log.info("%s: %s", rid, text)
        value = json.dumps(text)[1:-1]  # escapes control and non-ASCII characters
        if len(value) > MAX_WARNING_CHARS:
            value = value[: MAX_WARNING_CHARS - 3] + "..."
        response.headers[WARNING_HEADER] = value
    return response


async def submit(state: ServerState, *specs: GenerateSpec) -> list[Admission]:
    """Queue every spec of one API request, or none of them."""
    # How long it may run, for the Retry-After of a request its tenant's concurrency limit refuses meanwhile.
    if (ticket := rate_limits.current()) is not None:
        context = state.system.model.max_model_len
        ticket.expect(max(context if s.max_tokens is None else min(s.max_tokens, context) for s in specs))
    try:
        admissions = await state.system.submit_all(list(specs))
    except ServingError as e:
        raise from_serving_error(e) from None
    except ValueError as e:
        raise from_value_error(e, _PARAM_FIELDS) from None
    for adm in admissions:
        tracing.admitted(adm.phases)
    return admissions


async def accept_request(request: Request, model):
    """What every generation route does first: readiness, auth, body validation, model -> adapter."""
    state: ServerState = request.app.state.motet
    state.check_ready()
    # A Batch API line runs as its batch's tenant, named in its scope (motet/api/batches/runner.py), not by a key
    batch_tenant = request.scope.get(BATCH_SCOPE_KEY)
    caller = (
        Principal(batch_tenant)
        if batch_tenant is not None
        else state.auth.caller(request.headers.get("authorization"))
    )
    tenant = caller.tenant
    context = {P.TRUST_REQUEST_CHAT_TEMPLATE: state.trust_request_chat_template}
    req = model.model_validate(await read_json(request, state.max_body_bytes), context=context)
    adapter = await state.resolve_adapter(tenant, req.model)
    served = req.model if adapter is not None else state.model_name  # an alias counts as the model
    batch_line = batch_tenant is not None
    # Batch work yields to interactive requests (motet/engine/core/latency.py): the Batch API's lines, a tenant of the
    # batch class, a request for the flex tier.
    background.set(batch_line or caller.background or req.service_tier == "flex")
    usage_records.begin(tenant, served, batch=batch_line)
    tracing.annotate(
        **{"motet.tenant": tenant, "gen_ai.request.model": served, "motet.adapter": adapter is not None}
    )
    return state, tenant, req, adapter


def client_request_id(request: Request, req: P._SamplingFields) -> str:
    """vLLM's request id: the X-Request-Id header, else the body's `request_id`, else a random one. It names
    the response (its id, and the X-Request-Id header); the engine's own ids stay random, so that two
    requests with one id (two tenants, say) never meet there."""
    header = request.headers.get(REQUEST_ID_HEADER)
    if header is not None:
        try:
            return P.check_request_id(header, f"the {REQUEST_ID_HEADER} header")
        except ValueError as e:
            raise APIError(400, str(e), param=REQUEST_ID_HEADER) from None
    return req.request_id or uuid.uuid4().hex


def with_request_id(response: Response, request_id: str) -> Response:
    response.headers[REQUEST_ID_HEADER] = request_id
    return response


def generate_spec(
    req, id_prefix: str, params, tenant, adapter, max_tokens, structure, **prompt
) -> GenerateSpec:
    """What the engine is asked for a chat or a completion request: one choice per `req.n` (ids `id_prefix-i`),
    the tenant and adapter, the output's bound, and the fields both requests pass on alike; `prompt`: the
    prompt, or the messages and how they are rendered."""
    return GenerateSpec(
        request_ids=[f"{id_prefix}-{i}" for i in range(req.n)],
        params=params,
        tenant=tenant,
        adapter=adapter,
        max_tokens=max_tokens,
        grammar_param=structure.param,
        add_special_tokens=req.add_special_tokens,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        priority=req.priority,
        background=background.get(),
        **prompt,
    )


# -- chat -------------------------------------------------------------------------------------------------
def chat_spec(state: ServerState, tenant: str, adapter, req: P.ChatCompletionRequest, rid: str):
    """A validated chat request as the engine's GenerateSpec, with its structure (grammar, tools), top
    logprobs (None: none) and whether the output is dropped (max_tokens 0). The Responses API
    (motet/api/responses/routes.py) runs its requests through here too."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    k = (req.top_logprobs or 0) if req.logprobs else None
    template = req.template  # the request's own (under --trust-request-chat-template), or None
    chat_template = template or state.system.model.chat_template
    fmt, reasoning = served_formats(state, chat_template)
    try:
        structure = structured_output(req, limits=state.grammar_limits, tool_format=fmt, reasoning=reasoning)
        messages, template_kwargs = prompt_messages(
            req.messages, structure, chat_template, trusted_template=template is None
        )
    except StructureError as e:
        raise from_structure_error(e) from None
    kwargs = {key: v for key, v in (req.chat_template_kwargs or {}).items() if key != "chat_template"}
    kwargs |= template_kwargs | {"add_generation_prompt": req.add_generation_prompt}
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    if template is not None:
        kwargs["chat_template"] = template
    # vLLM: echo asks for the prompt's logprobs too (top_logprobs of them); a stream has nowhere to put them
    prompt_k = req.prompt_logprobs
    if prompt_k is None and req.echo and not req.stream:
        prompt_k = req.top_logprobs or 0
    params, engine_max, drop = build_params(req, max_tokens, k, prompt_k, structure, state.sampling_defaults)
    prompt = {"messages": messages, "chat_template_kwargs": kwargs, "prompt_param": "messages"}
    spec = generate_spec(req, rid, params, tenant, adapter, engine_max, structure, **prompt)
    return spec, structure, k, drop


def response_role(req: P.ChatCompletionRequest) -> str:
    """vLLM's: the assistant's, unless no generation prompt was added (the last message's role goes on)."""
    return "assistant" if req.add_generation_prompt else req.messages[-1]["role"]


def echoed(req: P.ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content, when it has the response's role."""
    last = req.messages[-1]
    return (last.get("content") or "") if req.echo and last["role"] == response_role(req) else ""


def served_formats(
    state: ServerState, chat_template: str | None
) -> tuple[ToolFormat, ReasoningFormat | None]:
    """How the served model writes tool calls and reasoning: the flags' formats, else its family's
    (motet/models/), else its chat template's markers."""
    family = state.system.model.family
    tools = tool_format(state.tool_call_parser or family.tool_format, chat_template)
    name = state.reasoning_parser
    if name is None:
        name = family.reasoning_format or template_reasoning(chat_template)
    return tools, reasoning_format(name)


def chat_output(state: ServerState, adm: Admission, structure: Structure) -> Callable[[], ChatOutput]:
    """Makes one choice's output splitter: reasoning (when the prompt already opened it), tool calls."""

    def output() -> ChatOutput:
        fmt = structure.reasoning
        started = fmt is not None and fmt.started(adm.prompt_text)
        tools = structure.tool_mode != "none"
        return ChatOutput(fmt, started, tools=tools, tool_format=structure.tool_format)

    return output
