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
import mmap
import weakref

import torch

from motet.engine.weights.load_progress import LoadProgress
from motet.engine.worker.latent_attention import LatentAttention
from motet.engine.worker.layers import Linear, RMSNorm
from motet.engine.worker.model import MLP, STACKED, AttentionMetadata, CausalLM, Experts, SparseMoE
from motet.kernels import cpu_native
from motet.kernels.quant import BLOCK
from motet.lora.pool import GROUP_OF, LoRABatch
from motet.models.projections import GATE_UP, QKV

_HUGE_PAGE = 2 << 20
MAX_LATENT_ROPE = 256  # the latent op's rotated key at most (the source's kMaxLatentRope)


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


def unsupported(model: CausalLM, kv_dtype: torch.dtype) -> str | None:
    """Why the native step does not run this model, or None where it does: the kernels built, its dtypes theirs,
    its heads within the attention kernel's limits (latent attention: its rotated key within the latent op's, an
    unrotated key part in every head: the op folds kv_b_proj's key half into the query), no expert parallelism (the
    MoE op has no all-to-all: the eager model dispatches). The program's own check (the source's check_program)
    refuses no model admitted here: every layer option of the eager decoder is an op (or an op's option) of the
    program, DeepSeek's latent attention and routing included."""
    cfg = model.config
    latent = cfg.latent
    if cpu_native.library() is None:
        return "its kernels are not built"
    if model.parallel.expert_parallel:
        return "expert parallelism (the MoE op has no all-to-all)"
    if (
        model.embed_tokens.weight.dtype not in cpu_native.DTYPE_CODES
        or kv_dtype not in cpu_native.DTYPE_CODES
    ):
        return f"weights in {model.embed_tokens.weight.dtype}, KV cache in {kv_dtype}"
    if latent is not None:
        if latent.qk_rope_head_dim > MAX_LATENT_ROPE:
            return (
                f"qk_rope_head_dim {latent.qk_rope_head_dim} (the latent op turns at most {MAX_LATENT_ROPE})"
            )
        if latent.qk_nope_head_dim < 1:
            return "qk_nope_head_dim 0 (the latent op folds each head's unrotated key part into its query)"
    elif not (
        cfg.num_attention_heads % cfg.num_key_value_heads == 0
        and cfg.num_attention_heads // cfg.num_key_value_heads <= 16
        and cfg.head_dim <= 256
    ):
        return (
            f"{cfg.num_attention_heads} heads on {cfg.num_key_value_heads} KV heads of {cfg.head_dim} "
            "(the attention kernel takes up to 16 heads a KV head, of up to 256)"
        )
    if cfg.rotary_dim % 2:
        return f"an odd rotary width ({cfg.rotary_dim})"
    return None


def supported(model: CausalLM, kv_dtype: torch.dtype) -> bool:
    """Whether the native step runs this model (`unsupported` says why not)."""
    return unsupported(model, kv_dtype) is None


def _activation(mlp: MLP) -> str:
    """The MLP's activation by the program's name (cpu_native.ACTIVATIONS)."""
    return "gelu_tanh" if mlp.gelu else "silu"


