"""Owns the model, its KV cache and the sampler; turns a step's plan (motet/engine/core/step_plan.py `StepPlan`)
into sampled tokens.

Called from the engine's thread only (or an overlapped engine's forward thread). `execute` is a sequence of
named steps: pick the sampled positions, run the forward pass through the backend chosen once at start-up
(motet/engine/worker/step_backends.py) with the step's LoRA segments (lora/), compute logits only for the rows that
sample, apply the grammar mask the engine's structured outputs filled meanwhile (motet/engine/structured_output.py),
sample, verify drafts, and add prompt logprobs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from motet.engine.config import GGUF_QUANTIZATION, EngineConfig, context_length, default_cpu_threads
from motet.engine.core.kv_window import pool_sizes, ring_blocks
from motet.engine.core.step_plan import StepPlan
from motet.engine.outputs import TokenLogprob
from motet.engine.speculative.verify import num_accepted
from motet.engine.weights import load_progress
from motet.engine.weights.gguf_weights import gguf_file, iter_gguf_weights
from motet.engine.weights.quantization_config import declared_quantization
from motet.engine.weights.quantized_checkpoint import iter_checkpoint_weights
from motet.engine.worker import prepared_weights
from motet.engine.worker.cpu_forward import CpuForward
from motet.engine.worker.cpu_forward import unsupported as native_unsupported
from motet.engine.worker.cuda_graphs import DecodeGraphs
from motet.engine.worker.decoder_weights import load_weights
from motet.engine.worker.layers import Linear, onednn_available
from motet.engine.worker.memory import (
    adapter_bytes,
    kv_block_bytes,
    kv_cache_bytes,
    memory_budget,
    untouched_zeros,
    weights_bytes,
    weights_line,
)
from motet.engine.worker.model import CausalLM
from motet.engine.worker.op_writer import ReplayMismatch
from motet.engine.worker.parallel import SINGLE, Parallel, RankFailure, check_ranks
from motet.engine.worker.prepared_weights import PreparedWeights
from motet.engine.worker.rows import Row, RunnerRows, position_views
from motet.engine.worker.sampler import Sampler, SamplerOutput, compute_prompt_logprobs, outcome_error
from motet.engine.worker.step_backends import EagerSteps, GraphSteps
from motet.engine.worker.step_inputs import InputBuilder, SampledTokens
from motet.engine.worker.tp_workers import NO_WORKERS, WorkerGroup
from motet.kernels import cpu_isa, cpu_native
from motet.kernels.quant import FORMATS as QUANT_FORMATS
from motet.lora.pool import LoRABatch
from motet.models.config import ModelConfig
from motet.models.rope_config import longrope_original

log = logging.getLogger("motet.engine")
MIB = 1 << 20


@dataclass(frozen=True)
class ForwardCall:
    """A step's forward pass as values (`LLMEngine.forward_call` makes it on the engine's thread): the runner, the
    step's plan, its LoRA segments, its grammar mask (filling on the masks' thread), its inputs where built already,
    or the error making them raised. What an overlapped engine's forward thread is given, and all it reads."""

    runner: ModelRunner
    step: StepPlan
    lora: LoRABatch | None
    mask: Any
    inputs: Any = None
    error: Exception | None = None

    def run(self, on_launch=None, lazy: bool = False) -> StepResult | Exception:
        """The step's result, or the exception its forward pass raised (the engine bisects the step on its own
        thread); a tensor-parallel rank's failure is raised (no step can run any more)."""
        self.runner.take_plan(self.step)  # (whatever happens to the step: the next plan is against it)
        if self.error is not None:
            return self.error
        try:
            return self.runner.execute(self.step, self.lora, on_launch, lazy, self.mask, self.inputs)
        except RankFailure:
            raise
        except Exception as e:
            return e


