"""Owns the model, its KV cache and the sampler; turns a scheduled batch into sampled tokens.

Called from the engine's thread only. Builds the flattened inputs of a step, runs the forward pass (with
the step's LoRA segments, lora/), computes logits only for the rows that sample (and for prompt-logprob
rows), masks the constrained rows with their grammar, and samples.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

from motet.engine.config import (
    GGUF_QUANTIZATION,
    QUANT_FORMATS,
    EngineConfig,
    ModelConfig,
    context_length,
    default_cpu_threads,
)
from motet.engine.cpu_forward import CpuForward
from motet.engine.cpu_forward import supported as cpu_forward_supported
from motet.engine.cuda_graphs import DecodeGraphs
from motet.engine.gguf_weights import gguf_file, iter_gguf_weights
from motet.engine.kv_window import pool_sizes, ring_blocks, window_table
from motet.engine.memory import adapter_bytes, kv_cache_bytes, memory_budget, weights_bytes
from motet.engine.model import AttentionMetadata, CausalLM, Linear, onednn_available
from motet.engine.parallel import SINGLE, Parallel
from motet.engine.quantized_checkpoint import declared_quantization, iter_checkpoint_weights
from motet.engine.sampler import Sampler, compute_prompt_logprobs
from motet.engine.scheduler import ScheduledBatch
from motet.engine.sequence import TokenLogprob
from motet.engine.speculative.grammar_drafts import activation_index, fill_draft_bitmask
from motet.engine.speculative.verify import num_accepted, position_views
from motet.engine.step_inputs import decode_inputs, feed_tokens
from motet.engine.tp_workers import WorkerGroup, receive_plan
from motet.grammar.backend import allocate_bitmask, apply_bitmask
from motet.grammar.masking import fill_bitmasks
from motet.lora.pool import AdapterPool, LoRABatch, PoolLayout, pack

log = logging.getLogger("motet.engine")


class HostInputs(NamedTuple):
    """An eager step's inputs packed on the host (pinned on CUDA), for `ModelRunner._inputs` to send in two
    transfers. `feeds`: (input index, row) for the rows whose input token is pending
    (motet/engine/step_inputs.py)."""

    # int64 [3, tokens]: input ids (0 where pending), positions, KV slots (and the window layers' slots)
    per_token: torch.Tensor
    # int32: the block tables [rows, width] flattened, query_start_loc [rows + 1], seq_lens (and the window
    # layers' tables)
    per_seq: torch.Tensor
    width: int
    qsl: list[int]
    max_query_len: int
    max_seq_len: int
    feeds: list


class GraphRows(NamedTuple):
    """A decode step's rows as `DecodeGraphs.run_rows` takes them, and the rows' offsets in its output."""

    rows: list[list[int]]
    starts: list[int]
    slots: list[list[int]]
    tables: list[list[int]]
    qsl: list[int]
    feeds: list


@dataclass
class StepResult:
    """Per scheduled sequence: the sampled tokens (None for a mid-prompt chunk; one token, or with drafts the
    accepted drafts and the target's token after them), their logprobs (None where not asked for), and the
    error its row raised (the others in the batch are unaffected)."""

    token_ids: list[list[int] | None]
    logprobs: list[list[TokenLogprob | None] | None]
    prompt_logprobs: list[list[TokenLogprob] | None]
    errors: list[BaseException | None]
    # A lazy result's one-token rows, their tokens still on the device: (sampled tokens, [(row, index)])
    on_device: tuple[torch.Tensor, list[tuple[int, int]]] | None = None

    def resolve(self) -> StepResult:
        """`token_ids` complete, the tokens on the device read (on a GPU: waits for the step's sampling)."""
        if self.on_device is not None:
            tokens, rows = self.on_device
            values = tokens.tolist()
            for row, index in rows:
                self.token_ids[row] = [values[index]]
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


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


@dataclass
class GrammarStats:
    """Where structured output's time goes, summed over steps (for benchmarks and /metrics)."""

    steps: int = 0  # steps with at least one constrained row
    rows: int = 0  # constrained rows masked
    fill_s: float = 0.0  # filling bitmasks (on a side thread, overlapping the forward pass)
    wait_s: float = 0.0  # of that, what the step waited for after its forward pass
    apply_s: float = 0.0  # masking the logits
    jump_forward_tokens: int = 0  # tokens appended without sampling (counted by the engine)


def _timed_fill(bitmask: torch.Tensor, items, drafted, opening) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():  # the bitmask was made in the step's inference mode; this is another thread
        fill_bitmasks(bitmask, items)
        for guided, drafts, first, row in drafted:  # position by position, through the drafts
            fill_draft_bitmask(bitmask, guided, drafts, first, row)
        for guided, row in opening:  # an output's first tokens: the grammar's, or the opening of <think>
            guided.fill_opening_bitmask(bitmask, row)
    return time.perf_counter() - t0


class ModelRunner:
    """One rank's model. With `config.tensor_parallel_size` > 1 the runner made without `parallel` is the
    driver (rank 0): it starts the other ranks (motet/engine/tp_workers.py) and sends them each step's plan;
    a worker's runner (made with its `parallel`) runs the plans it receives (`serve_plans`)."""

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
            self.workers = WorkerGroup(model_dir, model_config, config)
            parallel = self.workers.parallel
        self.parallel = parallel or SINGLE
        # adapter placements the workers have not seen: (slot, start, uid, adapter)
        self.pending_loads: list[tuple[int, int, int, object]] = []
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
        error = None
        try:
            (_, local_kv_heads) = parallel.heads(model_config)[1]  # this rank's share of the KV cache
            share = local_kv_heads / model_config.num_key_value_heads
            self.model = self._load_model(model_dir)
        except Exception as e:
            if not parallel.enabled:
                raise
            error = e
        # Sliding-window layers keep only their window (motet/engine/kv_window.py) where the context is longer:
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
            block_bytes = kv_block_bytes(model_config, self.block_size, self.dtype) * share
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

        def cache(num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (num_blocks, self.block_size, local_kv_heads, model_config.head_dim)
            return (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )

        self.kv_caches = [
            cache(self.num_window_blocks if i in self.window_layers else self.num_blocks)
            for i in range(model_config.num_hidden_layers)
        ]
        if pool_bytes is None:  # (CUDA with the KV cache sized otherwise: a share of what is free now)
            pool_bytes = adapter_bytes(config, self.device)
        # every rank's pool holds the driver's placements: the smallest bound serves them all
        self.adapter_memory_bytes = parallel.agree(None, pool_bytes)
        model = self.model
        # The compiled step (EngineConfig.compile_step): on CPU the native forward, which takes the linear
        # weights over; else (or where it cannot run) the eager model, with oneDNN-prepacked products on CPU.
        self.native: CpuForward | None = None
        # (the native step and the decode graphs attend without a window: eager where a window applies)
        if (
            config.compile_step
            and self.device.type == "cpu"
            and not self.window
            and cpu_forward_supported(model, self.dtype)
        ):
            self.native = CpuForward(model, self.kv_caches)
        elif self.device.type == "cpu" and onednn_available():
            for module in model.modules():
                if isinstance(module, Linear):
                    module.prepack()
        self.sampler = Sampler(model_config.vocab_size, model_config.eos_token_ids)
        self.grammar_stats = GrammarStats()
        self._grammar_thread = ThreadPoolExecutor(1, thread_name_prefix="motet-bitmask")
        # On CUDA the compiled step is decode steps replayed from CUDA graphs (motet/engine/cuda_graphs.py).
        self.graphs: DecodeGraphs | None = None
        # A sparse layer's expert segments have data-dependent sizes, which a graph cannot replay: MoE models
        # run eagerly on CUDA too; so do tensor-parallel ranks (no collectives inside the graphs yet).
        if (
            config.compile_step
            and self.device.type == "cuda"
            and not model_config.is_moe
            and not parallel.enabled
            and not self.window
        ):
            self.graphs = DecodeGraphs(
                lambda ids, pos, meta, lora: self.model(ids, pos, meta, self.kv_caches, lora),
                max_batch=config.max_num_seqs,
                max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                max_seq_len=self.max_model_len,
                device=self.device,
                max_query=1 + config.num_speculative_tokens if speculates else 1,  # verification rows too
            )

    def _load_model(self, model_dir) -> CausalLM:
        """This rank's model (the whole of it on one rank), made in the engine's dtype on its device and filled
        from the checkpoint, each tensor converted as it is copied (quantized ones from the checkpoint's own
        values): loading needs the weights' memory and a few MiB besides, never a copy in another dtype."""
        config, model_config = self.config, self.model_config
        declared = declared_quantization(model_dir, config.quantization)  # a GPTQ / AWQ checkpoint's own
        model = CausalLM.allocate(
            model_config,
            self.max_model_len,
            self.parallel,
            self.device,
            self.dtype,
            quantized=config.quantization is not None or declared is not None,
        )
        if config.quantization == GGUF_QUANTIZATION:
            weights = iter_gguf_weights(gguf_file(model_dir))
        else:
            weights = iter_checkpoint_weights(model_dir, declared)
        model.load_weights(weights, quantize=QUANT_FORMATS.get(config.quantization))
        return model.eval().requires_grad_(False)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Pay the first step's one-off costs now, before the engine takes requests (the server says it is ready
        once the engine is built): on CUDA every decode graph of the base model is captured
        (`DecodeGraphs.capture_all`); elsewhere one padding token (slot -1: no KV write, nothing a request can
        read) runs through the step and the lm_head, starting the thread pool and touching the code and the
        weights. Nothing is sampled: the sampler's random state is untouched. Tensor-parallel ranks are left
        cold (a step there is a plan every rank runs)."""
        if self.parallel.enabled:
            return
        t0 = time.perf_counter()
        if self.graphs is not None:
            self.graphs.capture_all()
            what = f"{len(self.graphs.graphs)} decode CUDA graphs captured"
        else:
            self._logits(self._forward(*self._padding_token()))
            what = "one token through the step"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("warm-up: %s in %.2f s", what, time.perf_counter() - t0)

    def _padding_token(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, None]:
        """A step's inputs for one token at position 0 that reads block 0 and writes no KV (slot -1)."""

        def tensor(data, dtype):
            return torch.tensor(data, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor([-1], torch.int64),
            block_tables=tensor([[0]], torch.int32),
            query_start_loc=tensor([0, 1], torch.int32),
            seq_lens=tensor([1], torch.int32),
            max_query_len=1,
            max_seq_len=1,
        )
        return tensor([0], torch.int64), tensor([0], torch.int64), meta, None

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

    def note_lora_placement(self, slot: int, start: int, uid: int, adapter) -> None:
        """An adapter the driver placed in its pool: the workers pack their parts at the same place with the
        next plan."""
        self.pending_loads.append((slot, start, uid, adapter))

    def _send(self, op: str, scalars=(), tensors=(), extra: dict | None = None) -> None:
        """One plan to the workers, with the adapter slot loads they have not seen yet."""
        if self.pending_loads:
            extra = {**(extra or {}), "loads": self.pending_loads}
            self.pending_loads = []
        self.workers.send(op, scalars, tensors, extra)

    def close(self) -> None:
        """Stop the other ranks (nothing to do on one)."""
        if self.workers is not None:
            self.workers.close()

    @torch.inference_mode()
    def serve_plans(self) -> None:
        """A worker rank's loop: run the driver's plans until it says stop (motet/engine/tp_workers.py)."""
        layout = PoolLayout(self.lora_layout_shape)
        pool = AdapterPool(layout, self.adapter_memory_bytes, self.device, self.dtype)
        hidden = None
        while True:
            op, scalars, tensors, extra = receive_plan()
            for slot, start, uid, adapter in (extra or {}).get("loads", ()):
                pool.put_at(slot, start, uid, pack(adapter, layout, self.dtype, self.lora_sharder))
            tensors = [t.to(self.device) for t in tensors]
            if op == "stop":
                return
            if op == "forward":
                max_query_len, max_seq_len, max_seg_len = scalars
                ids, pos, slot_mapping, tables, qsl, seq_lens, *segments = tensors
                meta = AttentionMetadata(slot_mapping, tables, qsl, seq_lens, max_query_len, max_seq_len)
                if self.window:  # the window layers' slots and tables come next
                    (window_slots, window_tables), segments = segments[:2], segments[2:]
                    meta.window = AttentionMetadata(
                        window_slots, window_tables, qsl, seq_lens, max_query_len, max_seq_len
                    )
                lora = pool.segments(*segments, max_seg_len) if segments else None
                hidden = self._forward(ids, pos, meta, lora)
            elif op == "logits":
                self._logits(hidden[tensors[0]])
            elif op == "logits_of":
                self._logits(extra["hidden"].to(self.device))

    def plan_inputs(self, batch: ScheduledBatch) -> None:
        """Build the step's inputs on the host now, into `batch.inputs`: the engine calls it as it launches the
        step, on its own thread, while the device thread may still run the step before; the device thread then
        only sends them. (A pending input token is looked up when they are sent: its step may not have run.)"""
        batch.inputs = (self._graph_rows(batch) if self.graphs is not None else None) or self._host_inputs(
            batch
        )

    def _prepare(self, batch: ScheduledBatch):
        """The step's input tensors on the device (from `batch.inputs` where planned)."""
        plan = batch.inputs if isinstance(batch.inputs, HostInputs) else self._host_inputs(batch)
        return self._inputs(plan)

    def _host_inputs(self, batch: ScheduledBatch) -> HostInputs:
        if all(n == 1 for n in batch.num_new_tokens):
            return self._host_decode_inputs(batch)
        bs = self.block_size
        input_ids, positions, slots, qsl, seq_lens, tables, feeds = [], [], [], [0], [], [], []
        for seq, n, start in zip(batch.seqs, batch.num_new_tokens, batch.positions(), strict=True):
            own = n - len(seq.draft_token_ids)
            known = seq.token_ids[start : start + own]
            input_ids.extend(known)
            if len(known) < own:  # its last token is still pending (async scheduling): fed on the device
                feeds.append((len(input_ids), seq))
                input_ids.append(0)
            input_ids.extend(seq.draft_token_ids)  # verified after the row's last token (none: not drafting)
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        return self._pack(
            input_ids, positions, slots, tables, qsl, seq_lens, max(batch.num_new_tokens), feeds, batch.seqs
        )

    def _host_decode_inputs(self, batch: ScheduledBatch) -> HostInputs:
        """`_host_inputs` of a step where every row adds one token (no drafts): the common step, in fewer passes."""
        bs, seqs = self.block_size, batch.seqs
        positions = batch.positions()
        input_ids, feeds = decode_inputs(seqs, positions)
        tables = [seq.block_table for seq in seqs]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        width = max(map(len, tables))
        tables = [t if len(t) == width else t + [0] * (width - len(t)) for t in tables]
        seq_lens = [p + 1 for p in positions]
        qsl = list(range(len(seqs) + 1))
        return self._pack(input_ids, positions, slots, tables, qsl, seq_lens, 1, feeds, seqs)

    def _pack(
        self, input_ids, positions, slots, tables, qsl, seq_lens, max_query_len, feeds, seqs
    ) -> HostInputs:
        """Host lists (tables already padded to one width) packed by dtype, in pinned memory on CUDA; with a
        window pool, the sliding-window layers' slots and tables after the others'."""
        pinned = self.device.type == "cuda"
        width = len(tables[0]) if tables else 0
        per_token, per_seq = (
            [input_ids, positions, slots],
            [*itertools.chain.from_iterable(tables), *qsl, *seq_lens],
        )
        if self.window:
            # a ring holds a window and one chunk of at most window_chunk tokens (the scheduler keeps to it)
            assert max_query_len <= self.window_chunk, (
                f"a chunk of {max_query_len} tokens past a window pool's"
            )
            bs = self.block_size
            rings = [window_table(seq.window_blocks, width) for seq in seqs]
            owner = itertools.chain.from_iterable(
                itertools.repeat(ring, qsl[i + 1] - qsl[i]) for i, ring in enumerate(rings)
            )
            per_token.append([ring[p // bs] * bs + p % bs for ring, p in zip(owner, positions, strict=True)])
            per_seq += itertools.chain.from_iterable(rings)
        per_token = torch.tensor(per_token, dtype=torch.int64, pin_memory=pinned)
        per_seq = torch.tensor(per_seq, dtype=torch.int32, pin_memory=pinned)
        return HostInputs(per_token, per_seq, width, qsl, max_query_len, max(seq_lens), feeds)

    def _inputs(self, plan: HostInputs):
        """The step's input tensors on the device, in two transfers from pinned memory on CUDA (none makes the host
        wait for the device), the pending tokens fed from the steps that sampled them."""
        ids, pos, slot_mapping, *window_slots = plan.per_token.to(self.device, non_blocking=True)
        if plan.feeds:
            feed_tokens(ids, plan.feeds, self.device.type == "cuda")
        per_seq = plan.per_seq.to(self.device, non_blocking=True)
        n, width = len(plan.qsl) - 1, plan.width
        block_tables, query_start_loc, lens, *window_tables = per_seq.split(
            (n * width, n + 1, n, n * width) if self.window else (n * width, n + 1, n)
        )
        meta = self._meta(slot_mapping, block_tables.view(n, width), query_start_loc, lens, plan)
        if self.window:
            meta.window = self._meta(
                window_slots[0], window_tables[0].view(n, width), query_start_loc, lens, plan
            )
        return ids, pos, meta, plan.qsl

    @staticmethod
    def _meta(slot_mapping, block_tables, query_start_loc, seq_lens, plan: HostInputs) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            max_query_len=plan.max_query_len,
            max_seq_len=plan.max_seq_len,
        )

    @torch.inference_mode()
    def forward(
        self, batch: ScheduledBatch, lora: LoRABatch | None = None, on_launch=None
    ) -> tuple[torch.Tensor, list[int]]:
        """Run the batch's chunks through the model, writing their KV; returns hidden states and row offsets.
        `on_launch()`, if given, is called once the inputs are ready, as the model starts."""
        rows = batch.inputs
        if rows is None and self.graphs is not None:
            rows = self._graph_rows(batch)
        if isinstance(rows, GraphRows):  # a decode step replayed from its bucket's graph
            hidden = self.graphs.run_rows(
                rows.rows, rows.starts, rows.slots, rows.tables, lora, on_launch, rows.feeds
            )
            return hidden, rows.qsl
        input_ids, positions, meta, qsl = self._prepare(batch)
        if on_launch is not None:
            on_launch()
        if self.workers is not None:  # the step's plan, once, to every other rank
            segments = [lora.seg_starts, lora.seg_slots] if lora is not None else []
            self._send(
                "forward",
                [meta.max_query_len, meta.max_seq_len, lora.max_seg_len if lora is not None else -1],
                [
                    input_ids,
                    positions,
                    meta.slot_mapping,
                    meta.block_tables,
                    meta.query_start_loc,
                    meta.seq_lens,
                ]
                + ([meta.window.slot_mapping, meta.window.block_tables] if self.window else [])
                + segments,
            )
        return self._forward(input_ids, positions, meta, lora), qsl

    def _forward(self, input_ids, positions, meta: AttentionMetadata, lora: LoRABatch | None) -> torch.Tensor:
        if self.native is not None:
            return self.native(input_ids, positions, meta, lora)
        return self.model(input_ids, positions, meta, self.kv_caches, lora)

    def compute_logits(self, hidden: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        """fp32 logits of the given hidden rows (`lora`: their adapters' segments, for the output head's)."""
        if self.workers is not None:
            self._send("logits_of", extra={"hidden": hidden})
        logits = self._logits(hidden)
        if lora is not None:
            lora.add_head(logits, hidden)
        return self.model.cap_logits(logits)

    def logits(self, hidden: torch.Tensor, rows: list[int], lora: LoRABatch | None = None) -> torch.Tensor:
        """fp32 logits of rows of the latest forward's hidden states (the other ranks pick the same rows), with
        the adapters' output head deltas (`lora`: the step's segments)."""
        if self.workers is not None:
            self._send("logits", tensors=[torch.tensor(rows, dtype=torch.int64)])
        # (rows are increasing: as many as the hidden rows means all of them, with no gather). The step uses its
        # logits before it asks for more: they may reuse one buffer.
        picked = hidden if len(rows) == hidden.shape[0] else hidden[rows]
        logits = self._logits(picked, reuse=True)
        if lora is not None and lora.head:
            lora.rows(rows).add_head(logits, picked)
        return self.model.cap_logits(logits)

    def _logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor | None:
        """This rank's part of the logits (rank 0 gets all of them, gathered; the others None); `reuse`: the
        caller is done with the previous call's logits (CpuForward.logits)."""
        if self.native is not None:
            return self.native.logits(hidden, reuse)
        return self.model.compute_logits(hidden)

    def _graph_rows(self, batch: ScheduledBatch) -> GraphRows | None:
        """A decode step's rows (every row one new token, and the drafts it verifies, if any) as its bucket's graph
        takes them; None: it runs eagerly (a prompt chunk, or too large for the graphs)."""
        seqs = batch.seqs
        if not seqs or any(
            n != 1 + len(seq.draft_token_ids) or not batch.samples(i)
            for i, (seq, n) in enumerate(zip(seqs, batch.num_new_tokens, strict=True))
        ):
            return None
        tables = [seq.block_table for seq in seqs]
        pos = batch.positions()
        if not self.graphs.fits(len(seqs), max(map(len, tables)), max(batch.num_new_tokens), max(pos)):
            return None
        bs, rows, slots, qsl = self.block_size, [], [], [0]
        firsts, feeds = decode_inputs(seqs, pos)
        for seq, table, p, first in zip(seqs, tables, pos, firsts, strict=True):
            rows.append([first, *seq.draft_token_ids])
            slots.append([table[x // bs] * bs + x % bs for x in range(p, p + len(rows[-1]))])
            qsl.append(qsl[-1] + len(rows[-1]))
        return GraphRows(rows, pos, slots, tables, qsl, feeds)

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch, lora: LoRABatch | None = None, on_launch=None, lazy: bool = False
    ) -> StepResult:
        """The batch's sampled tokens; `on_launch` as in `forward`. `lazy`: the tokens stay on the device until
        `resolve()` (the host does not wait for the device here; the next step may take them as inputs)."""
        sample_rows = batch.sampling_rows()
        # One sampled position per sampling row, plus one per draft (motet/engine/speculative/verify.py).
        if any(seq.draft_token_ids for seq in batch.seqs):
            views, starts = [], []
            for i in sample_rows:
                starts.append(len(views))
                views.extend(position_views(batch.seqs[i]))
        else:
            views, starts = [batch.seqs[i] for i in sample_rows], range(len(sample_rows))
        # Constrained rows: their bitmask rows are filled on a side thread while the forward pass runs
        # (xgrammar releases the GIL); unconstrained rows are never touched.
        masked, plain, drafted, opening = [], [], [], []
        for i, start in zip(sample_rows, starts, strict=True):
            seq = batch.seqs[i]
            if seq.guided is None:
                continue
            if seq.draft_token_ids:
                first = activation_index(seq.guided, seq.detok, seq.draft_token_ids)
                masked.extend(range(start + first, start + len(seq.draft_token_ids) + 1))
                drafted.append((seq.guided, seq.draft_token_ids, first, start))
            elif seq.guided.active:
                masked.append(start)
                plain.append((seq.guided.matcher, start))
            elif seq.guided.opening:
                masked.append(start)
                opening.append((seq.guided, start))
        if masked:
            bitmask = allocate_bitmask(len(views), self.model_config.vocab_size)
            filling = self._grammar_thread.submit(_timed_fill, bitmask, plain, drafted, opening)

        hidden, qsl = self.forward(batch, lora, on_launch)
        if isinstance(starts, range):  # no drafts: each sampling row's last position
            rows = [qsl[i + 1] - 1 for i in sample_rows]
        else:
            rows = [
                r
                for i in sample_rows
                for r in range(qsl[i + 1] - 1 - len(batch.seqs[i].draft_token_ids), qsl[i + 1])
            ]
        logits = self.logits(hidden, rows, lora)
        if masked:
            self._apply_grammar(logits, bitmask, masked, filling)
        out = self.sampler(logits, views)

        result = StepResult.empty(len(batch))
        on_device = []  # (row, index) of the rows' tokens left in out.tokens until the result is read
        for i, start in zip(sample_rows, starts, strict=True):
            seq = batch.seqs[i]
            seq.last_sampled = (out.tokens, start)  # where the next step finds it, if it runs first
            drafts = seq.draft_token_ids
            if not drafts:
                on_device.append((i, start))
                result.logprobs[i] = [out.logprobs[start]]
                continue
            sampled = out.token_ids[start : start + len(drafts) + 1]
            kept = num_accepted(sampled, drafts) + 1  # the accepted drafts and the target's next token
            result.token_ids[i] = sampled[:kept]
            result.logprobs[i] = out.logprobs[start : start + kept]
        for i, (seq, start) in enumerate(zip(batch.seqs, batch.positions(), strict=True)):
            k = seq.params.prompt_logprobs
            if k is None:
                continue
            # Row p predicts prompt token p+1; the last prompt row predicts the first output instead. A
            # recompute after preemption skips the positions it has reported already.
            first = max(start, len(seq.prompt_logprobs))
            last = min(start + batch.num_new_tokens[i], seq.num_prompt_tokens - 1)
            if first >= last:
                continue
            rows = range(qsl[i] + first - start, qsl[i] + last - start)
            targets = seq.token_ids[first + 1 : last + 1]
            chunk_logits = self.logits(hidden, list(rows), lora)
            result.prompt_logprobs[i] = compute_prompt_logprobs(chunk_logits, torch.tensor(targets), k)
        result.on_device = (out.tokens, on_device) if on_device else None
        return result if lazy else result.resolve()

    def _apply_grammar(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], filling) -> None:
        stats = self.grammar_stats
        t0 = time.perf_counter()
        stats.fill_s += filling.result()
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask, rows)
        stats.wait_s += t1 - t0
        stats.apply_s += time.perf_counter() - t1
        stats.steps += 1
        stats.rows += len(rows)
