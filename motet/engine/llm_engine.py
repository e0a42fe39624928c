"""The engine: requests in, per-step output deltas out. It owns its step, three stages:

    batch = engine.schedule()              what runs: decode rows and prefill chunks under one token budget; the
                                           rows advance (their chunks computed, each sampled token pending)
    result = engine.execute(batch)         the forward pass and sampling
    deltas = engine.commit(batch, result)  land the tokens, advance grammars, detokenize, stop; the engine
                                           ends the requests that finished (blocks, adapter, grammar)

`step()` runs them through one of two strategies (motet/engine/stepping.py): one after the other, or overlapped
(`EngineConfig.overlap_output`, on CUDA by default), where `execute` runs on a thread of its own and the commit's
text half (`commit_text`: detokenizing, stop strings, the deltas; motet/engine/output_commit.py) runs while the
next step computes. A step returns one `OutputDelta` per request it advanced, only what is new
(motet/engine/outputs.py, where `RequestOutputs` accumulates them into whole answers for whoever needs them). Its
parts each own their state: the scheduler the `Sequence`s, the structured outputs each request's grammar
(motet/engine/structured_output.py), the output commit each request's text (motet/engine/output_commit.py), which
returns what finished for the engine to end. The offline `LLM` (motet/engine/llm.py) and the executor actor
(motet/actors/executor.py) drive it through `add_request`, or `add` with a request built already
(motet/engine/request.py), `abort`, `step`, `has_unfinished`, `stats`, `close`, and adapters through `add_lora` /
`remove_lora`. A request that fails inside a step fails alone: `execute` bisects the batch until the failing rows
are isolated, and `commit` ends those with an error while the others carry on. Not thread-safe: one thread drives
it; the serving ingress's worker threads (motet/actors/input_processor.py) read `config`, `limits`,
`grammar_cache`, `grammar_tokenizer` and call `adapters.load`, each frozen or behind its own lock. The overlapped
strategy's forward thread is given each step as values (`forward_call`, made on the driving thread: the plan, the
LoRA segments, the grammar mask, the inputs) and hands back its result or its exception; a failing step is bisected
on the driving thread as it lands (`bisect`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from motet.engine.cache_contents import CacheContents
from motet.engine.config import EngineConfig
from motet.engine.core.block_manager import BlockManager, cache_scope
from motet.engine.core.fairness import TenantState, VirtualTokenCounter
from motet.engine.core.kv_blocks import KVLayout, model_identity
from motet.engine.core.kv_connector import GiB, KVConnector, KVTierStats, NoKVTiers
from motet.engine.core.kv_shared import SharedTier
from motet.engine.core.kv_tiers import DiskTier
from motet.engine.core.kv_window import WindowBlocks
from motet.engine.core.latency import TokenPace
from motet.engine.core.scheduler import ScheduledBatch, Scheduler
from motet.engine.core.sequence import Sequence
from motet.engine.guided import GuidedDecoding
from motet.engine.output_commit import LandedStep, OutputCommit, failed
from motet.engine.outputs import OutputDelta
from motet.engine.request import EngineRequest, final_params
from motet.engine.request_checks import RequestLimits
from motet.engine.sampling_params import SamplingParams
from motet.engine.speculative.history import DraftScope
from motet.engine.speculative.proposer import NoSpeculation, SpeculativeConfig, SpeculativeStats, Speculator
from motet.engine.stepping import OverlappedSteps, SequentialSteps
from motet.engine.structured_output import NO_MASK, GrammarStats, StructuredOutputs
from motet.engine.tokenizer import load_tokenizer
from motet.engine.weights import load_progress
from motet.engine.weights.model_config import load_model_config
from motet.engine.weights.model_store import resolve_model
from motet.engine.worker.memory import available_host_memory
from motet.engine.worker.model_runner import ForwardCall, ModelRunner, StepResult
from motet.engine.worker.parallel import RankFailure
from motet.engine.worker.sampler import SamplingError, SamplingFailure
from motet.engine.worker.token_masks import bad_words_token_ids
from motet.grammar.backend import CompiledGrammar, GrammarTokenizer
from motet.grammar.cache import GrammarCache
from motet.grammar.reasoning import ReasoningOpening, reasoning_format
from motet.grammar.specs import GrammarSpec
from motet.lora.manager import AdapterManager, AdapterRef, AdapterStats
from motet.models.declaration import ModelLoadError
from motet.models.rope_config import longrope_original
from motet.serial_imports import first_imports

log = logging.getLogger("motet.engine")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for admission control, metrics and routing (the serving system's
    `Stats` adds its queues'). Zeros by default: an engine with nothing to report."""

    num_waiting: int = 0
    num_running: int = 0
    free_seq_slots: int = 0  # requests the engine may take before it has max_num_seqs
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    adapters_pinned: int = 0  # adapter versions held for unfinished requests
    adapters: AdapterStats | None = None  # adapter memory: the pool, the host cache, loads
    running_adapters: tuple[str, ...] = ()  # engine names of the adapters of running requests
    waiting_adapters: tuple[str, ...] = ()  # of waiting requests, not also running
    grammar: GrammarStats = field(default_factory=GrammarStats)
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)  # zeros when speculation is off
    # Tokens processed so far, as vLLM counts them: a request's whole prompt (cached or not) once, when its
    # first token comes; every output token as it is committed.
    prompt_tokens: int = 0
    generation_tokens: int = 0
    tenants: tuple[TenantState, ...] = ()  # tenants with requests here, in the order they are served next
    kv_tiers: tuple[KVTierStats, ...] = ()  # the KV tiers past the device cache, if any (RAM, disk)
    cpu_kernels: str = ""  # the native CPU step's instruction-set tier (cpu_native.isa()); "" where none runs
    # The time between a running request's tokens now (latency.TokenPace; 0: not timed yet), for the estimates of
    # when a running request ends (a concurrency limit's Retry-After).
    token_s: float = 0.0
    # What its caches hold, for a router (stats(cache=True): a Ray replica's report); None where not asked for
    cache: CacheContents | None = None


