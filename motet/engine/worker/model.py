"""The decoder every declared family runs (motet/models/), dense or a mixture of experts (whose sparse layers
route each token to its top-k experts: `SparseMoE`), over a flattened batch and a paged KV cache. A family's
declaration sets its options (q/k/v biases, q/k norms per head or across heads, norms before and / or after the
blocks, the MLP's activation, a rope base for sliding-window layers, experts, constants folded into weights) and
its checkpoint's module names.

Tokens of many sequences are concatenated (no padding); `AttentionMetadata` (motet/engine/worker/attention_metadata.py) says where each sequence's
queries are and which cache blocks hold its keys. q/k/v and gate/up projections are fused into one
matrix each (fewer, larger matmuls); checkpoints with Hugging Face names load into them through
motet/engine/worker/decoder_weights.py. The layers carry the residual stream beside each block's output
(vLLM's layout), so that on CUDA the residual add and the next RMSNorm are one Triton kernel, as are the
rotary and the KV-cache write (motet/kernels/fused_norm.py, motet/kernels/rope_kv.py); elsewhere their torch
references compute the same.
With a `LoRABatch` each linear layer also adds every token's own adapter delta (fused layers per module,
into that module's output columns); without one the LoRA path is skipped entirely. A linear layer may hold
its weight quantized (motet/kernels/quant.py; as the checkpoint holds it, or quantized as it loads): every
backend (this eager model, CUDA graphs over it, the native CPU step) takes the format from the layer; LoRA
deltas stay in the model's dtype on top.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from motet.engine.worker.attention_metadata import AttentionMetadata
from motet.engine.worker.layers import Linear, RMSNorm, quantized_product
from motet.engine.worker.op_writer import OpWriter, packed_bytes, panel_bytes
from motet.engine.worker.parallel import SINGLE, Parallel
from motet.engine.worker.routing import Router
from motet.kernels import activation, cpu_native, rope_kv, triton_moe
from motet.kernels.attention_args import AttentionOptions
from motet.kernels.paged_attention import paged_attention
from motet.kernels.quant import QuantizedWeight
from motet.kernels.rope_kv import RotaryAngles
from motet.lora.pool import LoRABatch
from motet.models.config import ModelConfig
from motet.models.declaration import ModelLoadError
from motet.models.projections import GATE_UP, QKV
from motet.models.rope_config import longrope_original


def rope_inv_freq(cfg: ModelConfig, long: bool = False) -> tuple[torch.Tensor, float]:
    """The rotary's inverse frequencies and the factor its cos and sin are scaled by (YaRN's and LongRoPE's
    attention factor; 1 for the others), as transformers' rope functions compute them (over the dimensions it
    turns: all of a head's, or the first `rotary_dim` of them). LongRoPE's with its short factors, or with `long`
    its long ones."""
    dim = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "yarn":
        return yarn_inv_freq(cfg, inv_freq, scaling)
    if kind == "longrope":
        return longrope_inv_freq(cfg, inv_freq, scaling, long)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(mid, scaled, inv_freq)
    elif kind != "default":
        raise ModelLoadError(f"config.json: rope_scaling type {kind!r} is not supported")
    return inv_freq, 1.0


def yarn_inv_freq(cfg: ModelConfig, inv_freq: torch.Tensor, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5's long context, DeepSeek, GPT-OSS): frequencies above a band kept, below it divided by
    `factor`, a linear ramp between; cos and sin scaled by an attention factor from log(factor)."""
    dim, base = cfg.rotary_dim, cfg.rope_theta
    original = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = scaling.get("factor") or cfg.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def band_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = band_dim(scaling.get("beta_fast") or 32), band_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / ((high - low) or 0.001)).clamp(0, 1)
    kept = 1 - ramp  # 1: the frequency as it is (extrapolated), 0: divided by the factor (interpolated)
    return inv_freq / factor * (1 - kept) + inv_freq * kept, float(attention)