@dataclass
class StepResult:
    """Per scheduled sequence: the sampled tokens (None for a mid-prompt chunk; one token, or with drafts the
    accepted drafts and the target's token after them), their logprobs (None where not asked for), and the
    error its row raised or its sampling failed with (the others in the batch are unaffected)."""

    token_ids: list[list[int] | None]
    logprobs: list[list[TokenLogprob | None] | None]
    prompt_logprobs: list[list[TokenLogprob] | None]
    errors: list[BaseException | None]
    # A lazy result's one-token rows, their outcomes still on the device: (SamplerOutput.outcomes, [(row, index)])
    on_device: tuple[torch.Tensor, list[tuple[int, int]]] | None = None

    def resolve(self) -> StepResult:
        """`token_ids` complete, the tokens on the device read (on a GPU: waits for the step's sampling)."""
        if self.on_device is not None:
            outcomes, rows = self.on_device
            values = outcomes.tolist()
            for row, index in rows:
                error = outcome_error(values[index])
                if error is None:
                    self.token_ids[row] = [values[index]]
                else:
                    self.errors[row] = error
            self.on_device = None
        return self

    @classmethod
    def empty(cls, n: int) -> StepResult:
        return cls([None] * n, [None] * n, [None] * n, [None] * n)

    @classmethod
    def failed(cls, n: int, error: BaseException) -> StepResult:
        result = cls.empty(n)
        result.errors = [error] * n
        return result

    @classmethod
    def concat(cls, parts: list[StepResult]) -> StepResult:
        """Results of consecutive row ranges of one batch, as one."""
        out = cls([], [], [], [])
        for p in parts:
            p.resolve()
            out.token_ids += p.token_ids
            out.logprobs += p.logprobs
            out.prompt_logprobs += p.prompt_logprobs
            out.errors += p.errors
        return out


