"""What a model architecture is to motet: a short declaration of how its checkpoint maps onto the one decoder
every backend runs (motet/engine/worker/model.py: embedding, layers of attention and MLP or experts between RMS norms,
a final norm and the head). A declaration names the Hugging Face architectures it serves, the options its
layers use, how its config.json's own fields read, and the module names its checkpoints use where they differ
from the decoder's. The engine, the loaders and the kernels ask the declaration; none of them tests an
architecture's name (tests/models/test_model_declarations.py)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from motet.models.attention import AttentionShape


class ModelLoadError(ValueError):
    """A model that cannot be served; the message names the file or field to fix."""


@dataclass(frozen=True)
class Architecture:
    # The config.json `architectures` names this declaration serves (the first: the one motet writes, e.g. for
    # a GGUF file's config).
    names: tuple[str, ...]
    # The attention's declaration (motet/models/attention.py: the per-head attention, or a variant that overrides
    # it), read where a GGUF file is read before its config (its tensor names, joins and bias).
    attention: type[AttentionShape] = AttentionShape
    # Attention: q/k/v biases where config.json does not say (attention_bias / qkv_bias), and each head's q and k
    # RMS-normalized over head_dim before the rotary (Qwen3).
    qkv_bias: bool = False
    qk_norm: bool = False
    # OLMo 2: the q and k norms span all heads (q_norm over num_heads x head_dim) rather than each head, and each
    # block's output is normed before it joins the residual stream, with no norm before the block.
    qk_norm_whole: bool = False
    post_norms: bool = False
    # Gemma: norms before the blocks too (sandwich norms, with post_norms), norm weights stored as an offset
    # from 1 (RMSNorm multiplies by 1 + w).
    pre_norms: bool = True
    norm_weight_offset: float = 0.0
    # The config.json field that names the MLP's (and the experts') activation, by transformers' ACT2FN names,
    # and its value where config.json does not say (transformers' config class's default): Gemma's
    # hidden_activation. None: the family's transformers model reads none (GPT-OSS's experts' own SwiGLU).
    activation: tuple[str, str] | None = ("hidden_act", "silu")
    # A mixture of experts: (config.json, number of layers, source) -> the ModelConfig's expert fields
    # (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
    # shared_expert_intermediate_size, sparse_layers). None: every layer's MLP is dense.
    experts: Callable[[dict, int, str], dict] | None = None
    # The family's own config.json fields: (config.json, source) -> more ModelConfig fields (Granite's
    # multipliers). None: none.
    options: Callable[[dict, str], dict] | None = None
    # Checkpoint module names -> the decoder's (a name part of `model.layers.{i}...` is renamed as it is read).
    checkpoint_names: dict[str, str] = field(default_factory=dict)
    # A checkpoint module that holds several of the decoder's projections, their rows one after the other
    # (Phi-3's qkv_proj: q_proj, k_proj, v_proj): split as it is read, and a LoRA adapter's factors with it.
    fused_modules: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # How its checkpoints stack experts: "decoder" (the decoder's [E, 2I, H] gate rows then up rows, and
    # [E, H, I], or one tensor an expert's projection) or "interleaved" (GPT-OSS's [E, H, 2I] with gate and up
    # columns alternating, and [E, I, H]): converted as they load.
    expert_layout: str = "decoder"
    # Checkpoints that hold more layers than the decoder runs, after its own (DeepSeek-V3's multi-token-prediction
    # layers, `model.layers.{num_hidden_layers}...`): their tensors are not read, as transformers skips them.
    skips_trailing_layers: bool = False
    # The `general.architecture` of the GGUF files llama.cpp's converter writes for it (None: not read from GGUF),
    # the prefix of its hyperparameters' keys, and whether that converter interleaved q/k rows for its rotary
    # (llama's `permute`; Qwen's files keep Hugging Face's order).
    gguf: str | None = None
    gguf_permuted_qk: bool = False
    # The GGUF block tensors whose Hugging Face module is not Llama's (attn_norm -> input_layernorm, ffn_norm ->
    # post_attention_layernorm, ...): Gemma's and OLMo 2's post-norms, Phi-3's fused attn_qkv / ffn_up. A norm
    # weight is stored as llama.cpp multiplies by it: with `norm_weight_offset` added (Gemma's 1 + w).
    gguf_names: dict[str, str] = field(default_factory=dict)
    # The family's own config.json fields from its GGUF keys: (key -> value, by the key's name after the
    # architecture's prefix, e.g. "attention.sliding_window", or the default given; the config read so far;
    # source; the file's tensor names) -> fields added to or replacing the config's (model_type where it is not
    # the GGUF architecture).
    gguf_config: Callable[[Callable[..., object], dict, str, Collection[str]], dict] | None = None
    # How the family writes tool calls and reasoning, by vLLM's --tool-call-parser and --reasoning-parser names
    # (motet/grammar/tool_formats/, motet/grammar/reasoning.py), where every checkpoint of the architecture
    # writes the same: `motet serve` picks them with no flag (a flag wins). None: the chat template's markers say.
    tool_format: str | None = None
    reasoning_format: str | None = None

    @property
    def name(self) -> str:
        return self.names[0]
