"""The compiled CPU step: the whole decoder stack in one native call (motet/kernels/cpu_native.forward).

The eager model (motet/engine/worker/model.py) dispatches some 25 torch ops per layer; at small batches on a CPU that
dispatch, and torch's bf16 products on CPUs without bf16 units, cost more than reading the weights. Here
the weights are packed once into the native GEMM's panels, in the order a step reads them, in memory backed
by huge pages (the hardware prefetchers stop at page boundaries), and a step is one call: norms, projections
with their LoRA deltas, rotary, KV writes and paged attention, with fp32 activations whatever the weights'
dtype. The call runs a program of op records that `CpuForward` writes once by walking the model's layers (llama.cpp's
way: motet/kernels/csrc/cpu_kernels.cpp is a loop over them), so whatever options a family's layers declare
(norms before and / or after the blocks, q/k norms, a partial rotary or a sliding layer's own table, windows with
their own KV pool, soft-caps, sinks, biases, GeGLU or a clamped SwiGLU, experts, DeepSeek's latent attention and
routing) the native step runs them, with no architecture's name here. Each projection runs in its layer's own weight
format (the model's dtype, or int8/int4 blocks unpacked in registers: motet/kernels/csrc/qgemm.h). It serves every
step (decode, prefill chunks, mixed) and is the CPU's default; the eager model stays the reference
(`EngineConfig.compile_step = False`, `--no-compile`), and tests hold the two to agree.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref

import torch

from motet.engine.weights.load_progress import LoadProgress
from motet.engine.worker.model import AttentionMetadata, CausalLM
from motet.engine.worker.op_writer import OpWriter, WeightArena, packed_bytes
from motet.kernels import cpu_native
from motet.lora.pool import LoRABatch


def unsupported(model: CausalLM, kv_dtype: torch.dtype) -> str | None:
    """Why the native step does not run this model, or None where it does: the kernels built, its dtypes theirs,
    each layer's attention within its op's limits (the layer's `native_unsupported`), no expert parallelism (the
    MoE op has no all-to-all: the eager model dispatches). The program's own check (the source's check_program)
    refuses no model admitted here: every layer option of the eager decoder is an op (or an op's option) of the
    program, DeepSeek's latent attention and routing included."""
    cfg = model.config
    if cpu_native.library() is None:
        return "its kernels are not built"
    if model.parallel.expert_parallel:
        return "expert parallelism (the MoE op has no all-to-all)"
    if model.weight_dtype not in cpu_native.DTYPE_CODES or kv_dtype not in cpu_native.DTYPE_CODES:
        return f"weights in {model.weight_dtype}, KV cache in {kv_dtype}"
    for layer in model.layers:
        if why := layer.self_attn.native_unsupported():
            return why
    if cfg.rotary_dim % 2:
        return f"an odd rotary width ({cfg.rotary_dim})"
    return None


def head_is_table(model: CausalLM) -> bool:
    """Whether the embedding table holds the lm_head's values, so that a lookup may read the packed lm_head
    (`PackedTable`): a tied table in the model's dtype (a float checkpoint's, the lm_head not quantized apart
    from it)."""
    head, table = model.lm_head, model.embed_tokens
    return isinstance(table, torch.nn.Embedding) and head.quantized is None and head.weight is table.weight


class PackedTable(torch.nn.Module):
    """A tied embedding table looked up in its lm_head's packed panels (cpu_native.packed_rows): the table's
    values without a copy of their own (a float SmolLM2's 49,152 x 576 table is 113 MB in fp32)."""

    def __init__(self, packed: torch.Tensor, fmt: str | None, rows: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.packed, self.format, self.dtype = packed, fmt, dtype
        self.num_embeddings, self.hidden = rows, hidden

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).long()
        rows = cpu_native.packed_rows(self.packed, ids, self.hidden, self.format).to(self.dtype)
        return rows.view(*input_ids.shape, self.hidden)


def _return_freed_memory() -> None:
    """Give the heap's freed pages back to the system: glibc keeps them, so after packing the process would hold
    the unpacked weights' memory as well as the arena (measured: benchmarks/load_peak.py). Elsewhere: nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class CpuForward:
    """`model`'s forward and logits through the native kernels, over the runner's KV caches.

    Takes the linear layers' weights over (packed into the arena; a sparse layer's experts and the lm_head too);
    the module's own copies are released, so the eager forward of this model instance is no longer usable (the
    embedding table stays, the input lookup: a tied one in the model's dtype is looked up in the packed lm_head
    instead, `PackedTable`, its own copy released).

    The forward is a program of op records (motet/kernels/cpu_native.ProgramWriter), written once by the model's
    layers as the eager decoder runs them: each layer's norms where it has them, its attention (qkv,
    q/k norms across heads or per head, rotary over the layer's table and dims, KV write and paged attention
    with its window, soft-cap and sinks, o), its dense MLP (with the activation it declares) or sparse mixture
    of experts (router with its routing options, experts, shared expert and its gate), or a latent attention,
    each block's output joining the stream in one op (the all-reduce, the layer's norm after the block, the add);
    then the final norm. Each layer class writes its own ops beside its eager forward (`write_ops`, through an
    OpWriter: motet/engine/worker/op_writer.py)."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        progress: LoadProgress | None = None,
        arena: WeightArena | None = None,
        table_from_head: bool | None = None,
    ):
        """The program of `model`'s step over `kv_caches`, its weights packed layer by layer (`progress` logs how
        far the packing is: seconds a layer on a busy CPU) into a new arena, or taken from `arena` replaying a
        prepared-weights cache entry (motet/engine/worker/prepared_weights.py). `table_from_head`: the embedding
        table is looked up in the packed lm_head (`PackedTable`; by default where the table is the lm_head's
        weight, `head_is_table`)."""
        cfg = model.config
        wdtype = self._wdtype = model.weight_dtype
        self.model = model
        self.kv_caches = kv_caches
        self.vocab_size = model.lm_head.out_features
        self._logits_out: torch.Tensor | None = None  # logits(reuse=True)
        if table_from_head is None:
            table_from_head = head_is_table(model)
        if arena is None:
            elem = torch.tensor([], dtype=wdtype).element_size()
            total = sum(packed_bytes(lin, elem) + 64 for lin in [*model.decoder_linears(), model.lm_head])
            # what a layer packs besides its linear layers (a router and experts, kv_b_proj's halves)
            total += sum(
                layer.self_attn.arena_bytes(elem) + layer.mlp.arena_bytes(elem) for layer in model.layers
            )
            arena = WeightArena(total + 64 * 64)
        self.arena = arena
        w = cpu_native.ProgramWriter(cfg.hidden_size)
        ops = OpWriter(w, self.arena, wdtype, cfg, model.rope, model.local_rope, model.parallel)
        self._keep = ops.keep  # everything the program points at
        layers = zip(model.layers, kv_caches, strict=True)
        for i, (layer, kv) in enumerate(progress.each_layer(layers) if progress else layers):
            layer.write_ops(ops, i, kv)
        w.rms_norm("x", "x", ops.ptr(model.norm.weight), model.norm.eps, cfg.hidden_size)
        # the lm_head in its own format too (quantized: its blocks; else the model's dtype, tied or not)
        head = model.lm_head
        self.lm_format = head.quantized.format.name if head.quantized is not None else None
        if self.lm_format is not None:
            quantized = head.quantized
            self.lm_head = self.arena.put(lambda: cpu_native.pack_quantized(quantized))
        else:
            weight = head.weight.detach()
            self.lm_head = self.arena.put(lambda: cpu_native.pack(weight))
        self.arena.finish()
        ops.release(head)
        if table_from_head:  # the table's own copy released too: lookups read the head's panels
            model.embed_tokens = PackedTable(self.lm_head, self.lm_format, model.embed_tokens.num_embeddings,
                                             cfg.hidden_size, wdtype)  # fmt: skip
        _return_freed_memory()  # the unpacked weights just released
        self.program = w.program(
            cpu_native.DTYPE_CODES[wdtype],
            cpu_native.DTYPE_CODES[kv_caches[0][0].dtype],
            kv_caches[0][0].shape[1],
        )
        self._release = weakref.finalize(self, cpu_native.release, self.program)
        # Tensor parallelism: each block's partial output is summed over the ranks by torch.distributed, called
        # back from the forward. An error there (a dead rank) cannot cross the C frames: it is kept, the
        # remaining calls skip, and __call__ raises it once the forward returns.
        self._failure: BaseException | None = None
        if model.parallel.enabled:
            self._all_reduce = cpu_native.ALL_REDUCE(self._reduce)  # (kept: the program points at it)
            self.program.all_reduce = self._all_reduce
        self._lora: tuple[object, cpu_native.LoraPool] | None = None  # (the pool, its descriptor)
        self.timings: ctypes.Array | None = None  # seconds per phase (cpu_native.PHASES), when profiling

    def _reduce(self, ptr: int, n: int) -> None:
        if self._failure is not None:
            return
        try:
            self.model.parallel.all_reduce(
                torch.frombuffer((ctypes.c_float * n).from_address(ptr), dtype=torch.float32)
            )
        except BaseException as e:
            self._failure = e

    def profile(self, on: bool = True) -> None:
        """Sum the time of each phase of the forward (benchmarks/step_profile.py); resets the sums."""
        self.timings = (ctypes.c_double * len(cpu_native.PHASES))() if on else None

    def phase_seconds(self) -> dict[str, float]:
        return dict(zip(cpu_native.PHASES, self.timings or [], strict=False))

    def _lora_pool(self, lora: LoRABatch) -> cpu_native.LoraPool:
        """The descriptor of the adapters' pool the batch reads (made once: the pool is allocated once)."""
        pool = lora.weights.pool
        if self._lora is None or self._lora[0] is not pool:
            assert pool.dtype == self._wdtype, "the adapters' pool is in the model's dtype"
            groups = pool.layout.groups
            desc = cpu_native.LoraPool.of(
                pool.data, pool.desc, [g.a_ld for g in groups], [g.bt_ld for g in groups]
            )
            self._lora = (pool, desc)
        return self._lora[1]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None,
    ) -> torch.Tensor:
        """Final (normed) hidden states [T, hidden], fp32."""
        x = self.model.embed_input(input_ids, lora, torch.float32)
        tables, qsl, lens = meta.block_tables, meta.query_start_loc, meta.seq_lens
        assert tables.dtype == qsl.dtype == lens.dtype == torch.int32 and tables.is_contiguous()
        assert positions.dtype == meta.slot_mapping.dtype == torch.int64
        step = cpu_native.Step(
            x.shape[0],
            len(lens),
            positions.data_ptr(),
            meta.slot_mapping.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            qsl.data_ptr(),
            lens.data_ptr(),
        )
        if meta.window is not None:  # the sliding-window layers' pool (else they read the global slots)
            window = meta.window
            assert window.block_tables.dtype == torch.int32 and window.block_tables.is_contiguous()
            assert window.slot_mapping.dtype == torch.int64
            step.window_slots, step.window_tables = (
                window.slot_mapping.data_ptr(),
                window.block_tables.data_ptr(),
            )
            step.window_table_stride = window.block_tables.stride(0)
        if lora is not None:
            starts, slots = lora.seg_starts, lora.seg_slots
            assert starts.dtype == slots.dtype == torch.int32
            step.num_segs, step.seg_starts, step.seg_slots = len(slots), starts.data_ptr(), slots.data_ptr()
            step.lora = ctypes.pointer(self._lora_pool(lora))
        if self.timings is not None:
            step.timings = self.timings
        cpu_native.forward(self.program, step, x)
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        return x

    def logits(self, hidden: torch.Tensor, reuse: bool = False) -> torch.Tensor | None:
        """fp32 logits of `hidden`'s rows (under tensor parallelism: gathered on rank 0, None elsewhere). `reuse`:
        into a buffer kept for the next call, which overwrites them (a step's logits are tens of MB: a fresh
        allocation is a fresh mapping, its pages faulted in and unmapped again each step)."""
        out = None
        if reuse:
            rows = hidden.shape[0]
            if self._logits_out is None or self._logits_out.shape[0] < rows:
                self._logits_out = torch.empty((rows, self.vocab_size), dtype=torch.float32)
            out = self._logits_out[:rows]
        local = cpu_native.gemm(
            hidden.float().contiguous(), self.lm_head, self.vocab_size, quantized=self.lm_format, out=out
        )
        return self.model.parallel.gather_columns(local, self.model.config.vocab_size)