class ModelRunner:
    """One rank's model. With `config.tensor_parallel_size` > 1 the runner made without `parallel` is the
    driver (rank 0): it starts the other ranks (motet/engine/worker/tp_workers.py) and its broadcast sends them each
    step's plan; a worker's runner (made with its `parallel`) runs the plans it receives
    (tp_workers.serve_plans)."""

    def __init__(
        self,
        model_dir,
        model_config: ModelConfig,
        config: EngineConfig,
        parallel: Parallel | None = None,
    ):
        """A worker rank's runner gets its `parallel`; without one, with `tensor_parallel_size` > 1 this is the
        driver: it starts the other ranks."""
        self.config = config
        self.model_config = model_config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = context_length(model_config, config.max_model_len)
        self.workers: WorkerGroup | None = None
        if parallel is None and config.tensor_parallel_size > 1:
            check_ranks(config.tensor_parallel_size, model_config, config.enable_expert_parallel, self.device)
            self.workers = WorkerGroup(model_dir, model_config, config)
            parallel = self.workers.parallel
        self.parallel = parallel or SINGLE
        self.broadcast = (
            self.workers if self.workers is not None else NO_WORKERS
        )  # the plans to the other ranks
        try:
            self._build(model_dir)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise

    def _build(self, model_dir) -> None:
        config, model_config, parallel = self.config, self.model_config, self.parallel
        threads = config.num_threads or (default_cpu_threads(parallel.size) if parallel.enabled else None)
        self.num_threads = threads if self.device.type == "cpu" else None  # the forward passes' threads
        if self.num_threads:
            torch.set_num_threads(self.num_threads)  # (the engine's own step thread sets it too)
        budget = None  # --gpu-memory-utilization (CUDA's default): read before the weights take their part
        if config.num_kv_blocks is None and config.memory_utilization is not None:
            budget = memory_budget(config.memory_utilization, self.device)
        torch.manual_seed(config.seed)
        self.prepared: PreparedWeights | None = None  # the prepared-weights cache's entry, where it applies
        error = None
        try:
            (_, local_kv_heads) = parallel.heads(model_config)[1]  # this rank's share of the KV cache
            layout = model_config.cache_layout  # what a layer keeps a token (motet/models/attention.py)
            share = layout.rank_share(local_kv_heads / model_config.num_key_value_heads)  # (replicated: all)
            restored = None
            if prepared_weights.applies(config, self.device, parallel):
                self.prepared = PreparedWeights(model_dir, config, self.dtype)
                restored = self.prepared.model(model_config, self.max_model_len, self.device)
            self.model = restored if restored is not None else self._load_model(model_dir)
            if restored is not None:  # (its packed weights are the entry's, not the model's tensors)
                log.info(
                    "weights: %.2f MiB prepared, mapped from the cache", self.prepared.entry.nbytes / MIB
                )
            elif parallel.rank == 0:
                log.info(weights_line(self.model, self.device, self.dtype))
        except Exception as e:
            if not parallel.enabled:
                raise
            error = e
        # Sliding-window layers keep only their window (motet/engine/core/kv_window.py) where the context is longer:
        # within it they keep everything, as the other layers do.
        window = model_config.sliding_window
        self.window = window if window is not None and self.max_model_len > window else None
        self.window_layers = frozenset(model_config.window_layers if self.window else ())
        speculates = config.speculative_mode != "off" and config.num_speculative_tokens > 0
        self.window_chunk = max(window or 0, 1 + (config.num_speculative_tokens if speculates else 0))
        self.ring = ring_blocks(self.window, self.window_chunk, self.block_size) if self.window else 0
        num_blocks, num_window_blocks, pool_bytes = 1, 0, None
        if error is None:
            kv_bytes = int(config.kv_cache_gb * 2**30)
            if budget is not None:
                used = weights_bytes(self.model, self.device)
                kv_bytes, pool_bytes = kv_cache_bytes(
                    budget, used, config, model_config, self.dtype, self.device
                )  # this rank's device
            elif self.device.type == "cpu":
                pool_bytes = adapter_bytes(config, self.device)
            block_bytes = kv_block_bytes(model_config, self.block_size, self.dtype.itemsize) * share
            num_blocks = config.num_kv_blocks or max(1, int(kv_bytes // block_bytes))
            if self.window:
                layer_blocks = num_blocks * model_config.num_hidden_layers
                num_global = model_config.num_hidden_layers - len(self.window_layers)
                num_blocks, num_window_blocks = pool_sizes(
                    layer_blocks,
                    num_global,
                    len(self.window_layers),
                    most_window=config.max_num_seqs * self.ring,
                    virtual_global=config.max_num_seqs * -(-self.max_model_len // self.block_size),
                )
        # every rank must hold the same blocks; a rank that failed to load fails them all, naming it
        failed = f"{type(error).__name__}: {error}" if error else None
        self.num_blocks = parallel.agree(failed, num_blocks)
        self.num_window_blocks = parallel.agree(None, num_window_blocks)
        if self.window:
            log.info(
                "sliding window of %d tokens on %d of %d layers: they keep at most %d blocks a sequence, in a "
                "pool of %d blocks; the others %d blocks",
                self.window,
                len(self.window_layers),
                model_config.num_hidden_layers,
                self.ring,
                self.num_window_blocks,
                self.num_blocks,
            )

        def cache(num_blocks: int) -> tuple[torch.Tensor, ...]:
            """A layer's cache tensors, this rank's parts of the attention's layout (its share of the KV heads, or
            all of a replicated layout); on a CPU reserved but untouched until they fill (memory.py
            `untouched_zeros`)."""
            shapes = [(num_blocks, self.block_size, heads, width)
                      for heads, width in layout.rank_parts(local_kv_heads)]  # fmt: skip
            if self.device.type == "cpu":
                return tuple(untouched_zeros(shape, self.dtype) for shape in shapes)
            return tuple(torch.zeros(shape, dtype=self.dtype, device=self.device) for shape in shapes)

        load_progress.phase(f"reserving the KV cache ({self.num_blocks} blocks of {self.block_size} tokens)")
        self.kv_caches = [
            cache(self.num_window_blocks if i in self.window_layers else self.num_blocks)
            for i in range(model_config.num_hidden_layers)
        ]
        if layout.per_head_elements != layout.elements:  # (a layout other than per-head K / V: what it saves)
            elem = torch.tensor([], dtype=self.dtype).element_size()
            mine, per_head = model_config.kv_elements_per_token, model_config.per_head_kv_elements_per_token
            log.info(
                "KV cache: %d bytes a token (each layer's heads x width: %s%s), %.3g of the %d bytes per-head "
                "K / V would take",
                mine * elem,
                " + ".join(f"{heads} x {width}" for heads, width in layout.parts),
                ", on every rank" if layout.replicated else "",
                mine / per_head,
                per_head * elem,
            )
        if pool_bytes is None:  # (CUDA with the KV cache sized otherwise: a share of what is free now)
            pool_bytes = adapter_bytes(config, self.device)
        # every rank's pool holds the driver's placements: the smallest bound serves them all
        self.adapter_memory_bytes = parallel.agree(None, pool_bytes)
        model = self.model
        # The compiled step (EngineConfig.compile_step): on CPU the native forward, which takes the linear
        # weights over; else (or where it cannot run) the eager model, with oneDNN-prepacked products on CPU.
        self.native: CpuForward | None = None
        self.cpu_kernels = ""  # the native step's instruction-set tier (cpu_native.isa()), where it runs
        compiled_cpu = config.compile_step and self.device.type == "cpu"
        why_not = native_unsupported(model, self.dtype) if compiled_cpu else None
        if (
            why_not is not None
        ):  # (a model the native program cannot run is served eagerly, never refused mid-step)
            log.info("native CPU step: not for this model (%s); the eager model runs it", why_not)
        if self.prepared is not None and self.prepared.hit and why_not is not None:  # (its weights: packed)
            self.prepared.discard(f"the native step does not run the model here ({why_not})")
            model = self.model = self._load_model(model_dir)
        if compiled_cpu and why_not is None:
            self.native = self._native_step(model_dir)
            model = self.model
            self.cpu_kernels = cpu_native.isa()
            kernels = ", ".join(cpu_native.kernels()) or "portable loops"
            log.info(
                "native CPU step: %s kernels (%s; %s forces a lower tier)",
                self.cpu_kernels,
                kernels,
                cpu_isa.ENV,
            )
        elif self.device.type == "cpu" and onednn_available():
            for module in model.modules():
                if isinstance(module, Linear):
                    module.prepack()
        self.sampler = Sampler(model_config.vocab_size, model_config.eos_token_ids)
        self.rows = RunnerRows()  # its own copy of each running row, updated from each step's plan
        long_rows = model.rope.long_rows  # LongRoPE's: where its long factors' rows below the original begin
        long_rope = None if long_rows is None else (longrope_original(model_config.rope_scaling), long_rows)
        self.inputs = InputBuilder(self.block_size, self.device, self.window, self.window_chunk, long_rope)
        forward = self.native if self.native is not None else self._eager_forward
        logits = self.native.logits if self.native is not None else self._eager_logits
        self.steps: EagerSteps | GraphSteps = EagerSteps(self.inputs, forward, logits, self.broadcast)
        # On CUDA the compiled step is decode steps replayed from CUDA graphs (motet/engine/worker/cuda_graphs.py).
        self.graphs: DecodeGraphs | None = None
        # A sparse layer's expert segments have data-dependent sizes, which a graph cannot replay: MoE models
        # run eagerly on CUDA too; so do tensor-parallel ranks (no collectives inside the graphs yet) and models
        # past a sliding window (the graphs attend without the window pool's tables). A latent attention's decode
        # rows replay (motet/engine/worker/latent_attention.py: a step of decode rows only is not split on the host).
        if (
            config.compile_step
            and self.device.type == "cuda"
            and not model_config.is_moe
            and not parallel.enabled
            and not self.window
        ):
            self.use_graphs(
                DecodeGraphs(
                    lambda ids, pos, meta, lora: self.model(ids, pos, meta, self.kv_caches, lora),
                    max_batch=config.max_num_seqs,
                    max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                    max_seq_len=self.max_model_len,
                    device=self.device,
                    # (the attention layer's: a latent one replays only rows of one token)
                    **self.model.layers[0].self_attn.graph_options(
                        config.num_speculative_tokens if speculates else 0
                    ),
                )
            )

    def _native_step(self, model_dir) -> CpuForward:
        """The native CPU step over the model: its weights replayed from the prepared-weights cache where this
        start hit it, else packed (and the entry written, where the cache is on)."""
        prepared = self.prepared
        if prepared is not None and prepared.hit:
            try:
                return CpuForward(self.model, self.kv_caches, arena=prepared.arena(),
                                  table_from_head=prepared.table_from_head)  # fmt: skip
            except ReplayMismatch as e:
                prepared.discard(str(e))
                self.model = self._load_model(model_dir)
        model = self.model
        formats = prepared_weights.quantized_formats(model) if prepared is not None else None
        t0 = time.perf_counter()
        what = "packing the weights for the native CPU step"
        load_progress.begin(what, f"{len(model.layers)} layers")
        native = CpuForward(model, self.kv_caches, load_progress.LoadProgress(what, len(model.layers)))
        took = time.perf_counter() - t0
        if took >= load_progress.EVERY_S:  # (a slow machine's start-up is not silence)
            log.info("packed the weights for the native CPU step in %.1f s", took)
        if prepared is not None:
            prepared.save(model, native, formats)
        return native

    def use_graphs(self, graphs: DecodeGraphs) -> None:
        """Replay decode steps from `graphs` in front of the eager step (at start-up on CUDA; tests emulate it)."""
        self.graphs = graphs
        eager = self.steps.eager if isinstance(self.steps, GraphSteps) else self.steps
        self.steps = GraphSteps(graphs, eager)

    def _eager_forward(self, input_ids, positions, meta, lora: LoRABatch | None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, self.kv_caches, lora)

    def _eager_logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor | None:
        """This rank's part of the logits (rank 0 gets all of them, gathered; the others None)."""
        return self.model.compute_logits(hidden)

    def _load_model(self, model_dir) -> CausalLM:
        """This rank's model (the whole of it on one rank), made in the engine's dtype on its device and filled
        from the checkpoint, each tensor converted as it is copied (quantized ones from the checkpoint's own
        values): loading needs the weights' memory and a few MiB besides, never a copy in another dtype."""
        config, model_config = self.config, self.model_config
        # a GPTQ / AWQ checkpoint's own (served in its blocks), or MXFP4 experts (dequantized as they load)
        declared = declared_quantization(model_dir, config.quantization)
        load_progress.phase("allocating the model")
        model = CausalLM.allocate(
            model_config,
            self.max_model_len,
            self.parallel,
            self.device,
            self.dtype,
            quantized=config.quantization is not None or (declared is not None and declared.served_quantized),
        )
        if config.quantization == GGUF_QUANTIZATION:
            weights = iter_gguf_weights(gguf_file(model_dir))
        else:
            weights = iter_checkpoint_weights(model_dir, declared)
        quantize = QUANT_FORMATS.get(config.quantization)
        what = f"quantizing the weights to {quantize.name}" if quantize is not None else "loading the weights"
        if self.parallel.rank == 0:  # (every rank reads the whole checkpoint: one tells)
            if quantize is not None:  # the slow load: it says so at once
                load_progress.begin(what, f"{model_config.num_hidden_layers} layers, as they load")
            weights = load_progress.LoadProgress(what, model_config.num_hidden_layers).tensors(weights)
        load_weights(model, weights, quantize=quantize)
        return model.eval().requires_grad_(False)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Pay the first step's one-off costs now, before the engine takes requests (the server says it is ready
        once the engine is built): the step backend's warm-up (on CUDA every decode graph of the base model
        captured; elsewhere one padding token through the step). Nothing is sampled: the sampler's random state
        is untouched. Tensor-parallel ranks are left cold (a step there is a plan every rank runs)."""
        if self.parallel.enabled:
            return
        t0 = time.perf_counter()
        what = self.steps.warm_up()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("warm-up: %s in %.2f s", what, time.perf_counter() - t0)

    # -- tensor parallelism ---------------------------------------------------------------------------
    @property
    def lora_layout_shape(self):
        """The geometry of the adapters' pool: the largest rank's part of every module (rank 0's), so that the
        driver's placements hold on every rank (motet/lora/pool.py)."""
        return self.parallel.layout_shape(self.model_config) if self.parallel.enabled else self.model_config

    @property
    def lora_sharder(self):
        """Cuts an adapter's modules to this rank's part (None on one rank)."""
        return self.parallel.lora_sharder(self.model_config) if self.parallel.enabled else None

    def close(self) -> None:
        """Stop the other ranks (nothing to do on one)."""
        if self.workers is not None:
            self.workers.close()

    def take_plan(self, step: StepPlan) -> None:
        """Apply the step's plan to the runner's rows (motet/engine/worker/rows.py): the engine calls it as it hands
        the step over, on the thread that schedules, plans in order (once each: again is nothing)."""
        self.rows.update(step)

    def plan_inputs(self, step: StepPlan):
        """The step's inputs built on the host now, for `execute`: an overlapped engine calls it as it launches the
        step, on its own thread, while the forward thread may still run the step before; the forward thread then
        only sends them. (A pending input token is looked up when they are sent: its step may not have run.)"""
        return self.steps.plan(step, self.rows.update(step))

    @torch.inference_mode()
    def forward(
        self, step: StepPlan, lora: LoRABatch | None = None, on_launch=None, inputs=None
    ) -> tuple[torch.Tensor, list[int]]:
        """Run the step's chunks through the model, writing their KV; returns hidden states and row offsets.
        `on_launch()`, if given, is called once the inputs are ready, as the model starts; `inputs`: built already
        (`plan_inputs`), else built here."""
        if inputs is None:
            inputs = self.steps.plan(step, self.rows.update(step))
        return self.steps.run(inputs, lora, on_launch)

    def compute_logits(self, hidden: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """fp32 logits of the given hidden rows (`lora`: their adapters' segments, for the output head's)."""
        self.broadcast.send_logits_of(hidden)
        logits = self.steps.logits(hidden)
        if lora is not None:
            lora.add_head(logits, hidden)
        return self.model.cap_logits(logits)

    def logits(self, hidden: torch.Tensor, rows: list[int], lora: LoRABatch | None = None) -> torch.Tensor:
        """fp32 logits of rows of the latest forward's hidden states (the other ranks pick the same rows), with
        the adapters' output head deltas (`lora`: the step's segments)."""
        self.broadcast.send_logits(rows)
        # (rows are increasing: as many as the hidden rows means all of them, with no gather). The step uses its
        # logits before it asks for more: they may reuse one buffer.
        picked = hidden if len(rows) == hidden.shape[0] else hidden[rows]
        logits = self.steps.logits(picked, True)
        if lora is not None and lora.head:
            lora.rows(rows).add_head(logits, picked)
        return self.model.cap_logits(logits)

    @torch.inference_mode()
    def execute(
        self,
        step: StepPlan,
        lora: LoRABatch | None = None,
        on_launch=None,
        lazy: bool = False,
        mask=None,
        inputs=None,
    ) -> StepResult:
        """The step's sampled tokens; `on_launch` and `inputs` as in `forward`. `lazy`: the tokens stay on the device
        until `resolve()` (the host does not wait for the device here; the next step may take them as inputs). `mask`:
        the step's grammar mask over its sampled positions (the engine's structured outputs fill it while the
        forward pass runs, motet/engine/structured_output.py), applied to their logits; None: no row is masked."""
        sample_rows = step.sampling_rows()
        rows = self.rows.update(step)  # (applied here unless the inputs were planned as the step launched)
        views, starts = self._sampled_positions(step, rows, sample_rows, self.inputs.sampled)
        hidden, qsl = self.forward(step, lora, on_launch, inputs)
        logits = self.logits(hidden, self._logit_rows(step, sample_rows, qsl), lora)
        if mask is not None:
            mask.apply(logits)
        result = self._verify(step, sample_rows, starts, self.sampler(logits, views), self.inputs.sampled)
        self._prompt_logprobs(step, rows, hidden, qsl, lora, result)
        return result if lazy else result.resolve()

    @staticmethod
    def _sampled_positions(plan: StepPlan, rows: list[Row], sample_rows: list[int], sampled: SampledTokens):
        """The sampler's views of the step's sampled positions, and where each sampling row's begin: one per
        sampling row, plus one per draft (motet/engine/speculative/verify.py); a row's pending token is found in
        `sampled`, the recent steps' sampled tokens."""
        views, starts = [], []
        for i in sample_rows:
            starts.append(len(views))
            views.extend(position_views(plan[i], rows[i], sampled))
        return views, starts

    @staticmethod
    def _logit_rows(plan: StepPlan, sample_rows: list[int], qsl: list[int]) -> list[int]:
        """The hidden rows of the sampled positions: each sampling row's last, and its drafts' before it."""
        return [r for i in sample_rows for r in range(qsl[i + 1] - 1 - len(plan[i].drafts), qsl[i + 1])]

    @staticmethod
    def _verify(
        plan: StepPlan, sample_rows: list[int], starts, out: SamplerOutput, sampled_tokens: SampledTokens
    ) -> StepResult:
        """Each sampling row's tokens: a drafting row keeps its accepted drafts and the target's token after them;
        a one-token row's token stays on the device until the result is read."""
        result = StepResult.empty(len(plan))
        on_device = []  # (row, index) of the rows' tokens left in out.tokens until the result is read
        for i, start in zip(sample_rows, starts, strict=True):
            if plan[i].sampled_as is not None:  # where the next step finds it, if it runs first
                sampled_tokens.record(plan[i].sampled_as, out.tokens, start)
            drafts = plan[i].drafts
            if not drafts:
                on_device.append((i, start))
                result.logprobs[i] = [out.logprobs[start]]
                continue
            sampled = out.token_ids[start : start + len(drafts) + 1]
            kept = num_accepted(sampled, drafts) + 1  # the accepted drafts and the target's next token
            if sampled[kept - 1] < 0:  # no token after the accepted drafts (a failure is never a draft)
                if kept == 1:
                    result.errors[i] = outcome_error(sampled[0])
                    continue
                kept -= 1  # they land, the last as the row's next token: the failure comes again next step
            result.token_ids[i] = sampled[:kept]
            result.logprobs[i] = out.logprobs[start : start + kept]
        result.on_device = (out.outcomes, on_device) if on_device else None
        return result

    def _prompt_logprobs(
        self, plan: StepPlan, rows: list[Row], hidden, qsl, lora, result: StepResult
    ) -> None:
        """The prompt logprobs of the rows that ask for them, over this step's chunk of their prompt."""
        for i, row in enumerate(plan):
            k = rows[i].params.prompt_logprobs
            if k is None:
                continue
            # Row p predicts prompt token p+1; the last prompt row predicts the first output instead. A
            # recompute after preemption skips the positions it has reported already.
            first = max(row.start, row.num_prompt_logprobs_done)
            last = min(row.start + row.num_new_tokens, rows[i].num_prompt_tokens - 1)
            if first >= last:
                continue
            hidden_rows = range(qsl[i] + first - row.start, qsl[i] + last - row.start)
            targets = rows[i].tokens[first + 1 : last + 1]
            chunk_logits = self.logits(hidden, list(hidden_rows), lora)
            result.prompt_logprobs[i] = compute_prompt_logprobs(chunk_logits, torch.tensor(targets), k)
