"""The compiled CPU step: the whole decoder stack in one native call (motet/kernels/cpu_native.forward).

The eager model (motet/engine/model.py) dispatches some 25 torch ops per layer; at small batches on a CPU that
dispatch, and torch's bf16 products on CPUs without bf16 units, cost more than reading the weights. Here
the weights are packed once into the native GEMM's panels, in the order a step reads them, in memory backed
by huge pages (the hardware prefetchers stop at page boundaries), and a step is one call: norms, projections
with their LoRA deltas, rotary, KV writes and paged attention, with fp32 activations whatever the weights'
dtype. Each projection runs in its layer's own weight format (the model's dtype, or int8/int4 blocks
unpacked in registers: motet/kernels/csrc/qgemm.h). It serves every step (decode, prefill chunks, mixed)
and is the CPU's default; the eager model stays the reference (`EngineConfig.compile = False`,
`--no-compile`), and tests hold the two to agree.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

import torch

from motet.engine.model import MLP, AttentionMetadata, CausalLM, Linear, SparseMoE
from motet.kernels import cpu_native
from motet.kernels.quant import BLOCK
from motet.lora.pool import LoRABatch

_HUGE_PAGE = 2 << 20


class WeightArena:
    """One buffer for the packed weights, backed by transparent huge pages where the kernel allows it."""

    def __init__(self, nbytes: int):
        size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE + _HUGE_PAGE
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        self._bytes = raw[(-raw.data_ptr()) % _HUGE_PAGE :]
        self._used = 0

    def put(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` in the arena (64-byte aligned)."""
        n = tensor.numel() * tensor.element_size()
        start = -(-self._used // 64) * 64
        out = self._bytes[start : start + n].view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        self._used = start + n
        return out


def supported(model: CausalLM, kv_dtype: torch.dtype) -> bool:
    cfg = model.config
    return (
        cpu_native.library() is not None
        and not model.parallel.expert_parallel  # the MoE op has no all-to-all: the eager model dispatches
        # OLMo 2's and Gemma 3's layers (norms after the blocks, q/k normed across heads, GeGLU, a rope base
        # per layer): the eager decoder for now (as for a context past a sliding window: model_runner.py)
        and not cfg.post_norms
        and not cfg.qk_norm_whole
        and cfg.hidden_act == "silu"
        and not (
            cfg.output_bias or cfg.attention_sinks or cfg.expert_bias or cfg.expert_act != "silu"
        )  # GPT-OSS's
        and not cfg.sliding_layers
        and model.embed_tokens.weight.dtype in cpu_native.DTYPE_CODES
        and kv_dtype in cpu_native.DTYPE_CODES
        and cfg.num_attention_heads % cfg.num_key_value_heads == 0
        and cfg.num_attention_heads // cfg.num_key_value_heads <= 16
        and cfg.head_dim <= 256
        and cfg.head_dim % 2 == 0
    )


def _packed_bytes(lin: Linear, elem: int) -> int:
    """Bytes of a linear layer's packed weight: panels of 16 rows (quantized: block records per panel)."""
    if lin.quantized is not None:
        N, K = lin.quantized.shape
        record = cpu_native.QUANT_RECORD[lin.quantized.format.name]
        return -(-N // cpu_native.PANEL) * (K // BLOCK) * record
    N, K = lin.weight.shape
    return -(-N // cpu_native.PANEL) * cpu_native.PANEL * K * elem


def _return_freed_memory() -> None:
    """Give the heap's freed pages back to the system: glibc keeps them, so after packing the process would hold
    the unpacked weights' memory as well as the arena (measured: benchmarks/load_peak.py). Elsewhere: nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _release(lin: Linear, dtype: torch.dtype) -> None:
    """Drop a layer's own copy of its weight (the arena holds it now)."""
    lin.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
    lin.packed_weight = lin.quantized = None


class CpuForward:
    """`model`'s forward and logits through the native kernels, over the runner's KV caches.

    Takes the linear layers' weights over (packed into the arena; a sparse layer's experts too); the module's
    own copies are released, so the eager forward of this model instance is no longer usable (the embedding
    table stays: it is the input lookup, and the lm_head's when tied).

    Each layer's descriptor is an attention op's weights and an MLP op's: the dense MLP's, or a sparse
    layer's mixture of experts (router, experts, shared expert), as the layer's module is."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        cfg = model.config
        wdtype = self.desc_dtype = model.embed_tokens.weight.dtype
        self.model = model
        self.kv_caches = kv_caches
        self.vocab_size = model.lm_head.out_features
        self._logits_out: torch.Tensor | None = None  # logits(reuse=True)
        elem = torch.tensor([], dtype=wdtype).element_size()
        total = sum(_packed_bytes(lin, elem) + 64 for lin in model.decoder_linears())
        for layer in model.layers:
            if isinstance(layer.mlp, SparseMoE):
                moe = layer.mlp
                total += _packed_bytes(moe.gate, elem) + 64
                if moe.shared_expert_gate is not None:
                    total += _packed_bytes(moe.shared_expert_gate, elem) + 64
                for stacked in (moe.experts.gate_up_proj, moe.experts.down_proj):
                    E, N, K = stacked.shape
                    total += E * -(-N // cpu_native.PANEL) * cpu_native.PANEL * K * elem + 64
        total += _packed_bytes(model.lm_head, elem) + 64
        self.arena = WeightArena(total + 64 * 64)
        self._keep: list[torch.Tensor] = []  # everything a descriptor points at

        def keep(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.detach().contiguous()
            self._keep.append(t)
            return t.data_ptr()

        def packed(lin: Linear) -> cpu_native.Linear:
            """The layer's weight in the arena, in its own format (the model's dtype or a quantized one)."""
            if lin.quantized is not None:
                name = lin.quantized.format.name
                data = self.arena.put(cpu_native.pack_quantized(lin.quantized))
                out = cpu_native.Linear(data.data_ptr(), cpu_native.QUANT_CODES[name])
            else:
                data = self.arena.put(cpu_native.pack(lin.weight.detach()))
                out = cpu_native.Linear(data.data_ptr(), cpu_native.DTYPE_CODES[wdtype])
            _release(lin, wdtype)
            return out

        def mlp(module: MLP | None) -> cpu_native.MlpWeights:
            if module is None:
                return cpu_native.MlpWeights()
            return cpu_native.MlpWeights(
                packed(module.gate_up_proj), packed(module.down_proj), module.intermediate
            )

        def stacked_experts(weight: torch.nn.Parameter) -> int:
            """Every expert's weight packed, one after another in the arena (the grouped GEMM's layout)."""
            data = self.arena.put(torch.cat([cpu_native.pack(w) for w in weight.detach()]))
            return data.data_ptr()

        def moe_weights(moe: SparseMoE) -> cpu_native.MoeWeights:
            experts = moe.experts
            out = cpu_native.MoeWeights(
                router=packed(moe.gate),
                experts_gate_up=stacked_experts(experts.gate_up_proj),
                experts_down=stacked_experts(experts.down_proj),
                num_experts=experts.gate_up_proj.shape[0],
                top_k=moe.top_k,
                inter=experts.intermediate,
                renormalize=int(moe.norm_topk_prob),
                shared=mlp(moe.shared_expert),
            )
            if moe.shared_expert_gate is not None:
                out.shared_gate = packed(moe.shared_expert_gate)
            empty = torch.nn.Parameter(torch.empty(0, dtype=wdtype), requires_grad=False)
            experts.gate_up_proj, experts.down_proj = empty, empty
            return out

        layers = (cpu_native.Layer * cfg.num_hidden_layers)()
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(model.layers, kv_caches, strict=True)):
            attn = layer.self_attn
            bias = attn.qkv_proj.bias
            layers[i].attn = cpu_native.AttentionWeights(
                keep(layer.input_layernorm.weight),
                packed(attn.qkv_proj),
                keep(bias.to(wdtype)) if bias is not None else None,
                packed(attn.o_proj),
                keep(attn.q_norm.weight) if attn.q_norm is not None else None,
                keep(attn.k_norm.weight) if attn.k_norm is not None else None,
                k_cache.data_ptr(),
                v_cache.data_ptr(),
            )
            layers[i].post_norm = keep(layer.post_attention_layernorm.weight)
            if isinstance(layer.mlp, SparseMoE):
                layers[i].mlp_kind = cpu_native.MLP_SPARSE
                layers[i].moe = moe_weights(layer.mlp)
            else:
                layers[i].mlp_kind = cpu_native.MLP_DENSE
                layers[i].mlp = mlp(layer.mlp)
        # the lm_head in its own format too (quantized: its blocks; else the model's dtype, tied or not)
        self.lm_format = model.lm_head.quantized.format.name if model.lm_head.quantized is not None else None
        if self.lm_format is not None:
            self.lm_head = self.arena.put(cpu_native.pack_quantized(model.lm_head.quantized))
        else:
            self.lm_head = self.arena.put(cpu_native.pack(model.lm_head.weight.detach()))
        self._layers = layers
        _return_freed_memory()  # the unpacked weights just released
        self.desc = cpu_native.Model(
            cpu_native.DTYPE_CODES[wdtype],
            cpu_native.DTYPE_CODES[kv_caches[0][0].dtype],
            cfg.hidden_size,
            model.layers[0].self_attn.num_heads,  # this rank's (all of them on one rank)
            model.layers[0].self_attn.num_kv_heads,
            cfg.head_dim,
            cfg.num_hidden_layers,
            kv_caches[0][0].shape[1],
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
            keep(model.rope.cos),
            keep(model.rope.sin),
            keep(model.norm.weight),
            layers,
        )
        # Tensor parallelism: each op's partial output is summed over the ranks by torch.distributed, called
        # back from the forward. An error there (a dead rank) cannot cross the C frames: it is kept, the
        # remaining calls skip, and __call__ raises it once the forward returns.
        self._failure: BaseException | None = None
        if model.parallel.enabled:
            self._all_reduce = cpu_native.ALL_REDUCE(self._reduce)  # (kept: the descriptor points at it)
            self.desc.all_reduce = self._all_reduce
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
            assert pool.dtype == self.desc_dtype, "the adapters' pool is in the model's dtype"
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
        if lora is not None:
            starts, slots = lora.seg_starts, lora.seg_slots
            assert starts.dtype == slots.dtype == torch.int32
            step.num_segs, step.seg_starts, step.seg_slots = len(slots), starts.data_ptr(), slots.data_ptr()
            step.lora = ctypes.pointer(self._lora_pool(lora))
        if self.timings is not None:
            step.timings = self.timings
        cpu_native.forward(self.desc, step, x)
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
