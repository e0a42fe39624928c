"""A request's preparation before it is queued (vLLM V1's Processor): the chat rendered with its template and
tokenized, the prompt checked against the model's limits and cut to `truncate_prompt_tokens`, the final
sampling params, the adapter's files loaded and checked, the grammar compiled; a refusal is a ServingError
(motet/actors/serving_errors.py) that names the field.

The ingress actor (motet/actors/ingress_actor.py) calls it from worker threads, several requests at once, and
it is thread-safe by what it holds:

- the ModelView (tokenizer, limits read back by the API): frozen; the Hugging Face fast tokenizer is used
  read-only (encode, decode, apply_chat_template; its truncation and padding are never set);
- the engine's RequestLimits: frozen;
- the grammar cache: thread-safe (its own lock), compiling against the engine's GrammarTokenizer, built once
  when this is (`of`, in a worker thread: it takes a moment) and only read after;
- the adapter manager's `load`, which takes the manager's lock; nothing else of the manager (the rest is the
  engine's thread's).

Nothing here touches the engine's step state (its sequences, blocks, scheduler): that is the engine thread's
(motet/actors/executor.py; an overlapped engine's forward thread is given values only: motet/engine/stepping.py),
and a prepared request reaches it whole, as an EngineRequest.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from motet.actors.messages import GenerateSpec
from motet.actors.serving_errors import request_refusal
from motet.engine.model_view import ModelView
from motet.engine.request import final_params
from motet.engine.request_checks import RequestError, RequestLimits
from motet.engine.sampling_params import SamplingParams
from motet.engine.worker.token_masks import bad_words_token_ids
from motet.grammar.backend import CompiledGrammar, GrammarTokenizer
from motet.grammar.cache import GrammarCache
from motet.grammar.specs import GrammarError
from motet.lora.adapter import AdapterError
from motet.lora.manager import AdapterRef


class InputProcessor:
    def __init__(
        self,
        model: ModelView,
        limits: RequestLimits,
        grammars: GrammarCache,
        grammar_tokenizer: GrammarTokenizer,
        grammar_backend: str,
        grammar_timeout_s: float,
        load_adapter: Callable[[AdapterRef], bool],
    ):
        self.model, self.limits = model, limits
        self.grammars, self.grammar_tokenizer = grammars, grammar_tokenizer
        self.grammar_backend, self.grammar_timeout_s = grammar_backend, grammar_timeout_s
        self._load_adapter = load_adapter

    @classmethod
    def of(cls, engine, model: ModelView) -> InputProcessor:
        """The preparation of requests for a loaded LLMEngine; builds its grammar vocabulary (a moment's work:
        call it in a worker thread, before the first request)."""
        config = engine.config
        return cls(
            model,
            engine.limits,
            engine.grammar_cache,
            engine.grammar_tokenizer,
            config.grammar_backend,
            config.grammar_timeout_s,
            engine.adapters.load,
        )

    def load_adapter(self, spec: GenerateSpec) -> bool:
        """Read and validate the request's adapter files (cached after the first time) so the engine's thread
        never waits on a disk; 404 if they are gone, 400 if they do not fit. True: the files were read now."""
        try:
            return self._load_adapter(spec.adapter)
        except AdapterError as e:
            raise request_refusal(e, spec.adapter) from None

    def bad_words(self, spec: GenerateSpec) -> list[list[list[int]] | None]:
        """Each choice's bad_words as token sequences (None where there are none, or they are resolved)."""
        if not spec.params[0].bad_words:
            return [None] * len(spec.params)
        encode = functools.partial(self.model.encode, add_special_tokens=False)
        return [
            None
            if not p.bad_words or p.bad_words_token_ids is not None
            else bad_words_token_ids(p.bad_words, encode)
            for p in spec.params
        ]

    def prompt(self, spec: GenerateSpec) -> tuple[list[int], str]:
        """The prompt's token ids and its text (rendered from the messages, as given, or "" for token ids; the
        kept tokens' text when truncate_prompt_tokens cut it)."""
        limits, model = self.limits, self.model
        truncating = spec.truncate_prompt_tokens is not None
        try:
            keep = limits.tokens_to_keep(spec.truncate_prompt_tokens, spec.max_tokens)
            if spec.messages is not None:
                text = self._render(spec, limits.max_text_chars(truncating))
            elif isinstance(spec.prompt, str):
                text = spec.prompt
            else:
                text = None
            if text is not None:
                limits.check_text(text, spec.prompt_param, truncating)
                ids = model.encode(text, add_special_tokens=spec.special_tokens)
            else:
                ids, text = list(spec.prompt or []), ""
        except RequestError as e:
            raise request_refusal(e) from None
        if keep is not None and len(ids) > keep:
            ids = ids[len(ids) - keep :]
            text = model.decode(ids, skip_special_tokens=False)
        return ids, text

    def _render(self, spec: GenerateSpec, max_chars: int) -> str:
        """The chat rendered with the model's template, or the request's own (then at most max_chars + 1
        characters come back: more is refused here, naming the template)."""
        own = spec.chat_template_kwargs.get("chat_template") is not None
        param = "chat_template" if own else spec.prompt_param
        try:
            text = self.model.render_chat(spec.messages, max_chars=max_chars, **spec.chat_template_kwargs)
        except ValueError as e:
            raise request_refusal(e, param=param) from None
        if own and len(text) > max_chars:
            raise RequestError(
                f"the request's chat_template renders more than {max_chars} characters, more than the prompt "
                "may have",
                param,
                "context_length_exceeded",
            )
        return text

    def final_params(
        self, spec: GenerateSpec, ids: list[int], bad_words: list[list[list[int]] | None]
    ) -> list[SamplingParams]:
        """Each choice's final params (its bad_words' tokens, and max_tokens where the request left it to the
        context window), checked against the model's limits with the prompt."""
        limits, n = self.limits, len(ids)
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

    def grammar(self, spec: GenerateSpec) -> CompiledGrammar | None:
        """The request's grammar, compiled (cached, with a time limit) with its backend or the server's,
        falling back to the other; 400 if it cannot be, 503 if this tenant's own compilations past their limit
        are still running."""
        params = spec.params[0]
        if params.grammar is None:
            return None
        try:
            return self.grammars.compile_with_fallback(
                params.grammar,
                self.grammar_tokenizer,
                params.grammar_backend or self.grammar_backend,
                self.grammar_timeout_s,
                owner=spec.tenant,
            )
        except GrammarError as e:
            raise request_refusal(e, param=spec.grammar_param) from None
