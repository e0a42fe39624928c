"""The Llama-family decoder (Llama, Mistral, Qwen2, SmolLM, and the mixture-of-experts Mixtral, Qwen2-MoE and
Qwen3-MoE, whose sparse layers route each token to its top-k experts: `SparseMoE`) over a flattened batch and a
paged KV cache.

Tokens of many sequences are concatenated (no padding); `AttentionMetadata` says where each sequence's
queries are and which cache blocks hold its keys. q/k/v and gate/up projections are fused into one
matrix each (fewer, larger matmuls); checkpoints with Hugging Face names load through `load_weights`.
With a `LoRABatch` each linear layer also adds every token's own adapter delta (fused layers per module,
into that module's output columns); without one the LoRA path is skipped entirely. A linear layer may hold
its weight quantized (motet/kernels/quant.py, `LlamaForCausalLM.quantize`): every backend (this eager
model, CUDA graphs over it, the native CPU step) takes the format from the layer; LoRA deltas stay in the
model's dtype on top.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from motet.engine.config import ModelConfig, ModelLoadError
from motet.kernels import triton_quant
from motet.kernels.paged_attention import paged_attention, write_kv_cache
from motet.kernels.paged_attention_cpu import CpuAttentionPlan, plan_cpu_attention
from motet.kernels.quant import BLOCK, INT8, QuantizedWeight, WeightFormat
from motet.lora.slot_cache import LoRABatch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    max_seq_len: int
    cpu_plan: CpuAttentionPlan | None = None  # made by the first layer, reused by the others


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
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
    return inv_freq


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """nn.Linear whose CPU product can run through oneDNN on a prepacked weight.

    On CPU `F.linear` goes to MKL. On this machine (AMD EPYC, AVX-512) oneDNN with a prepacked weight
    measured 2.6-3.2x faster for fp32 at 32-64 rows, 1.3-3x at one row, and 1.2-2x for bf16 (vLLM's
    CPU backend uses oneDNN too). The CPU runner calls `prepack()`; the plain weight stays for tied
    embeddings, LoRA and checkpoints.

    A quantized layer holds its weight in `quantized` (its float `weight` released) and multiplies through
    the Triton W8A16 / W4A16 kernel on CUDA (motet/kernels/triton_quant.py), elsewhere through the format's
    reference product (`QuantizedWeight.linear`); the native CPU step packs the same weight for its
    quantized kernels."""

    packed_weight: torch.Tensor | None = None
    quantized: QuantizedWeight | None = None

    def quantize(self, fmt: WeightFormat) -> None:
        """Hold the weight in `fmt` from now on (quantized from its current values, on its device)."""
        self.quantized = fmt.quantize(self.weight.detach())
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device), False)
        self.packed_weight = None

    def prepack(self, rows_hint: int = 64) -> bool:
        """Pack the weight for oneDNN; False (F.linear stays) where oneDNN cannot run this dtype on this
        CPU (its bf16 path needs AVX-512 or AVX-NE-CONVERT), or the weight is quantized."""
        if self.quantized is not None:
            return False
        # a plain attribute, made after .to(device/dtype); the hint only tunes the layout (64 >= 1, 32)
        try:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows_hint)
        except RuntimeError:
            self.packed_weight = None
        return self.packed_weight is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            if triton_quant.applies(x):  # CUDA: the W8A16 / W4A16 Triton GEMM on the stored blocks
                return triton_quant.quant_linear(x, self.quantized, self.bias)
            return self.quantized.linear(x, self.bias)
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), rope_inv_freq(cfg))
        self.register_buffer("cos", freqs.cos().float(), persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] of each token's position: looked up once a step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """`x` [T, heads, head_dim] rotated; Hugging Face layout: the two rotated halves are the first
        and second half of head_dim."""
        cos, sin = cos_sin
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        # Qwen3: each head's q and k RMS-normalized over head_dim before the rotary
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos_sin, meta: AttentionMetadata, kv_cache, lora: LoRABatch | None = None):
        T = x.shape[0]
        sizes = (self.q_size, self.kv_size, self.kv_size)
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.add(qkv, x, self.layer_idx, ("q_proj", "k_proj", "v_proj"), sizes)
        # q and k are adjacent columns of qkv: rotated in one go
        qk = qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = RotaryEmbedding.rotate(qk, cos_sin).split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.cpu_plan is None and not q.is_cuda:
            meta.cpu_plan = plan_cpu_attention(
                meta.block_tables, meta.query_start_loc, meta.seq_lens, k_cache.shape[1]
            )
        out = paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            plan=meta.cpu_plan,
        )
        out = out.reshape(T, self.q_size)
        y = self.o_proj(out)
        if lora is not None:
            lora.add(y, out, self.layer_idx, ("o_proj",), (y.shape[1],))
        return y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0, intermediate_size: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, bias=False)

    def forward(self, x, lora: LoRABatch | None = None):
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            sizes = (self.intermediate, self.intermediate)
            lora.add(gate_up, x, self.layer_idx, ("gate_proj", "up_proj"), sizes)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        h = F.silu(gate) * up
        y = self.down_proj(h)
        if lora is not None:
            lora.add(y, h, self.layer_idx, ("down_proj",), (y.shape[1],))
        return y


class Experts(nn.Module):
    """The experts of a sparse layer as stacked weights: `gate_up_proj` [E, 2I, H] (each expert's gate rows,
    then its up rows), `down_proj` [E, H, I]; Hugging Face transformers >= 5 holds them the same way."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, intermediate, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * intermediate, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, intermediate), requires_grad=False)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert[expert_ids[t, k]](x[t]) for every token t, as a grouped product: the
        (token, choice) rows are sorted by expert and each expert multiplies its contiguous segment at once
        (one product per expert that has rows, none per token; the layout a grouped-GEMM kernel takes)."""
        T, k = expert_ids.shape
        flat = expert_ids.flatten()
        order = flat.argsort(stable=True)
        tokens = order // k  # the token of each sorted row
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()  # one sync a layer
        rows = x[tokens]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                seg = rows[start : start + n]
                gate, up = F.linear(seg, self.gate_up_proj[e]).split(self.intermediate, dim=-1)
                out[start : start + n] = F.linear(F.silu(gate) * up, self.down_proj[e])
                start += n
        out = out * weights.flatten()[order].unsqueeze(1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, out)


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): the router (`gate`) scores every expert, each
    token goes through its `num_experts_per_tok` best (softmax weights, renormalized to sum to 1 where the
    config says), and, in Qwen2-MoE, through a shared expert scaled by sigmoid(shared_expert_gate(x)).

    LoRA applies to the attention only: an adapter targeting MLP modules is refused on an MoE model
    (motet/lora/adapter.py), so `lora` is not read here."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, layer_idx, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x, lora: LoRABatch | None = None):
        probs = self.gate(x).float().softmax(dim=-1)
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        y = self.experts(x, expert_ids, weights)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(cfg, layer_idx) if layer_idx in cfg.sparse_layers else MLP(cfg, layer_idx)
        )

    def forward(self, x, cos_sin, meta, kv_cache, lora: LoRABatch | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)


class LlamaForCausalLM(nn.Module):
    # Hugging Face module name -> (our fused module, shard index within it)
    FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)

    def forward(
        self, input_ids, positions, meta: AttentionMetadata, kv_caches, lora: LoRABatch | None = None
    ) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; `compute_logits` maps chosen rows to logits."""
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos_sin, meta, kv_cache, lora)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def decoder_linears(self) -> list[Linear]:
        """The projections of every decoder layer (qkv, o, gate_up, down per layer, in that order; a sparse
        layer's MLP projections are its shared expert's, where it has one: its experts are stacked
        weights, not linear layers)."""
        linears = []
        for layer in self.layers:
            linears += [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
            mlp = layer.mlp.shared_expert if isinstance(layer.mlp, SparseMoE) else layer.mlp
            if mlp is not None:
                linears += [mlp.gate_up_proj, mlp.down_proj]
        return linears

    @torch.no_grad()
    def quantize(self, fmt: WeightFormat) -> None:
        """Quantize the decoder's projections into `fmt` and the lm_head into int8 (once the weights are
        loaded). The embedding table keeps the checkpoint's precision (a lookup reads one row a token); the
        lm_head is a product over the whole vocabulary, a fifth of a small model's bytes per token, so it
        is quantized too but at 8 bits, where the logits' rounding stays small: llama.cpp's 4-bit files
        keep it in Q8_0 (or Q6_K) the same way."""
        cfg = self.config
        if cfg.is_moe:
            raise ModelLoadError(
                f"{fmt.name} quantization of a mixture-of-experts model ({cfg.architecture}) is not supported "
                f"yet: serve it unquantized (leave --quantization out)"
            )
        dims = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size}
        dims["num_attention_heads * head_dim"] = cfg.num_attention_heads * cfg.head_dim
        for name, value in dims.items():
            if value % BLOCK:
                raise ModelLoadError(
                    f"{fmt.name} quantization needs the inputs of every projection in whole blocks of {BLOCK}; "
                    f"this model's {name} is {value}: serve it unquantized"
                )
        for lin in self.decoder_linears():
            lin.quantize(fmt)
        if cfg.hidden_size % BLOCK == 0:
            self.lm_head.quantize(INT8)

    def _split_sizes(self, name: str) -> list[int]:
        """Row sizes of a fused parameter's shards ([n] for an unfused one); `name` is the parameter's."""
        cfg = self.config
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else name
        if module == "qkv_proj":
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
        if module == "gate_up_proj":  # a dense MLP's or the shared expert's: its own intermediate size
            layer = self.get_submodule(".".join(parts[:-2]))
            return [layer.intermediate, layer.intermediate]
        if parts[-1] == "gate_up_proj":  # stacked experts: shard 2e is expert e's gate, 2e + 1 its up
            return [cfg.moe_intermediate_size] * (2 * cfg.num_experts)
        if parts[-1] == "down_proj":  # stacked experts: shard e is expert e's
            return [cfg.hidden_size] * cfg.num_experts
        return [-1]

    def _shard(self, param: torch.Tensor, name: str, shard: int | None) -> torch.Tensor:
        """The part of `param` that a checkpoint tensor fills (None: all of it)."""
        sizes = self._split_sizes(name)
        if shard is None or len(sizes) == 1:
            return param
        if param.dim() == 3:  # stacked experts: shard -> (expert, part within the expert's rows)
            per_expert = len(sizes) // param.shape[0]
            expert, part = divmod(shard, per_expert)
            return param[expert].narrow(0, part * sizes[shard], sizes[shard])
        return param.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _all_shards(self, name: str) -> range:
        return range(len(self._split_sizes(name)))

    def _describe(self, name: str, shard: int) -> str:
        """A shard's name in an error message: a stacked expert weight's says which expert's projection."""
        if name.split(".")[-1] not in ("gate_up_proj", "down_proj"):
            return f"{name}[{shard}]"
        if name.endswith("gate_up_proj"):
            expert, part = divmod(shard, 2)
            return f"{name}[{shard}] (expert {expert}'s {('gate_proj / w1', 'up_proj / w3')[part]})"
        return f"{name}[{shard}] (expert {shard}'s down_proj / w2)"

    # An expert's projection in a checkpoint -> (the stacked parameter, its part in the expert's rows):
    # Mixtral's w1/w3/w2, Qwen2-MoE's gate_proj/up_proj/down_proj
    EXPERT_PROJECTIONS = {
        "w1": ("gate_up_proj", 0),
        "gate_proj": ("gate_up_proj", 0),
        "w3": ("gate_up_proj", 1),
        "up_proj": ("gate_up_proj", 1),
        "w2": ("down_proj", 0),
        "down_proj": ("down_proj", 0),
    }

    def _place(self, hf_name: str) -> tuple[str, int | None] | None:
        """(parameter name, shard) a Hugging Face tensor name fills (shard None: the whole parameter), or
        None where it has no place in this model."""
        parts = hf_name.removeprefix("model.").split(".")
        if len(parts) > 2 and parts[0] == "layers" and parts[2] == "block_sparse_moe":  # Mixtral's name
            parts[2] = "mlp"
        # layers.{i}.mlp.experts.{e}.{projection}.weight: one expert's slice of the stacked weights
        if len(parts) == 7 and parts[3] == "experts" and parts[4].isdigit() and parts[6] == "weight":
            stacked, part = self.EXPERT_PROJECTIONS.get(parts[5], (None, 0))
            expert = int(parts[4])
            if stacked is None or expert >= self.config.num_experts:
                return None
            name = ".".join([*parts[:4], stacked])
            return name, expert * (2 if stacked == "gate_up_proj" else 1) + part
        if len(parts) == 1:
            return hf_name, None
        module, shard = self.FUSED.get(parts[-2], (parts[-2], None))
        parts[-2] = module
        return ".".join(parts), shard

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up; every parameter must be filled. A
        projection may come quantized (a GGUF file's blocks): its layer then holds it in that format (a
        fused layer's shards all in one format)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[tuple[str, int]] = set()
        quantized: dict[str, dict[int, QuantizedWeight]] = {}  # weight name -> its shards, until all are in
        linears = set(self.decoder_linears())
        projections = {f"{n}.weight": m for n, m in self.named_modules() if m in linears}
        for hf_name, tensor in weights:
            if "rotary_emb" in hf_name:
                continue
            place = self._place(hf_name)
            param = params.get(place[0]) if place is not None else None
            if param is None:
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} has no place in {self.config.architecture}"
                )
            name, shard = place
            target = self._shard(param, name, shard)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(target.shape)}"
                )
            if isinstance(tensor, QuantizedWeight) and name in ("embed_tokens.weight", "lm_head.weight"):
                # a quantized output (or tied table): the lm_head multiplies in its blocks, the embedding
                # table holds their values (a lookup)
                if name == "embed_tokens.weight":
                    self.embed_tokens.weight.copy_(tensor.dequantize())
                if name == "lm_head.weight" or self.lm_head.weight is self.embed_tokens.weight:
                    self.lm_head.quantized = tensor.to(param.device)
                    self.lm_head.weight = nn.Parameter(torch.empty(0, device=param.device), False)
                    loaded.add(("lm_head.weight", 0))
            elif isinstance(tensor, QuantizedWeight):
                if name not in projections:
                    raise ModelLoadError(
                        f"checkpoint tensor {hf_name!r} is quantized: only projections and the lm_head may be"
                    )
                if shard is None and len(self._split_sizes(name)) > 1:
                    raise ModelLoadError(
                        f"checkpoint tensor {hf_name!r} is quantized: a fused projection's parts must come "
                        f"one by one"
                    )
                quantized.setdefault(name, {})[shard or 0] = tensor.to(param.device)
            else:
                target.copy_(tensor)
            loaded.update((name, i) for i in ((shard,) if shard is not None else self._all_shards(name)))
        for name, shards in quantized.items():
            n = len(self._split_sizes(name))
            if len({q.format for q in shards.values()}) > 1 or any(
                (name, i) in loaded and i not in shards for i in range(n)
            ):
                raise ModelLoadError(f"checkpoint tensors of {name}: its parts must all be in one format")
            if len(shards) == n:  # else the missing parts are reported below
                layer = projections[name]
                layer.quantized = QuantizedWeight.cat([shards[i] for i in range(n)])
                layer.weight = nn.Parameter(torch.empty(0, device=layer.weight.device), False)
        # Every parameter, every shard of a fused one, must come from the checkpoint.
        expected = {(name, i) for name, _ in self.named_parameters() for i in self._all_shards(name)}
        missing = sorted(self._describe(name, i) for name, i in expected - loaded)
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensors: {', '.join(missing[:5])}")
