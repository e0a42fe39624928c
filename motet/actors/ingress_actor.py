"""The ingress actor: chat template and tokenization (in worker threads), validation, admission.

Each submission is handled in its own task so one long prompt does not hold up the others; the
tokenizer runs in worker threads (a few at a time) so the event loop never does it. A request that
passes becomes one queued request per choice; the adapter queues admit all of them or none (429),
also across the prompts of one multi-prompt completion.
"""

from __future__ import annotations

import logging
import time

import anyio
import anyio.to_thread

from motet.actors.messages import Admission, Enqueue, GenerateSpec, QueuedRequest, Submit
from motet.actors.reply import ReplyStream
from motet.actors.runtime import Actor
from motet.actors.serving_errors import InvalidRequest, ServerBusy, request_refusal
from motet.engine.request import EngineRequest, final_params
from motet.engine.request_checks import RequestError
from motet.engine.sampling_params import SamplingParams
from motet.grammar.specs import GrammarError
from motet.lora.adapter import AdapterError

log = logging.getLogger("motet.ingress")


class IngressActor(Actor):
    name = "ingress"

    def __init__(self, executor: Actor, queues: Actor, tokenizer_threads: int = 2):
        super().__init__()
        self.executor = executor
        self.queues = queues
        self.limiter = anyio.CapacityLimiter(tokenizer_threads)
        self.grammar_limiter = anyio.CapacityLimiter(4)  # threads waiting on grammar compilations
        self.engine = None
        self.tokenizer = None

    async def on_start(self) -> None:
        self.engine = engine = self.executor.engine
        self.tokenizer = engine.tokenizer
        # The grammar backends' view of the vocabulary takes a moment to build: not on a request's time.
        await anyio.to_thread.run_sync(lambda: engine.grammar_tokenizer)

    async def main(self) -> None:
        async with anyio.create_task_group() as tg:  # on close, waits for the submissions in flight
            async for envelope in self._recv:
                tg.start_soon(self.deliver, envelope)

    async def handle(self, message: Submit) -> list[Admission]:
        admissions, requests = [], []
        for spec in message.specs:
            phases = []
            if spec.adapter is not None:
                t0 = time.perf_counter()
                read = await self._load_adapter(spec)
                phases.append(("adapter_load", t0, time.perf_counter(), {"motet.adapter.cached": not read}))
            bad_words = await self._bad_words(spec)
            prompt_ids, text = await self._tokenize(spec)
            params = self._validate(spec, prompt_ids, bad_words)
            arrival = time.monotonic()
            t0 = time.perf_counter()
            grammar = await self._compile(spec)
            if grammar is not None:
                phases.append(("grammar_compile", t0, time.perf_counter(), {}))
            # The request's one record per choice, final from here to the engine (motet/engine/request.py).
            queued = [
                QueuedRequest(
                    EngineRequest(
                        request_id,
                        prompt_ids,
                        p,
                        spec.adapter,
                        grammar,
                        spec.tenant,
                        spec.priority,
                        spec.background,
                        arrival,
                    ),
                    ReplyStream(request_id),
                )
                for request_id, p in zip(spec.request_ids, params, strict=True)
            ]
            requests += queued
            admissions.append(Admission(prompt_ids, [r.stream for r in queued], text, phases))
        # One Enqueue for every prompt of the submission: all are queued, or none (429).
        await self.queues.ask(Enqueue(requests))
        return admissions

    async def _load_adapter(self, spec: GenerateSpec) -> bool:
        """Read and validate the adapter's files now, in a worker thread (cached after the first time),
        so the engine's thread never waits on a disk; 404 if they are gone, 400 if they do not fit. True: the files were read now."""
        ref = spec.adapter
        try:
            return await anyio.to_thread.run_sync(self.engine.adapters.load, ref, limiter=self.limiter)
        except AdapterError as e:
            raise request_refusal(e, ref) from None

    async def _compile(self, spec: GenerateSpec):
        """The request's grammar, compiled (cached, with a time limit) in a worker thread; 400 if it cannot be,
        503 if this tenant's own compilations past their limit are still running."""
        params = spec.params[0]
        if params.grammar is None:
            return None
        try:
            return await anyio.to_thread.run_sync(
                lambda: self.engine.compile_grammar(
                    params.grammar, params.grammar_backend, owner=spec.tenant
                ),
                limiter=self.grammar_limiter,
            )
        except GrammarError as e:
            if e.reason == "busy":
                raise ServerBusy(str(e), param=spec.grammar_param) from None
            raise InvalidRequest(f"{spec.grammar_param}: {e}", param=spec.grammar_param) from None

    async def _bad_words(self, spec: GenerateSpec) -> list[list[list[int]] | None]:
        """Each choice's bad_words as token sequences, here in a worker thread rather than on the engine's."""
        if not spec.params[0].bad_words:
            return [None] * len(spec.params)
        return await anyio.to_thread.run_sync(
            lambda: [self.engine.bad_words_token_ids(p) for p in spec.params], limiter=self.limiter
        )

    async def _render(self, spec: GenerateSpec, max_chars: int) -> str:
        """The chat rendered with the model's template, or the request's own (then at most max_chars + 1
        characters come back: more is refused here, naming the template)."""
        own = spec.chat_template_kwargs.get("chat_template") is not None
        param = "chat_template" if own else spec.prompt_param
        try:
            text = await anyio.to_thread.run_sync(
                lambda: self.tokenizer.render_chat(
                    spec.messages, max_chars=max_chars, **spec.chat_template_kwargs
                ),
                limiter=self.limiter,
            )
        except ValueError as e:
            raise InvalidRequest(str(e), param=param) from None
        if own and len(text) > max_chars:
            raise RequestError(
                f"the request's chat_template renders more than {max_chars} characters, more than the prompt "
                "may have",
                param,
                "context_length_exceeded",
            )
        return text

    async def _tokenize(self, spec: GenerateSpec) -> tuple[list[int], str]:
        """The prompt's token ids and its text (rendered from the messages, as given, or "" for token ids;
        the kept tokens' text when truncate_prompt_tokens cut it)."""
        tok, limits = self.tokenizer, self.engine.limits
        truncating = spec.truncate_prompt_tokens is not None
        try:
            keep = limits.tokens_to_keep(spec.truncate_prompt_tokens, spec.max_tokens)
            if spec.messages is not None:
                text = await self._render(spec, limits.max_text_chars(truncating))
            elif isinstance(spec.prompt, str):
                text = spec.prompt
            else:
                text = None
            if text is not None:
                limits.check_text(text, spec.prompt_param, truncating)
                ids = await anyio.to_thread.run_sync(
                    lambda: tok.hf.encode(text, add_special_tokens=spec.special_tokens), limiter=self.limiter
                )
            else:
                ids, text = list(spec.prompt or []), ""
        except RequestError as e:
            raise request_refusal(e) from None
        if keep is not None and len(ids) > keep:
            ids = ids[len(ids) - keep :]
            text = await anyio.to_thread.run_sync(
                lambda: tok.decode(ids, skip_special_tokens=False), limiter=self.limiter
            )
        return ids, text

    def _validate(
        self, spec: GenerateSpec, ids: list[int], bad_words: list[list[list[int]] | None]
    ) -> list[SamplingParams]:
        """Each choice's final params (its bad_words' tokens, and max_tokens where the request left it to the
        context window), checked against the model's limits with the prompt."""
        limits, n = self.engine.limits, len(ids)
        try:
            limits.check_prompt(ids, spec.prompt_param)
            if spec.max_tokens is not None:
                limits.check_max_tokens(n, spec.max_tokens)
            max_tokens = limits.max_model_len - n if spec.max_tokens is None else None
            params = [final_params(p, max_tokens, b) for p, b in zip(spec.params, bad_words, strict=True)]
            for p in params:
                limits.check_params(p)
        except RequestError as e:
            raise request_refusal(e) from None
        return params
