"""A model's configuration as the decoder reads it: a Hugging Face config.json through its family's declaration
(motet/models/), every field checked (type, finiteness, range, consistency) and named in one line when wrong."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from motet.models import SUPPORTED_ARCHITECTURES, find
from motet.models import get as get_declaration
from motet.models.attention import PER_HEAD, AttentionShape, CacheLayout
from motet.models.declaration import Architecture, ModelLoadError
from motet.models.fields import (
    LIMITS,
    bounded,
    bounded_number,
    flag,
    hidden_act,
    refuse_what_is_not_computed,
    sliding_window,
)
from motet.models.projections import projection_shapes
from motet.models.rope_config import checked_rope_scaling


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs of a Hugging Face config.json, read through its family's declaration (motet/models/)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3: each head's q and k RMS-normalized (over head_dim) before the rotary
    qk_norm_whole: bool = False  # OLMo 2: those norms over all heads of q (of k) at once
    post_norms: bool = False  # OLMo 2, Gemma: each block's output normed before the residual add
    pre_norms: bool = True  # a norm before each block (all but OLMo 2)
    # Gemma: a norm multiplies by offset + w (the offset added to the weights as they load)
    norm_weight_offset: float = 0.0
    # the MLP's act(gate) * up, by motet's name (models/fields.py HIDDEN_ACTS): "silu" (SwiGLU), "gelu_tanh"
    # (Gemma's GeGLU), "gelu", "relu", "relu2"
    hidden_act: str = "silu"
    # Sliding-window attention: a query attends to the last `sliding_window` positions only, in every layer
    # (Mistral's) or in `sliding_layers` (Gemma 3's local layers, with their own rope base apart from the global
    # layers' rope_theta and rope_scaling)
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    sliding_window: int | None = None
    # Gemma 2's soft-capping: attention scores (scaled) and the final logits squashed by cap * tanh(x / cap)
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    # GPT-OSS: a bias on o_proj too, each head's sink logit in its attention softmax, biases on the router and the
    # experts, and the experts' clamped SwiGLU ("swiglu_limit": gate clamped to <= limit, up to +-limit,
    # (up + 1) * gate * sigmoid(alpha * gate)); the other families' experts compute the MLP's hidden_act
    output_bias: bool = False
    attention_sinks: bool = False
    expert_bias: bool = False
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the layers in `sparse_layers` replace their MLP by
    # `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` chosen per token by a router's
    # softmax (the chosen weights renormalized to sum to 1 when `norm_topk_prob`), plus, where
    # `shared_expert_intermediate_size` is set, a shared expert every token passes through, scaled by a
    # sigmoid gate (Qwen2-MoE). 0 experts: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[int, ...] = ()
    # How the router turns its logits into the experts' weights (DeepSeek's options; the defaults: a softmax over
    # all experts, top-k of it): `router_scoring` "softmax" or "sigmoid" (V3: each expert's own sigmoid);
    # `router_score_bias` (V3's e_score_correction_bias): a per-expert bias added to the scores for choosing
    # only (the weights stay the unbiased scores); group-limited top-k: the experts in `expert_groups` equal
    # groups, each scored by its best expert (with the bias: its best two's sum), the top-k drawn from the
    # `expert_groups_kept` best groups only; the chosen weights (renormalized where `norm_topk_prob`) times
    # `routed_scaling_factor`. `shared_expert_gate`: Qwen2-MoE's shared expert is scaled by a sigmoid gate,
    # DeepSeek's shared experts are not.
    router_scoring: str = "softmax"
    router_score_bias: bool = False
    expert_groups: int = 1
    expert_groups_kept: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True
    # The attention's declaration (motet/models/attention.py): the per-head attention's, or one a family declares
    # in its place (DeepSeek's latent attention: `head_dim` is then the q / k heads' width, `rotary_dim` the
    # rotated part's)
    attention: AttentionShape = PER_HEAD
    # Granite's constant scales: the embeddings times embedding_multiplier, attention scores times
    # attention_multiplier (None: 1 / sqrt(head_dim)), each block's output times residual_multiplier before the
    # residual add, the logits divided by logits_scaling. All but the first are folded into weights as they load.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # The dimensions of each head the rotary turns (its first ones; the rest pass unrotated): a config's
    # `rotary_dim`, or head_dim times its `partial_rotary_factor` (Phi-4-mini's 0.75); 0 (the default): all
    rotary_dim: int = 0

    def __post_init__(self):
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    @property
    def weight_scales(self) -> dict[str, float]:
        """Module name -> the factor its weight (and bias) is multiplied by as it loads; `norm`: the final norm.
        A LoRA delta on one of those modules is scaled alike (motet/lora/adapter.py)."""
        scales = {}
        if self.attention_multiplier is not None:  # the kernels' 1/sqrt(head_dim) then gives the multiplier
            # (into q's norm where it has one: the norm would undo a scale before it); none where it is that
            # already (Gemma's query_pre_attn_scalar = head_dim: q_proj stays as it comes, blocks and all)
            factor = self.attention_multiplier * math.sqrt(self.head_dim)
            if factor != 1.0:
                scales["q_norm" if self.qk_norm else "q_proj"] = factor
        if self.residual_multiplier != 1.0:
            scales["o_proj"] = scales["down_proj"] = self.residual_multiplier
        if self.logits_scaling != 1.0:
            scales["norm"] = 1.0 / self.logits_scaling
        return scales

    @property
    def cache_layout(self) -> CacheLayout:
        """What each layer's paged cache keeps a token, as the attention's declaration gives it."""
        return self.attention.cache_layout(self)

    @property
    def kv_elements_per_token(self) -> int:
        """Elements a token keeps in the KV cache over all layers (times the KV dtype's size: its bytes)."""
        return self.num_hidden_layers * self.cache_layout.elements

    @property
    def per_head_kv_elements_per_token(self) -> int:
        """What per-head K and V of the same attention would keep a token over all layers."""
        return self.num_hidden_layers * self.cache_layout.per_head_elements

    @property
    def is_moe(self) -> bool:
        return bool(self.sparse_layers)

    @property
    def projection_rows(self) -> dict[str, int]:
        """The checkpoint's output rows of each projection (those a fused module holds: Phi-3's qkv_proj,
        gate_up_proj)."""
        shapes = projection_shapes(
            self.hidden_size,
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
            self.intermediate_size,
        )
        return {m: rows for m, (_, rows) in shapes.items()}

    @property
    def window_layers(self) -> tuple[int, ...]:
        """The layers with a sliding window: `sliding_layers`, or every layer where only the window is given."""
        if self.sliding_window is None:
            return ()
        return self.sliding_layers or tuple(range(self.num_hidden_layers))

    @property
    def declaration(self) -> Architecture:
        """The family's declaration (motet/models/): its checkpoint names and the like."""
        return get_declaration(self.architecture)

    @classmethod
    def from_dict(cls, cfg: dict, source: str = "config.json") -> ModelConfig:
        """Every field read is checked (its type, a finite number, its range, its fit with the others) and a wrong
        one refused in one line naming it (ModelLoadError); the family's own fields by its declaration."""
        if not isinstance(cfg, dict):
            raise ModelLoadError(
                f"{source}: must be a JSON object of the model's hyperparameters, got {cfg!r:.40}"
            )
        archs = cfg.get("architectures") or []
        if not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise ModelLoadError(f"{source}: architectures must be a list of names, got {archs!r:.80}")
        decl = find(archs)
        if decl is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r:.80}; "
                f"motet serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def integer(name: str, value=None) -> int:
            """A LIMITS field: config.json's value, or `value` where given."""
            return bounded(cfg[name] if value is None else value, name, source, *LIMITS[name])

        try:
            heads = integer("num_attention_heads")
            hidden = integer("hidden_size")
            head_dim = integer("head_dim", cfg.get("head_dim") or hidden // heads)
            num_layers = integer("num_hidden_layers")
            max_positions = integer("max_position_embeddings", cfg.get("max_position_embeddings", 2048))
            rope_scaling, rope_key = cfg.get("rope_scaling"), "rope_scaling"
            rope_theta, theta_key = cfg.get("rope_theta"), "rope_theta"
            rope_params = cfg.get("rope_parameters") or {}
            if not isinstance(rope_params, dict):
                raise ModelLoadError(f"{source}: rope_parameters must be an object, got {rope_params!r:.80}")
            if rope_theta is None:  # transformers >= 5 nests theta inside rope_parameters
                # per layer type (Gemma 3's): the global layers' here, the others' in the declaration
                per_type = "full_attention" in rope_params
                nested = rope_params["full_attention"] if per_type else rope_params
                nested_key = "rope_parameters.full_attention" if per_type else "rope_parameters"
                if not isinstance(nested, dict):
                    raise ModelLoadError(f"{source}: {nested_key} must be an object, got {nested!r:.80}")
                rope_theta, theta_key = nested.get("rope_theta", 10000.0), f"{nested_key}.rope_theta"
                if rope_scaling is None and nested.get("rope_type", "default") != "default":
                    rope_scaling, rope_key = nested, nested_key
            partial = cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
            partial = bounded_number(partial, "partial_rotary_factor", source)
            rotary_dim = cfg.get("rotary_dim") or int(head_dim * partial)  # (transformers' rounding)
            rotary_dim = bounded(rotary_dim, "rotary_dim", source, 0, head_dim)
            if rotary_dim < 2 or rotary_dim % 2:
                raise ModelLoadError(
                    f"{source}: the rotary turns {rotary_dim} of each head's {head_dim} dimensions "
                    f"(partial_rotary_factor {partial}): it must turn an even number of them, at least 2"
                )
            refuse_what_is_not_computed(cfg, source)
            bos = cfg.get("bos_token_id")
            act = "silu" if decl.activation is None else hidden_act(cfg, *decl.activation, source)
            fields = dict(
                architecture=next(a for a in archs if a in decl.names),
                vocab_size=integer("vocab_size"),
                hidden_size=hidden,
                intermediate_size=integer("intermediate_size"),
                num_hidden_layers=num_layers,
                num_attention_heads=heads,
                num_key_value_heads=integer("num_key_value_heads", cfg.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=bounded_number(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", source),
                rope_theta=bounded_number(rope_theta, theta_key, source),
                rope_scaling=checked_rope_scaling(
                    rope_scaling,
                    max_positions,
                    source,
                    rope_key,
                    rotary_dim=rotary_dim,
                    original_context=cfg.get("original_max_position_embeddings"),
                ),
                max_position_embeddings=max_positions,
                tie_word_embeddings=flag(cfg, "tie_word_embeddings", source, False),
                attention_bias=flag(
                    cfg, "attention_bias", source, flag(cfg, "qkv_bias", source, decl.qkv_bias)
                ),
                qk_norm=decl.qk_norm,
                qk_norm_whole=decl.qk_norm_whole,
                post_norms=decl.post_norms,
                pre_norms=decl.pre_norms,
                norm_weight_offset=decl.norm_weight_offset,
                hidden_act=act,
                expert_act=act,
                sliding_window=sliding_window(cfg, source, used_by_default=True),
                rotary_dim=rotary_dim,
                bos_token_id=None if bos is None else bounded(bos, "bos_token_id", source, *TOKEN_IDS),
                eos_token_ids=token_ids(cfg.get("eos_token_id"), "eos_token_id", source),
            )
            if decl.experts is not None:
                fields.update(decl.experts(cfg, num_layers, source))
            if decl.options is not None:  # (the sliding window too, where the family reads its own)
                fields.update(decl.options(cfg, source))
            config = cls(**fields)
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing field {e.args[0]!r}") from None
        except (
            TypeError,
            ValueError,
            AttributeError,
            ArithmeticError,
        ) as e:  # (a fallback: fields name themselves)
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"{source}: a field has a value of the wrong kind ({e})") from None
        _check(config, source)
        return config

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not path.is_dir():
            raise ModelLoadError(f"model directory {str(path)!r} does not exist")
        if not cfg_file.exists():
            raise ModelLoadError(f"{cfg_file}: missing; a model directory needs a Hugging Face config.json")
        return cls.from_dict(read_json(cfg_file), source=str(cfg_file))


# The range of a token id in config.json and generation_config.json (an id past the vocabulary is never sampled).
TOKEN_IDS = (0, 2**31 - 1)


def token_ids(value, name: str, source: str) -> tuple[int, ...]:
    """A config's eos_token_id: none, one id or a list of them; ModelLoadError naming it otherwise."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    return tuple(bounded(i, name, source, *TOKEN_IDS) for i in ids)


def read_json(path: Path):
    """A model's JSON file (config.json, generation_config.json, the weights' index), or ModelLoadError: not a
    regular file (a FIFO would block the read), not valid JSON, or nested deeper than Python's parser recurses."""
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a regular file")
    try:
        return json.loads(path.read_text())
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: JSON nested too deeply") from None


def _check(cfg: ModelConfig, source: str) -> None:
    for name, (lo, hi) in LIMITS.items():
        bounded(getattr(cfg, name), name, source, lo, hi)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({cfg.num_attention_heads}) must be a multiple of num_key_value_heads "
            f"({cfg.num_key_value_heads})"
        )
    if cfg.sliding_window is None and cfg.sliding_layers:
        raise ModelLoadError(
            f"{source}: layer_types makes layer(s) {', '.join(map(str, cfg.sliding_layers[:8]))} sliding_attention, "
            f"but no sliding_window is given (null, or use_sliding_window false)"
        )
