"""The synchronous engine: requests in, per-step output deltas out; and `LLM`, its offline front.

One `step()` = schedule, run the model, advance the sequences, detokenize, check stops. The serving
actors drive `step()` from the executor thread; scripts and tests use `LLM.generate`.

LoRA adapters are registered by name (`add_lora`) and get a fresh positive id each time, so the prefix
cache, keyed by id, never mixes two versions of a name. `remove_lora` refuses new requests at once; the
adapter is dropped from the slot cache when the last request already using it finishes.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.checkpoint import load_model_config
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.guided import GuidedDecoding
from engine.model_runner import ModelRunner
from engine.model_store import resolve_model
from engine.request_checks import RequestLimits
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, TokenLogprob
from engine.tokenizer import load_tokenizer
from grammar.backend import CompiledGrammar, GrammarTokenizer
from grammar.cache import GrammarCache
from grammar.specs import GrammarSpec
from lora.adapter import AdapterError, LoRAAdapter, load_adapter

log = logging.getLogger("motet.engine")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""  # all output text so far
    delta: str = ""  # text new in this step
    token_ids: list[int] = field(default_factory=list)  # all output tokens so far
    num_new_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # the request failed (finish_reason "abort"); the others in its step did not


class _RequestState:
    """What the engine keeps per request beside its Sequence: detokenizer and stop-string state."""

    def __init__(self, request_id: str, seq: Sequence, tokenizer):
        self.request_id = request_id
        self.seq = seq
        self.detok = IncrementalDetokenizer(
            tokenizer.hf, seq.prompt_token_ids, seq.params.skip_special_tokens
        )
        self.stops = StopStringMatcher(seq.params.stop, seq.params.include_stop_str_in_output)
        self.text = ""
        self.num_emitted = seq.num_tokens  # tokens already reported in a RequestOutput


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model_dir=None):
        self.config = config = config or EngineConfig()
        self.model_dir = model_dir or resolve_model(config.model)
        self.model_config = load_model_config(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.runner = ModelRunner(self.model_dir, self.model_config, config)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_loras=config.max_loras,
            lora_time_slice=config.lora_time_slice,
        )
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.limits = RequestLimits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            max_kv_tokens=self.runner.num_blocks * config.block_size,
        )
        self.requests: dict[str, _RequestState] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.loras: dict[str, int] = {}  # adapter name -> id, for new requests
        self._lora_live: set[int] = set()  # ids in self.loras
        self._lora_ids = itertools.count(1)
        self._lora_users: Counter[int] = Counter()  # adapter id -> unfinished requests using it
        self.grammar_cache = GrammarCache()

    # -- structured output ----------------------------------------------------------------------------
    @functools.cached_property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The vocabulary as the grammar backends see it (built on first use: it takes a moment)."""
        return GrammarTokenizer(
            self.tokenizer.hf,
            vocab_size=self.model_config.vocab_size,
            stop_token_ids=sorted(self.eos_token_ids),
        )

    def compile_grammar(self, spec: GrammarSpec, backend: str | None = None) -> CompiledGrammar:
        """Compile (cached) with `backend` or the engine's, falling back to the other; GrammarError if
        no backend can within the time limit. Thread-safe: the serving layer calls it off the loop."""
        return self.grammar_cache.compile_with_fallback(
            spec,
            self.grammar_tokenizer,
            backend or self.config.grammar_backend,
            self.config.grammar_timeout_s,
        )

    # -- adapters -------------------------------------------------------------------------------------
    def add_lora(self, name: str, path, adapter: LoRAAdapter | None = None) -> int:
        """Register a PEFT LoRA adapter directory under `name`; returns its id (AdapterError if invalid).

        `adapter`: the directory already loaded with `load_adapter` (the serving layer loads it off the
        event loop, then registers it between steps). Adding an existing name replaces it: requests
        already using the old version finish with it."""
        if not name or not isinstance(name, str):
            raise AdapterError(f"adapter name must be a non-empty string, got {name!r}")
        if adapter is None:
            adapter = load_adapter(path, self.model_config, max_rank=self.config.max_lora_rank, name=name)
        elif adapter.rank > self.config.max_lora_rank:
            raise AdapterError(
                f"adapter {name!r} has rank {adapter.rank}, above max_lora_rank {self.config.max_lora_rank}"
            )
        if name in self.loras:
            self.remove_lora(name)
        adapter_id = next(self._lora_ids)
        self.runner.loras.register(adapter_id, path, adapter)
        self.loras[name] = adapter_id
        self._lora_live.add(adapter_id)
        return adapter_id

    def remove_lora(self, name: str) -> None:
        """New requests for `name` are refused from now on; requests already using it finish."""
        adapter_id = self.loras.pop(name, None)
        if adapter_id is None:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        self._lora_live.discard(adapter_id)
        if not self._lora_users[adapter_id]:
            self.runner.loras.unregister(adapter_id)

    def _resolve_adapter(self, adapter: int | str | None) -> int:
        if not adapter:  # 0 or None: the base model
            return 0
        if isinstance(adapter, str):
            if adapter not in self.loras:
                raise AdapterError(f"no adapter named {adapter!r} is loaded")
            return self.loras[adapter]
        if adapter not in self._lora_live:
            raise AdapterError(f"adapter id {adapter} is not loaded (removed, or never added with add_lora)")
        return adapter

    def _release(self, seq: Sequence) -> None:
        """A request is gone: drop its adapter from the slot cache if it was removed and this was its last user."""
        a = seq.adapter_id
        if a:
            self._lora_users[a] -= 1
            if not self._lora_users[a]:
                del self._lora_users[a]
                self.runner.loras.unpin(a)
                if a not in self._lora_live:
                    self.runner.loras.unregister(a)

    # -- requests -------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapter_id: int | str | None = 0,
        grammar: CompiledGrammar | None = None,
    ) -> str:
        """Queue a request; `adapter_id` is an id from `add_lora` or the adapter's name (0 or None: base model).

        `grammar`: `params.grammar` already compiled (`compile_grammar`); otherwise it is compiled here."""
        params = params or SamplingParams()
        if params.grammar is not None and grammar is None:
            grammar = self.compile_grammar(params.grammar, params.grammar_backend)
        adapter_id = self._resolve_adapter(adapter_id)
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.limits.check_prompt(token_ids)
        self.limits.check_params(params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(
            token_ids, params, adapter_id=adapter_id, request_id=request_id, arrival=next(self._arrivals)
        )
        if grammar is not None:
            seq.guided = GuidedDecoding(grammar.matcher(), "</think>" if params.reasoning else None)
        pin = adapter_id and not self._lora_users[adapter_id]
        if pin:  # its files may be deleted while it runs: keep the host copy (AdapterError if it is gone)
            self.runner.loras.pin(adapter_id)
        try:
            self.scheduler.add(seq)
        except ValueError:
            if pin:
                self.runner.loras.unpin(adapter_id)
            raise
        self.requests[request_id] = _RequestState(request_id, seq, self.tokenizer)
        if adapter_id:
            self._lora_users[adapter_id] += 1
        return request_id

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.finish(state.seq, "abort")
        self._release(state.seq)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        result = self.runner.execute(batch)
        return self.process(batch, result)

    def process(self, batch: ScheduledBatch, result) -> list[RequestOutput]:
        """Apply a step's result: advance, append tokens, detokenize, check stops, free the finished."""
        self.scheduler.advance(batch)
        outputs = []
        for i, seq in enumerate(batch.seqs):
            state = self.requests.get(seq.request_id)
            if state is None or seq.is_finished:  # aborted while the step ran
                continue
            if result.prompt_logprobs[i]:
                seq.prompt_logprobs.extend(result.prompt_logprobs[i])
            token = result.token_ids[i]
            if token is None:
                continue
            if result.logprobs[i] is not None:
                seq.output_logprobs.append(result.logprobs[i])
            try:
                outputs.append(self._advance(state, token))
            except Exception as e:  # one request's failure (a grammar backend bug, ...) is its own
                log.exception("request %s failed while processing its token", state.request_id)
                self.abort(state.request_id)
                outputs.append(
                    RequestOutput(
                        state.request_id,
                        seq.prompt_token_ids,
                        finished=True,
                        finish_reason="abort",
                        error=repr(e),
                    )
                )
        return outputs

    def _advance(self, state: _RequestState, token: int) -> RequestOutput:
        """Append the sampled token, and the tokens its grammar then forces (jump-forward)."""
        seq, g = state.seq, state.seq.guided
        if g is not None and not g.accept(token):
            # Every token the grammar allows was masked out by another setting (min_tokens holding
            # back the stop token the grammar needs): end here, the output still matches so far.
            delta = state.stops.feed(state.detok.flush())[0] + state.stops.flush()
            finish = ("stop", None)
        else:
            delta, finish = self._append(state, token)
        if g is not None and finish is None:
            forced = []
            if self.config.jump_forward and seq.params.logprobs is None:
                forced = g.jump_forward(lambda text: self.tokenizer.hf.encode(text, add_special_tokens=False))
            self.runner.grammar_stats.jump_forward_tokens += len(forced)
            for t in forced:
                more, finish = self._append(state, t)
                delta += more
                if finish is not None:
                    break
        if finish is not None:
            reason, stop_reason = finish
            self.scheduler.finish(seq, reason, stop_reason)
            del self.requests[state.request_id]
            self._release(seq)
        else:
            reason = stop_reason = None
        num_new = seq.num_tokens - state.num_emitted
        state.num_emitted = seq.num_tokens
        state.text += delta
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=state.text,
            delta=delta,
            token_ids=seq.output_token_ids,
            num_new_tokens=num_new,
            finished=finish is not None,
            finish_reason=reason,
            stop_reason=stop_reason,
            logprobs=seq.output_logprobs,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def _append(self, state: _RequestState, token: int) -> tuple[str, tuple | None]:
        """Append one token: its text delta, and (finish_reason, stop_reason) if it ends the request."""
        seq, params = state.seq, state.seq.params
        seq.append_token(token)
        text = state.detok.push(token)
        if seq.guided is not None:
            seq.guided.observe_text(text)
        delta, stopped = state.stops.feed(text)
        finish = None
        if stopped:
            finish = ("stop", state.stops.matched)
        elif (
            token in self.eos_token_ids
            and not params.ignore_eos
            and seq.num_output_tokens > params.min_tokens
        ) or (seq.guided is not None and seq.guided.terminated):  # the grammar accepted its stop token
            finish = ("stop", None)
        elif token in params.stop_token_ids and seq.num_output_tokens > params.min_tokens:
            finish = ("stop", token)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            finish = ("length", None)
        if finish is not None and not stopped:
            delta += state.stops.feed(state.detok.flush())[0] + state.stops.flush()
        return delta, finish


class LLM:
    """Offline generation for scripts and tests: `LLM().generate(["Hello"], SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **engine_options):
        config = EngineConfig(model=model or EngineConfig.model, **engine_options)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def add_lora(self, name: str, path) -> int:
        return self.engine.add_lora(name, path)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        adapter_ids: Seq[int | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt to the end; `adapter_ids` gives each prompt's adapter (id or name)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
        ids = [
            self.engine.add_request(p, sp, adapter_id=(adapter_ids[i] if adapter_ids else 0))
            for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True))
        ]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def chat(self, conversations, params=None, **kw) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode_chat(c, **kw) for c in conversations]
        return self.generate(prompts, params)