# When every waiting request is waiting for its KV blocks and none runs, the step waits this long at most for a
# load to complete (rather than spin); a request arriving meanwhile waits no longer than that.
LOAD_WAIT_S = 0.05


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, model_dir=None):
        self.config = config = config or EngineConfig()
        self._grammar_tokenizer: GrammarTokenizer | None = None
        self._grammar_tokenizer_lock = threading.Lock()
        load_progress.phase("reading the model's config and tokenizer")
        self.model_dir = model_dir or resolve_model(config.model)
        self.model_config = load_model_config(self.model_dir, config.tokenizer)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_dir)
        self.runner = ModelRunner(self.model_dir, self.model_config, config)
        self.max_model_len = self.runner.max_model_len
        window = None
        if (
            self.runner.window
        ):  # its sliding-window layers keep their window only (motet/engine/core/kv_window.py)
            runner = self.runner
            window = WindowBlocks(
                runner.num_window_blocks, config.block_size, runner.ring, runner.window_chunk
            )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, window
        )
        self.kv_connector = self._kv_connector()
        self.adapters = AdapterManager(
            self.model_config,
            memory_bytes=self.runner.adapter_memory_bytes,
            host_bytes=self._adapter_host_bytes(),
            max_cpu_loras=config.max_cpu_loras,
            max_lora_rank=config.max_lora_rank,
            device=self.runner.device,
            dtype=self.runner.dtype,
            layout_base=self.runner.lora_layout_shape,
            shard=self.runner.lora_sharder,
            on_place=self.runner.workers.note_lora_placement if self.runner.workers is not None else None,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.step_tokens,
            max_step_tokens=config.max_step_tokens,
            max_loras=config.max_loras,
            lora_time_slice=config.lora_time_slice,
            fairness=VirtualTokenCounter(config.tenant_weights),
            kv_connector=self.kv_connector,
            adapters=self.adapters,
            tpot_target_s=config.tpot_target_s,
        )
        self._last_landed = 0.0  # when the latest step's tokens landed (a step's time, for latency.StepCost)
        self.token_pace = TokenPace()  # the time between a running request's tokens, for the API's estimates
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.limits = RequestLimits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            max_kv_tokens=self._max_kv_blocks() * config.block_size,
            eos_token_ids=frozenset(self.eos_token_ids),
        )
        self.structured_output = StructuredOutputs(self.model_config.vocab_size)  # the requests' grammars
        self.speculator: Speculator | NoSpeculation = NoSpeculation()
        if config.speculative_mode != "off" and config.num_speculative_tokens > 0:
            self.speculator = Speculator(
                SpeculativeConfig(config.num_speculative_tokens, config.speculative_overhead_tokens),
                lambda text: self.tokenizer.hf.encode(text, add_special_tokens=False),
                self.max_model_len,
                self.structured_output.get,
            )
        self.requests: dict[str, Sequence] = {}
        self.grammar_cache = GrammarCache()
        self.num_steps = 0
        self.output_commit = OutputCommit(  # the commit's text half; it counts the tokens, too
            config,
            self.eos_token_ids,
            self.max_model_len,
            self.tokenizer.hf,
            self.structured_output,
            self.scheduler.policy.fairness,
        )
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._failed: list[OutputDelta] = []  # requests whose adapter no longer loads, told at the next step
        self.stepping = (
            OverlappedSteps(self, self.runner.num_threads) if self._overlaps() else SequentialSteps(self)
        )
        load_progress.phase("warming up the step")
        self.runner.warm_up()  # before the first request (the server is ready once the engine is built)

    def _adapter_host_bytes(self) -> int:
        """The host cache of loaded adapters: a quarter of the pool on a CPU (where the pool is host memory too),
        the pool's fraction of the host memory beside a GPU."""
        if self.runner.device.type == "cpu":
            return self.runner.adapter_memory_bytes // 4
        return int(self.config.adapter_memory_fraction * available_host_memory())

    def _overlaps(self) -> bool:
        """Whether steps overlap their outputs (EngineConfig.overlap_output): "auto" where a core is spare."""
        mode = self.config.overlap_output
        if mode != "auto":
            return mode == "on"
        if self.runner.device.type != "cpu":
            return True
        return (os.cpu_count() or 1) > (self.runner.num_threads or torch.get_num_threads())

    def _max_kv_blocks(self) -> int:
        """The most blocks one sequence may hold: all of the pool, unless its window layers' pool is smaller
        than a ring (a sequence there holds as many window blocks as others, up to a ring)."""
        runner = self.runner
        if runner.window and runner.num_window_blocks < runner.ring:
            return min(runner.num_blocks, runner.num_window_blocks)
        return runner.num_blocks

    def _kv_connector(self) -> KVConnector | NoKVTiers:
        """The KV tiers the config asks for (EngineConfig.kv_offload_gb, kv_disk_gb, kv_shared_dir), or none."""
        config = self.config
        if config.kv_offload_gb <= 0 and config.kv_disk_gb <= 0 and not config.kv_shared_dir:
            return NoKVTiers()
        if self.runner.window:  # the tiers keep prefix-cache blocks, which a window pool does without
            raise ModelLoadError(
                f"the KV tiers (kv_offload_gb, kv_disk_gb, kv_shared_dir) extend the prefix cache, which a model "
                f"with a sliding window ({self.runner.window} tokens) has not past it: serve at most "
                f"{self.runner.window} tokens (--max-model-len) or leave the tiers out"
            )
        kv_caches = self.runner.kv_caches
        disk = shared = None
        layout = KVLayout.of(kv_caches)
        if config.kv_disk_gb > 0 or config.kv_shared_dir:
            identity = model_identity(self.model_dir, config.quantization, layout)
        if config.kv_disk_gb > 0:
            disk = DiskTier(config.kv_disk_dir, int(config.kv_disk_gb * GiB), identity, layout)
        if config.kv_shared_dir:
            shared = SharedTier(config.kv_shared_dir, int(config.kv_shared_gb * GiB), identity, layout)
        connector = KVConnector(kv_caches, self.block_manager, int(config.kv_offload_gb * GiB), disk, shared)
        self.block_manager.on_evict = connector.save_evicted
        return connector

    # -- structured output ----------------------------------------------------------------------------
    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The vocabulary as the grammar backends see it: built on first use (half a second or more, which no
        start waits for: the serving ingress builds it in a worker thread once it serves), once however many
        threads ask at once."""
        with self._grammar_tokenizer_lock:
            if self._grammar_tokenizer is None:
                # (transformers' tokenizer and the backends' libraries, maybe imported here first)
                with first_imports():
                    self._grammar_tokenizer = self._build_grammar_tokenizer()
            return self._grammar_tokenizer

    def _build_grammar_tokenizer(self) -> GrammarTokenizer:
        return GrammarTokenizer(
            self.tokenizer.transformers(),  # (the backends' libraries read a transformers tokenizer)
            vocab_size=self.model_config.vocab_size,
            stop_token_ids=sorted(self.eos_token_ids),
        )

    @functools.cached_property
    def _reasoning_openings(self) -> dict[tuple[tuple[str, ...], bool], ReasoningOpening]:
        return {}

    def reasoning_opening_of(self, starts: tuple[str, ...], exact: bool = False) -> ReasoningOpening:
        """Which tokens may open a reasoning format's `starts` at an output's start (built once per format);
        `exact`: which write them exactly (its end tag, forced when a bounded reasoning runs out)."""
        key = (starts, exact)
        if key not in self._reasoning_openings:
            self._reasoning_openings[key] = ReasoningOpening(
                self.grammar_tokenizer.decoded_vocab, starts, exact
            )
        return self._reasoning_openings[key]

    def compile_grammar(
        self, spec: GrammarSpec, backend: str | None = None, owner: str | None = None
    ) -> CompiledGrammar:
        """Compile (cached) with `backend` or the engine's, falling back to the others; GrammarError if
        no backend can within the time limit. `owner` (the tenant) is who overrunning compilations count
        against. Thread-safe (the grammar cache's lock); the serving ingress compiles through the same cache itself
        (motet/actors/input_processor.py)."""
        return self.grammar_cache.compile_with_fallback(
            spec,
            self.grammar_tokenizer,
            backend or self.config.grammar_backend,
            self.config.grammar_timeout_s,
            owner=owner,
        )

    # -- adapters -------------------------------------------------------------------------------------
    def add_lora(self, name: str, path, adapter=None) -> AdapterRef:
        """Serve the PEFT LoRA adapter directory at `path` as `name` (AdapterError if invalid). Adding an
        existing name replaces it: requests already using the old version finish with it."""
        return self.adapters.register(name, path, adapter)

    def remove_lora(self, name: str) -> None:
        """New requests for `name` are refused from now on; requests already using it finish."""
        self.adapters.remove(name)

    # -- requests -------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapter: AdapterRef | str | None = None,
        *,
        tenant: str | None = None,
        priority: int = 0,
        background: bool = False,
    ) -> str:
        """Queue a request (the offline way in, as vLLM's `LLMEngine.add_request`): its `EngineRequest` built
        here, where the serving ingress builds its own, and taken by `add`. `prompt`: text (encoded here) or token
        ids; `params`: bad_words resolved and `params.grammar` compiled here; `adapter`: a name given to `add_lora`
        (or a ref), None for the base model; the rest as the record's fields (motet/engine/request.py)."""
        params = params or SamplingParams()
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        grammar = None
        if params.grammar is not None:
            grammar = self.compile_grammar(params.grammar, params.grammar_backend)
        request = EngineRequest(
            request_id or f"req-{next(self._ids)}",
            token_ids,
            final_params(params, bad_words_token_ids=self.bad_words_token_ids(params)),
            self.adapters.resolve(adapter),
            grammar,
            tenant,
            priority,
            background,
        )
        return self.add(request)

    def add(self, request: EngineRequest) -> str:
        """Take a request whole: checked against the model's limits (RequestError), its adapter pinned (AdapterError
        if removed or known broken), queued as a `Sequence`. Its tenant shares prefix-cache blocks only with its
        own requests (unless the config shares the cache across tenants) of the same `params.cache_salt`, and
        speculation drafts only from the outputs of the same tenant, cache_salt and adapter under the same kind of
        grammar (a JSON schema, tool calls, none, ...)."""
        params, token_ids, tenant = request.params, request.prompt_token_ids, request.tenant
        self.limits.check_prompt(token_ids)
        self.limits.check_params(params)
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        ref = request.adapter
        uid = self.adapters.acquire(ref) if ref is not None else 0  # AdapterError if removed or known broken
        original = longrope_original(self.model_config.rope_scaling)
        cache = cache_scope(
            tenant, params.cache_salt, self.config.shared_prefix_cache, original, len(token_ids)
        )
        text = self.output_commit.start(request.request_id, token_ids, params, request.arrival_time)
        try:
            guided = None
            if request.grammar is not None:
                guided = self._guided(request.grammar, params, token_ids, text.detok.peek)
        except BaseException:
            self.output_commit.forget(request.request_id)
            self.adapters.release(uid)
            raise
        kind = params.grammar.kind if params.grammar is not None else None
        seq = Sequence.from_request(
            request, uid, cache, next(self._arrivals), guided is None and not text.stops.reads_text
        )
        self.speculator.admit(seq.seq_id, DraftScope(tenant, params.cache_salt, uid, kind, params.reasoning))
        if guided is not None:
            self.structured_output.add(request.request_id, guided)
        self.scheduler.add(seq)
        self.requests[request.request_id] = seq
        return request.request_id

    def _guided(
        self, grammar: CompiledGrammar, params: SamplingParams, prompt: list[int], peek
    ) -> GuidedDecoding:
        """The constraint: from the output's first token, or with `params.reasoning` (a reasoning format) after
        its end (`</think>`) when the prompt opened its reasoning or the output's first tokens do; with
        `params.bound_reasoning`, that end forced after half of max_tokens (motet/engine/guided.py). `peek`: the
        text tokens would add to the output (its detokenizer's)."""
        fmt = reasoning_format(params.reasoning)
        if fmt is None:
            return GuidedDecoding(grammar.matcher(), peek=peek)
        started = fmt.started(self.tokenizer.hf.decode(prompt[-16:]))  # the template's last words
        opening = self.reasoning_opening_of(fmt.starts) if fmt.starts else None
        budget = closing = None
        if params.bound_reasoning:
            budget, closing = params.max_tokens // 2, self.reasoning_opening_of(fmt.ends[:1], exact=True)
        return GuidedDecoding(
            grammar.matcher(), opening, started, fmt.ends, reasoning_budget=budget, closing=closing, peek=peek
        )

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]] | None:
        """`params.bad_words` as token sequences (motet/engine/worker/token_masks.py), None where there are none or
        they are resolved already. `add_request` calls it; the serving ingress resolves them in its worker threads
        (motet/actors/input_processor.py), so a request given to `add` arrives resolved."""
        if not params.bad_words or params.bad_words_token_ids is not None:
            return None
        encode = functools.partial(self.tokenizer.hf.encode, add_special_tokens=False)
        return bad_words_token_ids(params.bad_words, encode)

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.output_commit.forget(request_id)
        self.structured_output.forget(request_id)
        self.stepping.release(seq)  # (now, or once the step in flight that reads it lands)
        return True

    def drop(self, seq: Sequence) -> None:
        """An aborted request's blocks and adapter given back."""
        self.scheduler.finish(seq)
        self.speculator.forget(seq)
        self.adapters.release(seq.adapter_id)

    def has_unfinished(self) -> bool:
        """Requests not finished, or a launched step not committed yet (`step()` until False drains both)."""
        return bool(self.requests) or self.stepping.in_flight

    @property
    def in_flight(self) -> bool:
        """A step is launched and not committed (the next `step()` commits it)."""
        return self.stepping.in_flight

    def wait_forward(self) -> None:
        """Returns once the launched step's forward pass, if any, is done (its tokens land at the next `step()`):
        from then on the engine computes nothing until it steps again (motet/actors/training_lease.py lends the
        cores meanwhile)."""
        self.stepping.wait_forward()

    @property
    def num_steps_ahead(self) -> int:
        """Steps launched before the step before them landed (EngineConfig.async_scheduling)."""
        return self.stepping.num_steps_ahead

    def close(self) -> None:
        """Release what outlives the object (the engine takes no more steps): a launched step ends; the KV tiers'
        queued disk writes land and their threads stop; the other tensor-parallel ranks' processes end."""
        try:
            self.stepping.close()
            self.kv_connector.close()
            self.adapters.close()
        finally:
            self.runner.close()

    def stats(self, cache: bool = False) -> EngineStats:
        """As of now (the engine's thread); `cache`: with what its caches hold (CacheContents: a copy of the prefix
        cache's hashes, so only when a router asks)."""
        sched, bm = self.scheduler, self.block_manager
        running = {s.adapter_id for s in sched.running if s.adapter_id}
        waiting = {s.adapter_id for s in sched.waiting if s.adapter_id} - running
        return EngineStats(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            free_seq_slots=max(0, self.config.max_num_seqs - len(sched.running) - len(sched.waiting)),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_free=bm.num_free_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            preemptions=sched.num_preemptions,
            steps=self.num_steps,
            adapters_pinned=self.adapters.num_pinned,
            adapters=self.adapters.stats(),
            running_adapters=tuple(sorted(self.adapters.name_of(a) for a in running)),
            waiting_adapters=tuple(sorted(self.adapters.name_of(a) for a in waiting)),
            grammar=GrammarStats(**vars(self.structured_output.stats)),
            speculative=SpeculativeStats(**vars(self.speculator.stats)),
            prompt_tokens=self.output_commit.num_prompt_tokens,
            generation_tokens=self.output_commit.num_generation_tokens,
            tenants=sched.tenant_states(),
            kv_tiers=self.kv_connector.stats(),
            cpu_kernels=self.runner.cpu_kernels,
            token_s=self.token_pace.seconds() or 0.0,
            cache=CacheContents.of(bm, self.adapters) if cache else None,
        )

    # -- the step -------------------------------------------------------------------------------------
    def step(self) -> list[OutputDelta]:
        """One step: schedule -> execute -> commit, through the engine's stepping strategy."""
        outputs = self.stepping.step()
        if self._failed:
            outputs, self._failed = self._failed + outputs, []
        # idle next: release the snapshots' blocks
        if not self.has_unfinished():
            self.kv_connector.settle()
        return outputs

    def flush(self) -> list[OutputDelta]:
        """Commit the launched step, if any, without launching another: its outputs (the engine is then between
        steps, as `schedule`, `execute` and `commit` driven by hand need it)."""
        return self.stepping.flush()

    def schedule(self) -> ScheduledBatch:
        if self.stepping.in_flight:  # (its rows' tokens are not appended yet)
            raise RuntimeError("a step is in flight: flush() it before scheduling another")
        return self.schedule_next()

    def schedule_next(self, hold: Collection[Sequence] = ()) -> ScheduledBatch:
        """The next batch, its rows advanced: their chunks computed, each sampled token pending until its step
        lands. The overlapped strategy calls it while a step is in flight (`schedule` refuses to), `hold`ing back
        the rows whose in-flight token is their last."""
        self.speculator.propose(self.scheduler.running)
        kv, sched = self.kv_connector, self.scheduler
        if kv.num_loading and not sched.running and len(sched.waiting) == kv.num_loading:
            kv.wait_for_load(LOAD_WAIT_S)  # nothing else could run
        self._prepare_adapters()
        batch = self.scheduler.schedule(hold, self.structured_output.holding_stop())
        now = batch.scheduled_at = time.monotonic()
        for seq in batch.seqs:
            self.output_commit.scheduled(seq.request_id, now)
        self.scheduler.advance(batch)
        return batch

    def _prepare_adapters(self) -> None:
        """Before scheduling: the waiting requests' adapters copied into the pool, or loading (they run once
        resident); the requests whose adapter no longer loads ended with the reason. When nothing can run but
        a load, wait for it a moment rather than spin."""
        sched, adapters = self.scheduler, self.adapters
        waiting = [s.adapter_id for s in sched.waiting if s.adapter_id]
        if not waiting:
            return
        failures = adapters.failures()
        for seq in [s for s in sched.waiting if s.adapter_id in failures]:
            self.abort(seq.request_id)
            error = f"the adapter {adapters.name_of(seq.adapter_id)!r} {failures[seq.adapter_id]}"
            self._failed.append(failed(seq.request_id, error))
        in_use = {s.adapter_id for s in sched.running}
        in_use.update(s.adapter_id for b in self.stepping.unlanded for s in b.seqs)
        adapters.prefetch([*sched.slicer.order, *waiting], in_use)
        if not sched.running and not self.stepping.unlanded and not any(adapters.ready(a) for a in waiting):
            adapters.wait_for_load(LOAD_WAIT_S)

    def forward_call(self, batch: ScheduledBatch, inputs=None, after_landing: bool = False) -> ForwardCall:
        """The step's forward pass as values, made on the engine's thread: its plan, its LoRA segments (the adapter
        manager's lock taken here), its grammar mask (its filling started here, or where the step was scheduled
        before the step before it landed, `after_landing`, by `start_mask` once it has) and its inputs where built
        already (`ModelRunner.plan_inputs`). The forward thread of an overlapped engine is given this and nothing
        else."""
        step = batch.plan()
        try:
            lora = self.adapters.batch([s.adapter_id for s in batch.seqs], batch.num_new_tokens)
            mask = self.structured_output.mask(step, after_landing)
        except RankFailure:
            raise
        except Exception as e:  # raised by the call, which still hands the runner the plan
            return ForwardCall(self.runner, step, None, NO_MASK, inputs, error=e)
        return ForwardCall(self.runner, step, lora, mask, inputs)

    def start_mask(self, mask) -> None:
        """The grammar mask of a step made `after_landing` (`forward_call`) starts filling: the step before it landed,
        its tokens accepted by the grammars."""
        self.structured_output.start(mask)

    def needs_token_on_host(self, seq: Sequence) -> bool:
        """Whether the next step of `seq` needs the token its launched step samples on the host, not only as its
        input (an overlapped engine then schedules it once that step lands, motet/engine/stepping.py): its
        grammar's phase moves with its text (`StructuredOutputs.waits_for_token`), or tokens its grammar forces
        may follow the token (jump-forward: appended unsampled, before its next sampled token). The rest reads the
        token where it is: the sampler counts it on the device (penalties, bad_words, min_tokens, a seed's draw:
        motet/engine/worker/sampler.py), a grammar's mask is filled once it lands while the next step's forward
        pass runs (`start_mask`), and a row it ends (EOS, a stop string, its grammar's end) drops the token its
        next step computed."""
        so = self.structured_output
        guided = so.get(seq.request_id)
        return guided is not None and (
            so.waits_for_token(seq.request_id) or self.output_commit.jumps_forward(seq)
        )

    def execute(self, batch: ScheduledBatch, on_launch=None, lazy: bool = False, inputs=None) -> StepResult:
        """Run the batch; where it raises, bisect it so that only the failing rows carry the error. `on_launch()`
        is called when the forward pass is about to start (the host's part before it is done); `inputs`: the
        step's inputs built already (`ModelRunner.plan_inputs`). The runner sees the step's plan only."""
        result = self.forward_call(batch, inputs).run(on_launch, lazy)
        return self.bisect(batch, result) if isinstance(result, Exception) else result

    def bisect(self, batch: ScheduledBatch, error: Exception) -> StepResult:
        """A step whose forward pass raised `error`, run again in halves until only the failing rows carry it."""
        if len(batch) <= 1:  # (an empty batch has no rows to blame: nothing to bisect)
            if batch.seqs:
                log.error("request %s failed in the forward pass", batch.seqs[0].request_id, exc_info=error)
            return StepResult.failed(len(batch), error)
        half = len(batch) // 2
        parts = [self.execute(batch.subset(idx)) for idx in (range(half), range(half, len(batch)))]
        return StepResult.concat(parts)

    def commit(self, batch: ScheduledBatch, result: StepResult) -> list[OutputDelta]:
        """Apply a step's result: land its tokens, detokenize, check stops, free the finished."""
        return self.commit_text(self.commit_tokens(batch, result))

    def commit_tokens(self, batch: ScheduledBatch, result: StepResult) -> LandedStep:
        """The part of the commit the next step depends on: each row's pending token lands, its tokens are
        appended and the rows they end are ended. A row whose ending depends on its text (a grammar, stop strings,
        drafts) is committed whole here; the others' text is left to `commit_text`."""
        self.num_steps += 1
        result.resolve()  # (a launched step's tokens: read from the device here, its successor launched)
        now = time.monotonic()
        # The step's time as its rows saw it: from the previous step's landing (an overlapped step ran behind it)
        # or from its scheduling, whichever is later, to its own landing.
        start = max(self._last_landed, batch.scheduled_at if batch.scheduled_at is not None else now)
        self.scheduler.policy.observe_step(batch.num_tokens, now - start)
        self._last_landed = now
        cache_full_blocks, commit = self.block_manager.cache_full_blocks, self.output_commit
        landed = LandedStep([], [])
        for i, seq in enumerate(batch.seqs):
            if self.requests.get(seq.request_id) is not seq or seq.is_finished:  # aborted while it ran
                continue
            if batch.samples(i):
                seq.num_pending -= 1
            try:
                if result.errors[i] is not None:
                    if self.structured_output.get(seq.request_id) and _all_masked(result.errors[i]):
                        committed = commit.end_masked(seq, now)
                        self._finish(seq)
                        landed.outputs.append(committed.delta)
                        continue
                    raise result.errors[i]
                if result.prompt_logprobs[i]:
                    seq.prompt_logprobs.extend(result.prompt_logprobs[i])
                tokens = result.token_ids[i]
                if tokens is None:  # a prompt chunk short of the prompt's end
                    continue
                drafted = len(seq.draft_token_ids)
                if not drafted and len(tokens) == 1 and seq.decided_by_tokens:
                    row = commit.append_token(seq, tokens[0], result.logprobs[i][0])
                    if row.finish is not None:
                        self._finish(seq)
                    else:  # a block its token fills is cached now it is known
                        cache_full_blocks(seq)
                    landed.text_rows.append(row)
                    continue
                committed = commit.advance(seq, tokens, result.logprobs[i], now)
                if committed.finish is not None:
                    self._finish(seq)
                landed.outputs.append(committed.delta)
                if drafted:
                    self.speculator.observe(seq, drafted, len(tokens) - 1)
                    if not seq.is_finished:
                        self.scheduler.accept_drafts(seq, len(tokens) - 1)
                elif not seq.is_finished:
                    cache_full_blocks(seq)
            except Exception as e:  # one request's failure (a kernel, a grammar backend bug) is its own
                if result.errors[i] is None:
                    log.exception("request %s failed while processing its token", seq.request_id)
                self.abort(seq.request_id)
                landed.outputs.append(failed(seq.request_id, repr(e)))
        self.token_pace.landed(now, self.scheduler.has_work())
        return landed

    def commit_text(self, landed: LandedStep) -> list[OutputDelta]:
        """The rest of the commit: the rows `commit_tokens` left detokenized, the step's deltas made
        (motet/engine/output_commit.py). It may run while the next step computes."""
        deltas, failures = self.output_commit.text(landed)
        for request_id in failures:
            self.abort(request_id)
        return deltas

    def _finish(self, seq: Sequence) -> None:
        """A request ends (its delta carries why): its drafts' history, its blocks (saved to the KV tiers first),
        its grammar, its adapter pin."""
        self.speculator.record(seq)
        self.kv_connector.save_sequence(seq)  # its blocks outlive their eviction from the device
        self.scheduler.finish(seq)
        self.structured_output.forget(seq.request_id)
        del self.requests[seq.request_id]
        self.adapters.release(seq.adapter_id)


def _all_masked(error: BaseException) -> bool:
    return isinstance(error, SamplingError) and error.failure is SamplingFailure.ALL_MASKED