def _packed_bytes(lin: Linear, elem: int) -> int:
    """Bytes of a linear layer's packed weight: panels of 16 rows (quantized: block records per panel)."""
    if lin.quantized is not None:
        N, K = lin.quantized.shape
        record = cpu_native.QUANT_RECORD[lin.quantized.format.name]
        return -(-N // cpu_native.PANEL) * (K // BLOCK) * record
    N, K = lin.weight.shape
    return -(-N // cpu_native.PANEL) * cpu_native.PANEL * K * elem


def _experts_bytes(experts: Experts, elem: int) -> int:
    """Bytes of a sparse layer's experts packed (each expert's weight as a linear layer's, one after another)."""
    total = 0
    for key in STACKED:
        if key in experts.quantized:
            q = experts.quantized[key]
            N, K = q.rows, q.weight.shape[1]
            record = cpu_native.QUANT_RECORD[q.weight.format.name]
            total += len(q) * -(-N // cpu_native.PANEL) * (K // BLOCK) * record + 64
        else:
            E, N, K = getattr(experts, key).shape
            total += E * -(-N // cpu_native.PANEL) * cpu_native.PANEL * K * elem + 64
    return total


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

    The forward is a program of op records (motet/kernels/cpu_native.ProgramWriter), written once here by walking
    the model's layers as the eager decoder runs them: each layer's norms where it has them, its attention (qkv,
    q/k norms across heads or per head, rotary over the layer's table and dims, KV write and paged attention
    with its window, soft-cap and sinks, o), its dense MLP (with the activation it declares) or sparse mixture
    of experts (router with its routing options, experts, shared expert and its gate), or a latent attention
    (`_write_latent`), each block's output joining the stream in one op
    (the all-reduce, the layer's norm after the block, the add); then the final norm."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        progress: LoadProgress | None = None,
    ):
        """The program of `model`'s step over `kv_caches`, its weights packed layer by layer (`progress` logs how
        far the packing is: seconds a layer on a busy CPU)."""
        cfg = model.config
        wdtype = self._wdtype = model.embed_tokens.weight.dtype
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
                total += _experts_bytes(moe.experts, elem)
        for (
            layer
        ) in model.layers:  # kv_b_proj's halves packed a head after another (and its own pack released)
            if isinstance(layer.self_attn, LatentAttention):
                a = layer.self_attn
                per_head = -(-a.rank // cpu_native.PANEL) * a.nope + -(-a.v_dim // cpu_native.PANEL) * a.rank
                total += a.num_heads * per_head * cpu_native.PANEL * elem + 128
        total += _packed_bytes(model.lm_head, elem) + 64
        self.arena = WeightArena(total + 64 * 64)
        self._keep: list[torch.Tensor] = []  # everything the program points at
        w = cpu_native.ProgramWriter(cfg.hidden_size)
        layers = zip(model.layers, kv_caches, strict=True)
        for i, (layer, kv) in enumerate(progress.each_layer(layers) if progress else layers):
            self._write_layer(w, i, layer, kv)
        w.rms_norm("x", "x", self._keep_ptr(model.norm.weight), model.norm.eps, cfg.hidden_size)
        # the lm_head in its own format too (quantized: its blocks; else the model's dtype, tied or not)
        self.lm_format = model.lm_head.quantized.format.name if model.lm_head.quantized is not None else None
        if self.lm_format is not None:
            self.lm_head = self.arena.put(cpu_native.pack_quantized(model.lm_head.quantized))
        else:
            self.lm_head = self.arena.put(cpu_native.pack(model.lm_head.weight.detach()))
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

    def _keep_ptr(self, t: torch.Tensor | None, dtype: torch.dtype | None = None) -> int | None:
        """The address of `t` (in `dtype`, contiguous), kept alive with the program; None for None."""
        if t is None:
            return None
        t = t.detach().to(dtype or t.dtype).contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _packed(self, lin: Linear) -> tuple[int, int]:
        """The layer's weight in the arena, in its own format (the model's dtype or a quantized one): (address,
        format code). The layer's own copy is released."""
        if lin.quantized is not None:
            data = self.arena.put(cpu_native.pack_quantized(lin.quantized))
            code = cpu_native.QUANT_CODES[lin.quantized.format.name]
        else:
            data = self.arena.put(cpu_native.pack(lin.weight.detach()))
            code = cpu_native.DTYPE_CODES[self._wdtype]
        _release(lin, self._wdtype)
        return data.data_ptr(), code

    def _linear(self, w: cpu_native.ProgramWriter, lin: Linear, src: str, dst: str, layer: int = -1,
                lora: tuple[str, ...] | None = None, sizes=(), accumulate: bool = False) -> None:  # fmt: skip
        """A linear layer (its bias in the model's dtype, whatever the weight's format), with the layer's LoRA
        deltas of the module group `lora` where adapters may target it."""
        bias = self._keep_ptr(lin.bias, self._wdtype)
        k, n = lin.in_features, lin.out_features
        weight, code = self._packed(lin)
        group = GROUP_OF[lora] if lora is not None else -1
        w.linear(src, dst, weight, code, k, n, bias, accumulate, layer, group, sizes)

    def _write_layer(self, w: cpu_native.ProgramWriter, i: int, layer, kv) -> None:
        """Layer `i`'s ops, as DecoderLayer.forward runs it."""
        hidden = self.model.config.hidden_size

        def norm(module: RMSNorm | None, src: str = "x", dst: str = "h") -> str:
            """What a block reads: the stream normed by the layer's norm before it, or the stream itself."""
            if module is None:
                return src
            w.rms_norm(src, dst, self._keep_ptr(module.weight), module.eps, hidden)
            return dst

        def joins(post: RMSNorm | None) -> None:
            """The block's output joins the stream, normed first where the layer has a norm after the block."""
            w.add_residual(
                "out", hidden, self._keep_ptr(post.weight) if post else None, post.eps if post else 0.0
            )

        if isinstance(layer.self_attn, LatentAttention):
            self._write_latent(w, i, layer.self_attn, norm(layer.input_layernorm), kv)
        else:
            self._write_attention(w, i, layer.self_attn, norm(layer.input_layernorm), kv)
        joins(layer.attn_out_norm if layer.post_norms else None)
        src = norm(layer.post_attention_layernorm)
        if isinstance(layer.mlp, SparseMoE):
            self._write_moe(w, layer.mlp, src)
        else:
            self._write_mlp(w, i, layer.mlp, src)
        joins(layer.mlp_out_norm if layer.post_norms else None)

    def _write_attention(self, w: cpu_native.ProgramWriter, i: int, attn, src: str, kv) -> None:
        """qkv (+ LoRA) -> q/k norms -> rotary and the KV write -> paged attention -> o (+ LoRA), into "out"."""
        model = self.model
        H, KVH, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q, kvs = attn.q_size, attn.kv_size
        self._linear(w, attn.qkv_proj, src, "qkv", i, QKV, (q, kvs, kvs))
        if attn.q_norm is not None:  # across the heads (one run of q_size), or per head (a run of D each)
            whole = attn.qk_norm_whole
            qn, kn = attn.q_norm, attn.k_norm
            # across heads split over tensor-parallel ranks: the whole model's widths (sums all-reduced)
            q_whole, k_whole = attn.whole_widths if whole and model.parallel.enabled else (0, 0)
            w.rms_norm("qkv", "qkv", self._keep_ptr(qn.weight), qn.eps, q if whole else D, 1 if whole else H,
                       whole=q_whole)  # fmt: skip
            w.rms_norm("qkv", "qkv", self._keep_ptr(kn.weight), kn.eps, kvs if whole else D, 1 if whole else KVH,
                       src_col=q, dst_col=q, whole=k_whole)  # fmt: skip
        # the layer's rotary: a sliding layer's own table where the model has one (Gemma 3's local base)
        local = i in model.config.sliding_layers and model.local_rope is not None
        rope = model.local_rope if local else model.rope
        pool = "window" if attn.window is not None else "global"
        k_cache, v_cache = kv[0].data_ptr(), kv[1].data_ptr()
        cos, sin = self._keep_ptr(rope.cos), self._keep_ptr(rope.sin)
        w.rotary_kv("qkv", H, KVH, D, 2 * rope.cos.shape[1], cos, sin, k_cache, v_cache, pool)
        sinks = self._keep_ptr(attn.sinks, torch.float32)
        w.attention("qkv", "attn", H, KVH, D, k_cache, v_cache, pool, attn.scale, attn.window, attn.softcap,
                    sinks)  # fmt: skip
        self._linear(w, attn.o_proj, "attn", "out", i, ("o_proj",), (attn.o_proj.out_features,))

    def _write_latent(self, w: cpu_native.ProgramWriter, i: int, attn: LatentAttention, src: str, kv) -> None:
        """DeepSeek's latent attention: q (q_proj, or q_a_proj -> its norm -> q_b_proj) and kv_a_proj_with_mqa ->
        kv_a_layernorm over c_kv (each + LoRA) -> the latent op (rotary, the cache's rows, the absorbed attention
        with kv_b_proj's halves and its LoRA) -> o_proj (+ LoRA), into "out"."""
        H, nope, rope, rank, v = attn.num_heads, attn.nope, attn.rope, attn.rank, attn.v_dim
        q_width = H * (nope + rope)
        if attn.q_proj is not None:  # (PEFT's q_proj: the q/k/v group, k and v empty)
            self._linear(w, attn.q_proj, src, "q", i, QKV, (q_width, 0, 0))
        else:
            self._linear(w, attn.q_a_proj, src, "q_a", i, ("q_a_proj",), (attn.q_a_proj.out_features,))
            qn = attn.q_a_layernorm
            w.rms_norm("q_a", "q_a", self._keep_ptr(qn.weight), qn.eps, attn.q_a_proj.out_features)
            self._linear(w, attn.q_b_proj, "q_a", "q", i, ("q_b_proj",), (q_width,))
        self._linear(w, attn.kv_a_proj_with_mqa, src, "kv", i, ("kv_a_proj_with_mqa",), (rank + rope,))
        kn = attn.kv_a_layernorm
        w.rms_norm("kv", "kv", self._keep_ptr(kn.weight), kn.eps, rank)
        # kv_b_proj's key half W_UK[h] [nope, rank] packed transposed (the latent query: q_nope W_UK), its value half
        # W_UV[h] [v, rank] as it is, a head after another
        kv_b = attn.kv_b_proj.weight.detach().view(H, nope + v, rank)
        w_uk = self.arena.put(torch.cat([cpu_native.pack(kv_b[h, :nope].T.contiguous()) for h in range(H)]))
        w_uv = self.arena.put(torch.cat([cpu_native.pack(kv_b[h, nope:].contiguous()) for h in range(H)]))
        _release(attn.kv_b_proj, self._wdtype)
        rope_table = self.model.rope
        w.latent_attention("q", "kv", "attn", H, nope, rope, rank, v, self._keep_ptr(rope_table.cos),
                           self._keep_ptr(rope_table.sin), kv[0].data_ptr(), w_uk.data_ptr(), w_uv.data_ptr(),
                           attn.scale, attn.interleaved, i, GROUP_OF[("kv_b_proj",)])  # fmt: skip
        self._linear(w, attn.o_proj, "attn", "out", i, ("o_proj",), (attn.o_proj.out_features,))

    def _write_mlp(self, w: cpu_native.ProgramWriter, i: int, mlp: MLP, src: str) -> None:
        """gate/up (+ LoRA) -> the activation -> down (+ LoRA), into "out"."""
        inter = mlp.intermediate
        self._linear(w, mlp.gate_up_proj, src, "gu", i, GATE_UP, (inter, inter))
        w.activation("gu", "act", inter, _activation(mlp))
        self._linear(w, mlp.down_proj, "act", "out", i, ("down_proj",), (mlp.down_proj.out_features,))

    def _write_moe(self, w: cpu_native.ProgramWriter, moe: SparseMoE, src: str) -> None:
        """The router (+ bias) -> the experts (their biases and activation) into "out", + the shared expert
        scaled by its sigmoid gate. No LoRA: adapters target the attention of an MoE model only."""
        experts = moe.experts
        cfg = self.model.config
        E, inter, hidden = experts.num_local, experts.intermediate, cfg.hidden_size
        self._linear(w, moe.gate, src, "router")

        def stacked(key: str) -> int:
            """Every expert's weight packed, one after another in the arena (the grouped GEMM's layout)."""
            if key in experts.quantized:
                q = experts.quantized[key]
                packed = [cpu_native.pack_quantized(q[e]) for e in range(len(q))]
            else:
                packed = [cpu_native.pack(x) for x in getattr(experts, key).detach()]
            return self.arena.put(torch.cat(packed)).data_ptr()

        quantized = experts.quantized.get("gate_up_proj")
        code = cpu_native.DTYPE_CODES[self._wdtype]
        bias_dtype = self._wdtype
        if quantized is not None:  # (both stacked weights in one format: --quantization)
            code, bias_dtype = cpu_native.QUANT_CODES[quantized.weight.format.name], torch.float32
        gate_up, down = stacked("gate_up_proj"), stacked("down_proj")
        gate_up_bias = self._keep_ptr(experts.gate_up_proj_bias, bias_dtype)
        down_bias = self._keep_ptr(experts.down_proj_bias, bias_dtype)
        router = moe.gate
        routing = None
        if not router.plain:  # DeepSeek's
            bias = self._keep_ptr(router.e_score_correction_bias, torch.float32)
            routing = cpu_native.RouteOptions(
                router.sigmoid, router.groups, router.groups_kept, bias, router.scale
            )
        w.moe(src, "router", "out", E, moe.top_k, inter, hidden, router.norm_topk_prob, cfg.expert_act, gate_up,
              down, gate_up_bias, down_bias, cfg.swiglu_alpha, cfg.swiglu_limit, code, routing)  # fmt: skip
        empty = torch.nn.Parameter(torch.empty(0, dtype=self._wdtype), requires_grad=False)
        experts.gate_up_proj, experts.down_proj, experts.quantized = empty, empty, {}
        if moe.shared_expert is not None:
            shared, gate = moe.shared_expert, moe.shared_expert_gate
            if gate is not None:
                self._linear(w, gate, src, "gate")
            self._linear(w, shared.gate_up_proj, src, "gu")
            w.activation("gu", "act", shared.intermediate, _activation(shared))
            if gate is None:  # DeepSeek's shared experts: added as they are
                self._linear(w, shared.down_proj, "act", "out", accumulate=True)
            else:
                self._linear(w, shared.down_proj, "act", "shared")
                w.gated_add("shared", "out", hidden, "gate")  # (scaled after its down, as transformers does)

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