def longrope_inv_freq(
    cfg: ModelConfig, inv_freq: torch.Tensor, scaling: dict, long: bool
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3.5, Phi-4-mini): each frequency divided by its short or long factor; cos and sin scaled by
    sqrt(1 + log(factor) / log(original context)), the factor max_position_embeddings / original context where
    the config gives none (transformers' `_compute_longrope_parameters`)."""
    original = scaling["original_max_position_embeddings"]
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
    factor = scaling.get("factor") or cfg.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return inv_freq / factors, float(attention)


class RotaryEmbedding(nn.Module):
    """The rotary's cos and sin tables, a row per position [P, R/2].

    LongRoPE's (`long_rows`: not None) have `original` rows more: rows below the original context turn by the
    short factors and the rest by the long ones, which is how transformers turns a sequence's tokens as it
    generates one at a time (the factors chosen by the furthest position of each forward call: the long ones
    from the original context on); rows P + p turn a position p below the original context by the long factors,
    for the prompt tokens of a prompt longer than the original context (transformers' prefill of it takes the
    long factors throughout). The step's inputs read a token at such a row (step_inputs.py), so a token's
    rotation depends on its position and its prompt's length only: never on its batch or its chunk."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq, attention = rope_inv_freq(cfg)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        self.long_rows: int | None = None
        original = longrope_original(cfg.rope_scaling)
        if original is not None:
            long_freq, attention = rope_inv_freq(cfg, long=True)
            long = torch.outer(torch.arange(max_positions, dtype=torch.float64), long_freq)
            rows = min(original, max_positions)
            freqs = torch.cat([freqs[:rows], long[rows:], long[:rows]])
            self.long_rows = max_positions
        self.register_buffer("cos", (freqs.cos() * attention).float(), persistent=False)  # [P, R/2]
        self.register_buffer("sin", (freqs.sin() * attention).float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> RotaryAngles:
        """The step's angles, made once a step and used by every layer (motet/kernels/rope_kv.py): the tables
        and each token's position, read on the device by the fused kernel; the torch path gathers each token's
        rows once. Hugging Face layout: the two rotated halves are the first and second half of head_dim (of its
        first R = rotary_dim values, the rest unrotated, where the rotary is partial)."""
        return RotaryAngles(positions, self.cos, self.sin)


@functools.cache
def layer_class(path: str) -> type[nn.Module]:
    """The layer class a declaration names as "module:Class" (motet/models/attention.py's `layer`)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them on one rank); returns the o projection's output, a
    partial sum over the ranks under tensor parallelism (the decoder layer all-reduces it)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, parallel: Parallel = SINGLE):
        super().__init__()
        self.layer_idx = layer_idx
        (q_start, self.num_heads), (kv_start, self.num_kv_heads) = parallel.heads(cfg)
        self.head_dim = cfg.head_dim
        # this rank's rows of the checkpoint's q and of its k / v (and columns of o)
        self.q_rows = (q_start * cfg.head_dim, self.num_heads * cfg.head_dim)
        self.kv_rows = (kv_start * cfg.head_dim, self.num_kv_heads * cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.output_bias)
        # GPT-OSS: each head's sink logit (this rank's heads)
        self.sinks = nn.Parameter(torch.empty(self.num_heads), False) if cfg.attention_sinks else None
        self.scale = self.head_dim**-0.5
        # Qwen3: each head's q and k RMS-normalized over head_dim before the rotary
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # OLMo 2's span all heads (this rank's part of their weights)
            q_width, k_width = (
                (self.q_size, self.kv_size) if cfg.qk_norm_whole else (self.head_dim, self.head_dim)
            )
            self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps)
        self.qk_norm_whole = cfg.qk_norm_whole
        self.parallel = parallel
        # the widths of the whole q and k (all ranks' heads): what a norm across heads averages over
        self.whole_widths = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim)
        # a sliding-window layer attends to the last `window` positions
        self.window = cfg.sliding_window if layer_idx in cfg.window_layers else None
        self.softcap = cfg.attn_softcap
        # the fused rotary kernel turns whole heads: a partial rotary (part of each head) takes the reference
        self.partial_rotary = cfg.rotary_dim != cfg.head_dim

    def forward(
        self, x, angles: RotaryAngles, meta: AttentionMetadata, kv_cache, lora: LoRABatch | None = None
    ):
        T = x.shape[0]
        sizes = (self.q_size, self.kv_size, self.kv_size)
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.add(qkv, x, self.layer_idx, QKV, sizes)
        # q, k, v: views of qkv's columns. Qwen3's q/k norms, the rotary and the KV write: one kernel on CUDA
        # (q rotated in place, k rotated into the cache), the torch reference elsewhere
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        if self.qk_norm_whole and self.parallel.enabled:
            self._norm_across_ranks(qkv, q_end, k_end)
        elif self.qk_norm_whole:  # OLMo 2: normed across heads first, in qkv's own columns
            qkv[:, :q_end] = self.q_norm(qkv[:, :q_end])
            qkv[:, q_end:k_end] = self.k_norm(qkv[:, q_end:k_end])
        q = qkv[:, :q_end].view(T, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, k_end:].view(T, self.num_kv_heads, self.head_dim)
        per_head = self.q_norm is not None and not self.qk_norm_whole
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if per_head else ()
        fused = rope_kv.applies(qkv) and not self.partial_rotary
        rotary_kv = rope_kv.rotary_kv_write if fused else rope_kv.rotary_kv_reference
        k_cache, v_cache = kv_cache
        if self.window is not None:
            meta = meta.for_window()
        q = rotary_kv(q, k, v, angles, k_cache, v_cache, meta.slot_mapping, *norms)
        out = paged_attention(q, kv_cache, meta, self.options).reshape(T, self.q_size)
        y = self.o_proj(out)
        if lora is not None:
            lora.add(y, out, self.layer_idx, ("o_proj",), (y.shape[1],))
        return y

    def arena_bytes(self, elem: int) -> int:
        """What its native ops pack besides its linear layers (motet/engine/worker/cpu_forward.py): nothing."""
        return 0

    def write_ops(self, ops: OpWriter, i: int, src: str, kv) -> None:
        """The native step's ops of `forward`: qkv (+ LoRA) -> q/k norms -> rotary and the KV write -> paged
        attention -> o (+ LoRA), into "out"."""
        w = ops.w
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, kvs = self.q_size, self.kv_size
        ops.linear(self.qkv_proj, src, "qkv", i, QKV, (q, kvs, kvs))
        if self.q_norm is not None:  # across the heads (one run of q_size), or per head (a run of D each)
            whole = self.qk_norm_whole
            qn, kn = self.q_norm, self.k_norm
            # across heads split over tensor-parallel ranks: the whole model's widths (sums all-reduced)
            q_whole, k_whole = self.whole_widths if whole and self.parallel.enabled else (0, 0)
            w.rms_norm("qkv", "qkv", ops.ptr(qn.weight), qn.eps, q if whole else D, 1 if whole else H,
                       whole=q_whole)  # fmt: skip
            w.rms_norm("qkv", "qkv", ops.ptr(kn.weight), kn.eps, kvs if whole else D, 1 if whole else KVH,
                       src_col=q, dst_col=q, whole=k_whole)  # fmt: skip
        rope = ops.rope(i)
        pool = "window" if self.window is not None else "global"
        k_cache, v_cache = kv[0].data_ptr(), kv[1].data_ptr()
        cos, sin = ops.ptr(rope.cos), ops.ptr(rope.sin)
        w.rotary_kv("qkv", H, KVH, D, 2 * rope.cos.shape[1], cos, sin, k_cache, v_cache, pool)
        sinks = ops.ptr(self.sinks, torch.float32)
        w.attention("qkv", "attn", H, KVH, D, k_cache, v_cache, pool, self.scale, self.window, self.softcap,
                    sinks)  # fmt: skip
        ops.linear(self.o_proj, "attn", "out", i, ("o_proj",), (self.o_proj.out_features,))

    def projections(self) -> list[Linear]:
        return [self.qkv_proj, self.o_proj]

    # The checkpoint's projections this layer keeps unfused, by name: this rank's rows of each (q, k and v are
    # fused into qkv_proj, which the loader splits itself)
    unfused_rows: dict[str, tuple[int, int]] = {}

    def unquantized(self) -> list[Linear]:
        """The projections that keep the checkpoint's precision under `--quantization`: none."""
        return []

    def block_inputs(self) -> dict[str, int]:
        """The whole model's widths of this layer's projections' inputs that quantization needs in whole
        blocks, by name (a rank's own part is checked projection by projection): o_proj's, all heads."""
        return {"num_attention_heads * head_dim": self.whole_widths[0]}

    @staticmethod
    def graph_options(num_drafts: int) -> dict:
        """`DecodeGraphs`' options for a model of these layers (motet/engine/worker/cuda_graphs.py): verification
        rows of 1 + `num_drafts` tokens replayed too, every adapter in the graphs."""
        return dict(max_query=1 + num_drafts, eager_targets=())

    def native_unsupported(self) -> str | None:
        """Why the native step's attention op does not take this layer, or None."""
        heads, kv_heads = (width // self.head_dim for width in self.whole_widths)
        if heads % kv_heads or heads // kv_heads > 16 or self.head_dim > 256:
            return (
                f"{heads} heads on {kv_heads} KV heads of {self.head_dim} "
                "(the attention kernel takes up to 16 heads a KV head, of up to 256)"
            )
        return None

    @property
    def o_columns(self) -> tuple[int, int]:
        """This rank's columns of the checkpoint's o_proj: its query heads'."""
        return self.q_rows

    @property
    def options(self) -> AttentionOptions:
        """The layer's attention options, its sinks as they are now (the parameter is made after the layer:
        `CausalLM.allocate`)."""
        return AttentionOptions(self.scale, self.window, self.softcap, self.sinks)

    def _norm_across_ranks(self, qkv: torch.Tensor, q_end: int, k_end: int) -> None:
        """OLMo 2's q and k norms under tensor parallelism, in qkv's own columns: each norm spans all heads and
        this rank holds some, so the sums of squares of its q and of its k columns ([T, 2] fp32) are all-reduced,
        one small exchange a layer; then each rank scales its columns by the whole rows' 1 / rms, in fp32, and by
        its part of the norm weights (as the norm of one rank computes it)."""
        q, k = qkv[:, :q_end].float(), qkv[:, q_end:k_end].float()
        sums = self.parallel.all_reduce(torch.stack([q.square().sum(-1), k.square().sum(-1)], dim=1))
        rstd = torch.rsqrt(sums / sums.new_tensor(self.whole_widths) + self.q_norm.eps)
        qkv[:, :q_end] = (q * rstd[:, :1] * self.q_norm.weight.float()).to(qkv.dtype)
        qkv[:, q_end:k_end] = (k * rstd[:, 1:] * self.k_norm.weight.float()).to(qkv.dtype)


class MLP(nn.Module):
    """act(gate) * up (SwiGLU, GeGLU, ...: config.json's activation) over this rank's intermediate columns; the
    output is a partial sum under tensor parallelism."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int = 0,
        intermediate_size: int | None = None,
        parallel: Parallel = SINGLE,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.columns = parallel.part(intermediate_size or cfg.intermediate_size)  # of the checkpoint's
        self.intermediate = self.columns[1]
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act  # act(gate) * up: SwiGLU, Gemma's GeGLU, ... (activation.GATED)

    def forward(self, x, lora: LoRABatch | None = None):
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            sizes = (self.intermediate, self.intermediate)
            lora.add(gate_up, x, self.layer_idx, GATE_UP, sizes)
        # act(gate) * up; SiLU's in one kernel on CUDA (motet/kernels/activation.py), the torch reference elsewhere
        if self.act == "silu" and activation.applies(gate_up):
            h = activation.silu_and_mul(gate_up)
        else:
            h = activation.act_and_mul_reference(self.act, *gate_up.split(self.intermediate, dim=-1))
        y = self.down_proj(h)
        if lora is not None:
            lora.add(y, h, self.layer_idx, ("down_proj",), (y.shape[1],))
        return y

    def arena_bytes(self, elem: int) -> int:
        """What its native ops pack besides its linear layers: nothing."""
        return 0

    def write_ops(self, ops: OpWriter, i: int, src: str, dst: str = "out", accumulate: bool = False,
                  lora: bool = True) -> None:  # fmt: skip
        """The native step's ops of `forward`: gate/up (+ LoRA) -> the activation -> down (+ LoRA), into `dst`
        (added to it: `accumulate`); `lora`: False for a shared expert, which adapters do not target."""
        inter = self.intermediate
        layer = i if lora else -1
        ops.linear(
            self.gate_up_proj, src, "gu", layer, GATE_UP if lora else None, (inter, inter) if lora else ()
        )
        ops.w.activation("gu", "act", inter, self.act)
        down = (("down_proj",), (self.down_proj.out_features,)) if lora else (None, ())
        ops.linear(self.down_proj, "act", dst, layer, *down, accumulate=accumulate)


def grouped_experts(
    rows: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    act=None,
) -> torch.Tensor:
    """Each row of `rows` through its expert (`expert_ids`) with the stacked weights gate_up [E, 2I, H] and
    down [E, H, I] (and `biases` [E, 2I], [E, H]; `act`(gate, up): SiLU(gate) * up where None), in torch: the
    rows sorted by expert, one gate/up and one down product per expert that has rows (one host sync for the
    counts), the rows' order kept."""
    order = expert_ids.argsort(stable=True)
    counts = torch.bincount(expert_ids, minlength=len(gate_up)).tolist()
    sorted_rows = rows[order]
    out = torch.empty_like(sorted_rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            seg = sorted_rows[start : start + n]
            gate_up_bias, down_bias = (biases[0][e], biases[1][e]) if biases is not None else (None, None)
            gate, up = _expert_product(gate_up[e], seg, gate_up_bias).chunk(2, dim=-1)
            hidden = F.silu(gate) * up if act is None else act(gate, up)
            out[start : start + n] = _expert_product(down[e], hidden, down_bias)
            start += n
    return torch.empty_like(out).index_copy_(0, order, out)


def _expert_product(weight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ bias) for one expert's weight: a float matrix, or a QuantizedWeight (as a quantized Linear
    multiplies it)."""
    if isinstance(weight, QuantizedWeight):
        return quantized_product(weight, x, bias)
    return F.linear(x, weight, bias)


class QuantizedExperts:
    """Stacked experts' weight held in a block format (`--quantization` on a mixture of experts): every expert's
    [N, K] weight one after another as one QuantizedWeight [E * N, K]; `[e]` is expert e's."""

    def __init__(self, weight: QuantizedWeight, num_experts: int):
        self.weight, self.num_experts = weight, num_experts
        self.rows = weight.shape[0] // num_experts

    def __len__(self) -> int:
        return self.num_experts

    def __getitem__(self, e: int) -> QuantizedWeight:
        return self.weight.narrow(0, e * self.rows, self.rows)


def clamped_swiglu(alpha: float, limit: float):
    """GPT-OSS's experts' activation: (up + 1) * gate * sigmoid(alpha * gate), gate clamped to <= limit and up
    to [-limit, limit]."""

    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act


STACKED = ("gate_up_proj", "down_proj")  # the experts' stacked weights


class Experts(nn.Module):
    """The experts of a sparse layer as stacked weights: `gate_up_proj` [E, 2I, H] (each expert's gate rows,
    then its up rows), `down_proj` [E, H, I]; Hugging Face transformers >= 5 holds them the same way.

    Under tensor parallelism each rank holds every expert's share of the intermediate columns (E experts,
    I / size columns); with expert parallelism it holds E / size whole experts instead, and each token's
    rows travel by all-to-all to the ranks that hold its experts and back. Either way the output is a partial
    sum over the ranks (the decoder layer's all-reduce completes it)."""

    def __init__(self, cfg: ModelConfig, parallel: Parallel = SINGLE):
        super().__init__()
        self.parallel = parallel
        E, intermediate, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.columns = (0, intermediate)  # each expert's intermediate columns held here
        if parallel.expert_parallel:
            E = parallel.split(E, "the experts")
        else:
            self.columns = parallel.part(intermediate)
        self.num_local, self.intermediate = E, self.columns[1]
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * self.intermediate, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, self.intermediate), requires_grad=False)
        # `--quantization`: the stacked weights held in a block format instead (their parameters released)
        self.quantized: dict[str, QuantizedExperts] = {}
        self.gate_up_proj_bias = self.down_proj_bias = None  # GPT-OSS's (down's: rank 0's, zeros elsewhere)
        if cfg.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * self.intermediate), requires_grad=False)
            self.down_proj_bias = nn.Parameter(torch.empty(E, H), requires_grad=False)
        # act(gate, up); None: SiLU's (which the Triton kernel fuses)
        self.act = None
        if cfg.expert_act == "swiglu_limit":
            self.act = clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit)
        elif cfg.expert_act != "silu":
            self.act = functools.partial(activation.act_and_mul_reference, cfg.expert_act)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert[expert_ids[t, k]](x[t]) for every token t (this rank's part of it)."""
        if self.parallel.expert_parallel:
            return self._dispatched(x, expert_ids, weights)
        T, k = expert_ids.shape
        out = self.grouped(x.repeat_interleave(k, dim=0), expert_ids.flatten())
        out = out * weights.flatten().unsqueeze(1).to(out.dtype)
        return out.view(T, k, -1).sum(dim=1)

    def grouped(self, rows: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        """Each row through its (local) expert, as a grouped product: the rows are sorted by expert and each
        expert multiplies its contiguous segment at once (one product per expert that has rows, none per row;
        the layout a grouped-GEMM kernel takes). On CUDA the Triton grouped-expert kernel does it in two
        launches for the whole layer (motet/kernels/triton_moe.py)."""
        biases = (self.gate_up_proj_bias, self.down_proj_bias) if self.gate_up_proj_bias is not None else None
        if self.quantized:
            gate_up, down = self.quantized["gate_up_proj"], self.quantized["down_proj"]
            return grouped_experts(rows, expert_ids, gate_up, down, biases, self.act)
        if triton_moe.applies(rows) and biases is None and self.act is None:
            return triton_moe.grouped_experts(rows, expert_ids, self.gate_up_proj, self.down_proj)
        return grouped_experts(rows, expert_ids, self.gate_up_proj, self.down_proj, biases, self.act)

    def _dispatched(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: this rank routes its slice of the (replicated) tokens; their rows go to the
        ranks holding their experts (all-to-all), through the experts there, and back (all-to-all); the
        result holds this rank's token slice, zeros elsewhere."""
        par, E = self.parallel, self.num_local
        t0, t1 = par.token_slice(x.shape[0])
        k = expert_ids.shape[1]
        flat = expert_ids[t0:t1].flatten()
        order = flat.argsort(stable=True)  # by expert, hence by the rank that holds it
        owners = flat[order] // E
        send = torch.bincount(owners, minlength=par.size)
        recv = par.exchange_counts(send)
        # each row travels with its expert's local index as one more column (exact in fp32: < 2^24)
        rows = x[t0:t1][order // k].float()
        payload = torch.cat([rows, (flat[order] % E).unsqueeze(1).float()], dim=1)
        arrived = par.all_to_all(payload, send.tolist(), recv)
        done = self.grouped(arrived[:, :-1].to(x.dtype), arrived[:, -1].long())
        back = par.all_to_all(done.float(), recv, send.tolist())
        back = back * weights[t0:t1].flatten()[order].unsqueeze(1)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        y[t0:t1].index_add_(0, order // k, back)
        return y.to(x.dtype)


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek): the router (`gate`) scores every
    expert, each token goes through its `num_experts_per_tok` best (softmax weights, renormalized to sum to 1
    where the config says; DeepSeek's scoring and group-limited choice: `Router`), and, in Qwen2-MoE, through a
    shared expert scaled by sigmoid(shared_expert_gate(x)) (DeepSeek's shared experts: ungated). The router
    and the shared expert's gate are replicated on every rank; the output is a partial sum over them.

    LoRA applies to the attention only: an adapter targeting MLP modules is refused on an MoE model
    (motet/lora/adapter.py), so `lora` is not read here."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, parallel: Parallel = SINGLE):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Router(cfg)  # (DeepSeek's routing options: motet/engine/worker/routing.py)
        self.experts = Experts(cfg, parallel)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, layer_idx, cfg.shared_expert_intermediate_size, parallel)
            if cfg.shared_expert_gate:
                self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x, lora: LoRABatch | None = None):
        weights, expert_ids = self.gate.route(x)
        y = self.experts(x, expert_ids, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = self.shared_expert_gate
            y = y + (shared if gate is None else torch.sigmoid(gate(x)) * shared)
        return y

    def arena_bytes(self, elem: int) -> int:
        """What its native ops pack besides the decoder's linear layers: the router, the shared expert's gate, and
        every expert's weights (each as a linear layer's, one after another)."""
        total = packed_bytes(self.gate, elem) + 64
        if self.shared_expert_gate is not None:
            total += packed_bytes(self.shared_expert_gate, elem) + 64
        experts = self.experts
        for key in STACKED:
            if key in experts.quantized:
                q = experts.quantized[key]
                total += len(q) * panel_bytes(q.rows, q.weight.shape[1], elem, q.weight.format.name) + 64
            else:
                E, N, K = getattr(experts, key).shape
                total += E * panel_bytes(N, K, elem) + 64
        return total

    def write_ops(self, ops: OpWriter, i: int, src: str) -> None:
        """The native step's ops of `forward`: the router (+ bias) -> the experts (their biases and activation)
        into "out", + the shared expert scaled by its sigmoid gate. No LoRA (see the class)."""
        experts, cfg, wdtype = self.experts, ops.config, ops.weight_dtype
        E, inter, hidden = experts.num_local, experts.intermediate, cfg.hidden_size
        ops.linear(self.gate, src, "router")

        def stacked(key: str) -> int:
            """Every expert's weight packed, one after another in the arena (the grouped GEMM's layout)."""
            q, stack = experts.quantized.get(key), getattr(experts, key).detach()

            def pack() -> torch.Tensor:
                if q is not None:
                    return torch.cat([cpu_native.pack_quantized(q[e]) for e in range(len(q))])
                return torch.cat([cpu_native.pack(x) for x in stack])

            return ops.arena.put(pack).data_ptr()

        quantized = experts.quantized.get("gate_up_proj")
        code, bias_dtype = cpu_native.DTYPE_CODES[wdtype], wdtype
        if quantized is not None:  # (both stacked weights in one format: --quantization)
            code, bias_dtype = cpu_native.QUANT_CODES[quantized.weight.format.name], torch.float32
        gate_up, down = stacked("gate_up_proj"), stacked("down_proj")
        gate_up_bias = ops.ptr(experts.gate_up_proj_bias, bias_dtype)
        down_bias = ops.ptr(experts.down_proj_bias, bias_dtype)
        router = self.gate
        routing = None
        if not router.plain:  # DeepSeek's
            bias = ops.ptr(router.e_score_correction_bias, torch.float32)
            routing = cpu_native.RouteOptions(
                router.sigmoid, router.groups, router.groups_kept, bias, router.scale
            )
        ops.w.moe(src, "router", "out", E, self.top_k, inter, hidden, self.norm_topk_prob, cfg.expert_act,
                  gate_up, down, gate_up_bias, down_bias, cfg.swiglu_alpha, cfg.swiglu_limit, code,
                  routing)  # fmt: skip
        empty = nn.Parameter(torch.empty(0, dtype=wdtype), requires_grad=False)
        experts.gate_up_proj, experts.down_proj, experts.quantized = empty, empty, {}
        if self.shared_expert is not None:
            gate = self.shared_expert_gate
            if gate is not None:
                ops.linear(gate, src, "gate")
            if gate is None:  # DeepSeek's shared experts: added as they are
                self.shared_expert.write_ops(ops, i, src, "out", accumulate=True, lora=False)
            else:
                self.shared_expert.write_ops(ops, i, src, "shared", lora=False)
                # scaled after its down, as transformers does
                ops.w.gated_add("shared", "out", hidden, "gate")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, parallel: Parallel = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.pre_norms, self.post_norms = cfg.pre_norms, cfg.post_norms
        # Llama's norms come before the blocks (post_attention_layernorm: the one before the MLP), OLMo 2's after
        # them (attn_out_norm, mlp_out_norm), Gemma's both
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        self.input_layernorm = norm() if cfg.pre_norms else None
        self.self_attn: Attention = layer_class(cfg.attention.layer)(cfg, layer_idx, parallel)
        self.post_attention_layernorm = norm() if cfg.pre_norms else None
        if cfg.post_norms:
            self.attn_out_norm, self.mlp_out_norm = norm(), norm()
        self.mlp: MLP | SparseMoE = (
            SparseMoE(cfg, layer_idx, parallel)
            if layer_idx in cfg.sparse_layers
            else MLP(cfg, layer_idx, parallel=parallel)
        )

    def forward(self, x, residual, angles: RotaryAngles, meta, kv_cache, lora: LoRABatch | None = None):
        """`x`: the previous layer's output, `residual`: the stream it adds to (None in the first layer, whose
        `x` is the embeddings). Returns this layer's MLP output and the stream before it: the next norm adds
        them (fused with the norm on CUDA; vLLM carries the residual the same way)."""
        if self.pre_norms:
            h, residual = (
                (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
            )
        else:  # the block reads the stream as it is
            residual = x if residual is None else x + residual
            h = residual
        # each block's output is a partial sum over the tensor-parallel ranks: one all-reduce completes it
        # before it joins the stream
        a = self.parallel.all_reduce(self.self_attn(h, angles, meta, kv_cache, lora))
        if self.post_norms:
            a = self.attn_out_norm(a)
        if self.pre_norms:
            h, residual = self.post_attention_layernorm(a, residual)
        else:
            residual = residual + a
            h = residual
        m = self.parallel.all_reduce(self.mlp(h, lora))
        return (self.mlp_out_norm(m) if self.post_norms else m), residual

    def write_ops(self, ops: OpWriter, i: int, kv) -> None:
        """Layer `i`'s ops in the native step, as `forward` runs it: each block reads the stream ("x") normed by
        the norm before it (or the stream itself) and joins it in one op (the all-reduce, the norm after the
        block, the add)."""
        self.self_attn.write_ops(ops, i, ops.norm(self.input_layernorm), kv)
        ops.joins(self.attn_out_norm if self.post_norms else None)
        self.mlp.write_ops(ops, i, ops.norm(self.post_attention_layernorm))
        ops.joins(self.mlp_out_norm if self.post_norms else None)


class CausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int | None = None,
        parallel: Parallel = SINGLE,
        ropes: tuple[RotaryEmbedding, RotaryEmbedding | None] | None = None,
    ):
        """`parallel`: this rank's shard of the model (motet/engine/worker/parallel.py); by default the whole model.
        `ropes`: the rotary tables (`rope`, `local_rope`) where they were made (`on_meta`), else made here."""
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.vocab_start, vocab_rows, _ = parallel.vocab_rows(cfg.vocab_size)
        # (its table given, not drawn: the model is made on the meta device (`on_meta`), whose normal_ imports
        # torch._dynamo, seconds of every start, for values no one reads: `allocate` or a prepared-weights entry
        # puts the checkpoint's table in its place)
        self.embed_tokens = nn.Embedding(
            vocab_rows, cfg.hidden_size, _weight=torch.empty(vocab_rows, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, parallel) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, vocab_rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Gemma 3's sliding-window layers rotate with their own base (and no scaling): `local_rope`
        self.rope, self.local_rope = ropes or self.make_ropes(cfg, max_positions)

    @classmethod
    def make_ropes(
        cls, cfg: ModelConfig, max_positions: int | None
    ) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        return RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings), cls._local_rope(
            cfg, max_positions
        )

    @staticmethod
    def _local_rope(cfg: ModelConfig, max_positions: int | None) -> RotaryEmbedding | None:
        if not cfg.sliding_layers or cfg.rope_local_theta is None:
            return None
        local = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None)
        return RotaryEmbedding(local, max_positions or cfg.max_position_embeddings)

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        max_positions: int | None,
        parallel: Parallel,
        device: torch.device,
        dtype: torch.dtype,
        quantized: bool = False,
    ) -> CausalLM:
        """The model for `load_weights` (motet/engine/worker/decoder_weights.py) to fill, made in `dtype` on
        `device` (the rotary tables in fp32), its parameters uninitialized: no copy in another dtype is ever
        made. With `quantized` (a quantized checkpoint, or one quantized as it loads) the projections' weights
        (and an untied lm_head's) are made only when `load_weights` copies floats into them: one that loads
        quantized never has a float copy."""
        model = cls.on_meta(cfg, max_positions, parallel, device)
        deferred = (
            {id(lin.weight) for lin in [*model.decoder_linears(), model.lm_head]} if quantized else set()
        )
        if quantized:  # the experts' stacked weights too
            deferred.update(
                id(getattr(e, k)) for e in model.modules() if isinstance(e, Experts) for k in STACKED
            )
        deferred.discard(id(model.embed_tokens.weight))  # a tied lm_head is the embedding table
        made: dict[int, nn.Parameter] = {}  # (a tied parameter is made once)
        for module in model.modules():
            if module is model.rope or module is model.local_rope:
                continue
            for key, p in module._parameters.items():
                if p is not None and id(p) not in deferred:
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), False)
                    module._parameters[key] = made[id(p)]
        return model

    @classmethod
    def on_meta(
        cls, cfg: ModelConfig, max_positions: int | None, parallel: Parallel, device: torch.device
    ) -> CausalLM:
        """The model with every parameter on the meta device (shapes, no memory) and its rotary tables made on
        `device`: `allocate` makes its parameters, a prepared-weights cache entry maps them from its file
        (motet/engine/worker/prepared_weights.py)."""
        # The rotary tables are made once, off the meta device (whose arange and normal_ import torch._dynamo:
        # seconds of every start).
        rope, local = cls.make_ropes(cfg, max_positions)
        ropes = (rope.to(device), local.to(device) if local is not None else None)
        with torch.device("meta"):
            return cls(cfg, max_positions, parallel, ropes)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the model was made in (its float weights', whatever format its projections or table hold)."""
        return self.norm.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings [T, hidden]; under tensor parallelism each rank looks up the tokens in its
        vocabulary rows (zeros for the others) and an all-reduce assembles them."""
        if not self.parallel.enabled:
            return self.embed_tokens(input_ids)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(local.clamp(0, self.embed_tokens.num_embeddings - 1))
        dtype = x.dtype
        x = self.parallel.all_reduce(torch.where(mine.unsqueeze(1), x.float(), 0.0))
        return x.to(dtype)

    def embed_input(
        self, input_ids: torch.Tensor, lora: LoRABatch | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The first layer's input: the tokens' embeddings (in `dtype`), their adapters' embedding deltas, times
        the family's embedding multiplier (Granite's)."""
        x = self.embed(input_ids)
        if dtype is not None:
            x = x.to(dtype)
        if lora is not None:
            lora.add_embedding(x, input_ids)
        scale = self.config.embedding_multiplier
        return x if scale == 1.0 else x * scale

    def forward(
        self, input_ids, positions, meta: AttentionMetadata, kv_caches, lora: LoRABatch | None = None
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; `compute_logits` maps chosen rows to logits."""
        x, residual = self.embed_input(input_ids, lora), None
        angles = self.rope(positions)
        local = self.local_rope(positions) if self.local_rope is not None else angles
        sliding = self.config.sliding_layers
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(x, residual, local if i in sliding else angles, meta, kv_cache, lora)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits of `hidden`'s rows, before soft-capping (`cap_logits`, after the adapters' head deltas);
        under tensor parallelism each rank's vocabulary columns are gathered on rank 0 (the others get None)."""
        return self.parallel.gather_columns(self.lm_head(hidden).float(), self.config.vocab_size)

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final soft-capping, in place: cap * tanh(logits / cap) (the logits as they are elsewhere)."""
        cap = self.config.logit_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def decoder_linears(self) -> list[Linear]:
        """The projections of every decoder layer (qkv, o, gate_up, down per layer, in that order; a latent
        attention's own in place of qkv and o; a sparse
        layer's MLP projections are its shared expert's, where it has one: its experts are stacked
        weights, not linear layers)."""
        linears = []
        for layer in self.layers:
            linears += layer.self_attn.projections()
            mlp = layer.mlp.shared_expert if isinstance(layer.mlp, SparseMoE) else layer.mlp
            if mlp is not None:
                linears += [mlp.gate_up_proj, mlp.down_proj]
        return linears
