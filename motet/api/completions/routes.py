"""The OpenAI endpoints: /v1/chat/completions and /v1/completions.

A handler validates the body, resolves tenant and model, turns the request into a GenerateSpec (one
SamplingParams per choice), submits it to the actors (that plumbing, shared with the other generation routes:
motet/api/completions/generation.py) and either collects the reply streams into one response or relays them as
SSE chunks (motet/api/streams.py). A client that goes away aborts its requests.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from motet.api.billing import Bill
from motet.api.choice import Choice
from motet.api.completions import protocol as P
from motet.api.completions.generation import (
    accept_request,
    build_params,
    chat_output,
    chat_spec,
    client_request_id,
    echoed,
    generate_spec,
    response_role,
    submit,
    with_request_id,
    with_warnings,
)
from motet.api.completions.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from motet.api.errors import from_structure_error
from motet.api.openapi import operation
from motet.api.streams import Chunks, EventStream, collect, in_flight, observe, read_deltas, usage
from motet.grammar.structure import StructureError, structured_output


@operation("chat completion", tag="Chat", body=P.ChatCompletionRequest, ok=P.ChatCompletionResponse,
           stream=P.ChatCompletionChunk, example=lambda model: {
               "model": model, "messages": [{"role": "user", "content": "Say hello in one sentence."}],
               "max_completion_tokens": 32})  # fmt: skip
async def chat_completions(request: Request) -> Response:
    state, tenant, req, adapter = await accept_request(request, P.ChatCompletionRequest)
    request_id = client_request_id(request, req)
    rid = f"chatcmpl-{request_id}"  # the response's id
    spec, structure, k, drop = chat_spec(state, tenant, adapter, req, f"chatcmpl-{uuid.uuid4().hex}")
    arrival = time.perf_counter()
    with in_flight(state) as streams:
        (adm,) = await submit(state, spec)
        streams += adm.streams
        state.metrics.prompt_tokens.inc(len(adm.prompt_token_ids))
        choices = [Choice(i, adm.prompt_token_ids, arrival) for i in range(req.n)]
        bill = Bill(
            state.system.model.max_model_len, state.usage, [adm.prompt_token_ids], choices, streams, drop
        )
        bill.reserve(spec.max_tokens)
        created = int(time.time())
        output = chat_output(state, adm, structure)
        if req.stream:
            chunks = _chat_chunks(state, req, rid, created, choices, streams, k, drop, output, bill)
            response = with_warnings(EventStream(state, streams, chunks, bill), structure, rid)
            return with_request_id(response, request_id)
        await collect(request, state, choices, streams, bill)
        role, lead = response_role(req), echoed(req)
        as_ids = bool(req.return_tokens_as_token_ids)
        out = []
        for c in choices:
            message, finish_reason = output().message("" if drop else c.text, c.finish_reason)
            message.role = role
            if lead:
                message.content = lead + (message.content or "")
            logprobs = chat_logprobs(state, c.logprobs, k, as_ids) if k is not None and not drop else None
            token_ids = ([] if drop else c.token_ids) if req.return_token_ids else None
            out.append(
                P.ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    token_ids=token_ids,
                )
            )
        prompt_ids = adm.prompt_token_ids
        resp = P.ChatCompletionResponse(
            id=rid,
            created=created,
            model=req.model,
            choices=out,
            usage=usage([prompt_ids], choices, drop),
            prompt_token_ids=prompt_ids if req.return_token_ids else None,
            prompt_logprobs=prompt_logprobs(state, prompt_ids, choices[0].prompt_logprobs)
            if spec.params[0].prompt_logprobs is not None
            else None,
        )
        return with_request_id(with_warnings(JSONResponse(resp.model_dump()), structure, rid), request_id)


async def _chat_chunks(
    state, req, rid, created, choices, streams, k, drop, output, bill
) -> AsyncIterator[str]:
    prompt_ids = choices[0].prompt_ids
    as_ids = bool(req.return_tokens_as_token_ids)
    envelope = Chunks(req, rid, "chat.completion.chunk", created, choices, drop)

    def chunk(index, delta: dict, logprobs=None, finish_reason=None, token_ids=None, **top) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if req.return_token_ids:
            choice["token_ids"] = token_ids or []
        return envelope(index, choice, **top)

    outputs = [output() for _ in choices]
    first = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
    role, lead = response_role(req), echoed(req)
    for c in choices:
        yield chunk(c.index, {"role": role, "content": ""}, **first)
        if lead:
            yield chunk(c.index, {"content": lead})
    async for i, delta in read_deltas(streams, choices):
        c = choices[i]
        if (delta.text or delta.logprobs or delta.token_ids) and not drop:
            lp = chat_logprobs(state, delta.logprobs, k, as_ids).model_dump() if k is not None else None
            ids = delta.token_ids
            deltas = outputs[i].feed(delta.text)
            if outputs[i].plain:  # text and its logprobs in one chunk, as before
                if delta.text or lp is not None or req.return_token_ids:
                    yield chunk(i, {"content": delta.text}, lp, token_ids=ids)
            else:
                for j, d in enumerate(deltas):
                    yield chunk(i, d, lp if j == 0 else None, token_ids=ids if j == 0 else None)
                if (lp is not None or req.return_token_ids) and not deltas:
                    yield chunk(i, {}, lp, token_ids=ids)
        if delta.finished:
            observe(state, c, choices)
            deltas, finish_reason = outputs[i].finish(c.finish_reason) if not drop else ([], c.finish_reason)
            for d in deltas:
                yield chunk(i, d)
            yield chunk(i, {}, finish_reason=finish_reason)
    bill.close()
    for last in envelope.last([prompt_ids]):
        yield last


# -- completions ------------------------------------------------------------------------------------------
def _prompts(req: P.CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if isinstance(p[0], int):
        return [p]
    return list(p)


@operation("text completion", tag="Completions", body=P.CompletionRequest, ok=P.CompletionResponse,
           stream=P.CompletionResponse, example=lambda model: {
               "model": model, "prompt": "The capital of France is", "max_tokens": 16})  # fmt: skip
async def completions(request: Request) -> Response:
    state, tenant, req, adapter = await accept_request(request, P.CompletionRequest)
    request_id = client_request_id(request, req)
    rid = f"cmpl-{request_id}"  # the response's id
    internal = f"cmpl-{uuid.uuid4().hex}"
    max_tokens = (
        req.max_tokens if req.max_tokens is not None else state.sampling_defaults.get("max_tokens", 16)
    )
    k = req.logprobs
    try:
        structure = structured_output(req, allow_tools=False, limits=state.grammar_limits)
    except StructureError as e:
        raise from_structure_error(e) from None
    prompt_k = req.prompt_logprobs if req.prompt_logprobs is not None else (k if req.echo else None)
    params, engine_max, drop = build_params(
        req, max_tokens, k, prompt_k, structure, defaults=state.sampling_defaults
    )
    prompts = _prompts(req)
    arrival = time.perf_counter()
    with in_flight(state) as streams:
        specs = [
            generate_spec(
                req, f"{internal}-{p_idx}", params, tenant, adapter, engine_max, structure, prompt=prompt
            )
            for p_idx, prompt in enumerate(prompts)
        ]
        admissions = await submit(state, *specs)
        for adm in admissions:
            streams += adm.streams
            state.metrics.prompt_tokens.inc(len(adm.prompt_token_ids))
        choices = [
            Choice(p * req.n + i, adm.prompt_token_ids, arrival, prompt_index=p)
            for p, adm in enumerate(admissions)
            for i in range(req.n)
        ]
        bill = Bill(
            state.system.model.max_model_len,
            state.usage,
            [a.prompt_token_ids for a in admissions],
            choices,
            streams,
            drop,
        )
        bill.reserve(engine_max)
        # what echo shows: the prompt as given, or as the tokens it was cut to (token-id prompts: decoded)
        decode = state.system.model.decode
        prompt_texts = [
            a.prompt_text or decode(a.prompt_token_ids, skip_special_tokens=False) for a in admissions
        ]
        created = int(time.time())
        if req.stream:
            gen = _completion_chunks(
                state, req, rid, created, choices, streams, prompt_texts, admissions, drop, bill
            )
            response = with_warnings(EventStream(state, streams, gen, bill), structure, rid)
            return with_request_id(response, request_id)
        await collect(request, state, choices, streams, bill)
        as_ids = bool(req.return_tokens_as_token_ids)
        out = []
        for c in choices:
            p = c.index // req.n
            text = "" if drop else c.text
            lps = None
            if k is not None:
                prompt_ids = c.prompt_ids if req.echo else None
                lps = completion_logprobs(
                    state, [] if drop else c.logprobs, prompt_ids, c.prompt_logprobs, as_ids=as_ids, k=k
                )
            if req.echo:
                text = prompt_texts[p] + text
            out.append(
                P.CompletionChoice(
                    index=c.index,
                    text=text,
                    logprobs=lps,
                    finish_reason=c.finish_reason,
                    prompt_logprobs=prompt_logprobs(state, c.prompt_ids, c.prompt_logprobs)
                    if prompt_k is not None
                    else None,
                    prompt_token_ids=c.prompt_ids if req.return_token_ids else None,
                    token_ids=([] if drop else c.token_ids) if req.return_token_ids else None,
                )
            )
        resp = P.CompletionResponse(
            id=rid,
            created=created,
            model=req.model,
            choices=out,
            usage=usage([a.prompt_token_ids for a in admissions], choices, drop),
        )
        return with_request_id(with_warnings(JSONResponse(resp.model_dump()), structure, rid), request_id)


async def _completion_chunks(
    state, req, rid, created, choices, streams, prompt_texts, admissions, drop, bill
):
    as_ids = bool(req.return_tokens_as_token_ids)
    envelope = Chunks(req, rid, "text_completion", created, choices, drop)

    def chunk(index, text, logprobs=None, finish_reason=None, token_ids=None, prompt_ids=None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if req.return_token_ids:
            choice["token_ids"] = token_ids or []
            if prompt_ids is not None:
                choice["prompt_token_ids"] = prompt_ids
        return envelope(index, choice)

    k = req.logprobs
    started = set()
    async for i, delta in read_deltas(streams, choices):
        c = choices[i]
        text, lps, echo_ids, first_ids = delta.text, [] if drop else delta.logprobs, None, None
        if drop:
            text = ""
        if i not in started:
            started.add(i)
            first_ids = c.prompt_ids
            if req.echo:
                text = prompt_texts[i // req.n] + text
                echo_ids = c.prompt_ids
        lp = None
        if k is not None:
            lp = completion_logprobs(state, lps, echo_ids, c.prompt_logprobs, as_ids=as_ids, k=k).model_dump()
        token_ids = [] if drop else delta.token_ids
        if (
            text
            or (lp and lp["tokens"])
            or delta.finished
            or (req.return_token_ids and (token_ids or first_ids))
        ):
            yield chunk(i, text, lp, c.finish_reason if delta.finished else None, token_ids, first_ids)
        elif first_ids is not None:
            started.discard(i)  # nothing sent yet: the prompt's ids (and echo) go with the first chunk sent
        if delta.finished:
            observe(state, c, choices)
    bill.close()
    for last in envelope.last([a.prompt_token_ids for a in admissions]):
        yield last
