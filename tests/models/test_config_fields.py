"""Every config.json field that changes what a model computes is implemented or refused at load, naming it (issue
68, finding 3: a Llama checkpoint with hidden_act "gelu" and a Qwen2 one with "relu2" loaded without a word and
computed SiLU, no greedy answer equal to transformers').

The walk: each family motet declares (motet/models/) against its transformers config class's fields
(`to_dict()` of its defaults, as transformers >= 5 writes a config.json): every field is read by motet's loader
(ModelConfig.from_dict: used, or refused at a value motet does not compute) or listed below as one that does not
change the arithmetic, with why. A field a later transformers adds, or a family added without reading one,
fails here until it is decided.

The activations: each name motet reads computes transformers' ACT2FN function, and tiny random models with them
(dense MLPs, experts, a shared expert) give transformers' logits and greedy tokens on both CPU paths."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.kernels import activation, cpu_native
from motet.models import DECLARATIONS, fields
from motet.models.config import ModelConfig
from motet.models.declaration import ModelLoadError
from tests.engine.test_engine import PROMPTS, engine_logits, hf_greedy_outputs, hf_logits
from tests.models.test_moe import PATHS, randomize_norms
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

# Fields of every family's config that do not change what the model computes.
NOT_ARITHMETIC = {
    # transformers' bookkeeping
    "_name_or_path": "where transformers loaded the config from",
    "transformers_version": "the version that wrote the file",
    "model_type": "transformers' name of the config class; motet picks the family by `architectures` (read)",
    "dtype": "the checkpoint's dtype: motet computes in --dtype (auto: the device's), the weights cast as they load",
    "is_encoder_decoder": "False in every causal LM's config class",
    # what transformers' forward returns, not what it computes
    "use_cache": "whether transformers' forward returns its KV cache",
    "output_attentions": "whether transformers' forward returns the attention weights",
    "output_hidden_states": "whether transformers' forward returns each layer's hidden states",
    "output_router_logits": "whether transformers' forward returns the routers' logits (for their training loss)",
    "return_dict": "transformers' forward's output as a dataclass or a tuple",
    # other heads' and tasks'
    "id2label": "a classification head's labels",
    "label2id": "a classification head's labels",
    "problem_type": "a classification head's loss",
    "chunk_size_feed_forward": "transformers' chunked feed-forward (the same sums); no decoder motet serves uses it",
    # training only: transformers' eval forward (model.eval(), as it serves) does none of it
    "initializer_range": "the random initialization of a model trained from scratch",
    "attention_dropout": "dropout: training only",
    "embd_pdrop": "dropout: training only",
    "resid_pdrop": "dropout: training only",
    "router_aux_loss_coef": "the routers' load-balancing loss: training only",
    "router_jitter_noise": "Mixtral's router noise: applied in training mode only",
    # token ids of what generation does around the model, not its arithmetic
    "pad_token_id": "the padding token's id: motet's batches are flattened, never padded",
    "pretraining_tp": "unread by transformers >= 5 (4.x split its matmuls in slices: the same sums)",
}
# A family's own fields that do not change its arithmetic.
FAMILY_NOT_ARITHMETIC = {
    "GptOssForCausalLM": {
        "hidden_act": "unread by transformers' GPT-OSS: its experts compute their own clamped SwiGLU (read: "
        "swiglu_alpha, swiglu_limit)",
    },
    "Gemma3ForCausalLM": {
        "_sliding_window_pattern": "transformers' copy of sliding_window_pattern, from which it writes "
        "layer_types (read)",
    },
    "DeepseekV2ForCausalLM": {
        "qk_head_dim": "derived: transformers' modeling computes qk_nope_head_dim + qk_rope_head_dim (both read)",
        "norm_topk_prob": "unread by transformers' DeepSeek-V2: the chosen softmax weights stay as they are",
    },
    "DeepseekV3ForCausalLM": {
        "qk_head_dim": "derived: transformers' modeling computes qk_nope_head_dim + qk_rope_head_dim (both read)",
        "num_nextn_predict_layers": "the multi-token-prediction layers, which transformers' forward does not run "
        "(nor motet: Architecture.skips_trailing_layers)",
    },
}
# What a family's default config lacks to describe a model at all (DeepseekV2Config's num_experts_per_tok None:
# no top-k to route by).
RUNNABLE = {"DeepseekV2ForCausalLM": {"num_experts_per_tok": 6}}
# The branches a family's string-valued options open (each boolean field is also flipped): the fields read under
# them count as read.
QWEN_WINDOW = [{"use_sliding_window": True, "sliding_window": 4096}]  # (transformers nulls it unused)
BRANCHES = {
    "Qwen2ForCausalLM": QWEN_WINDOW,
    "Qwen3ForCausalLM": QWEN_WINDOW,
    "Qwen2MoeForCausalLM": QWEN_WINDOW,
    "DeepseekV2ForCausalLM": [{"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3}],
}


class Reads(dict):
    """A config.json that records the fields read of it (looked up, asked for, or merged under defaults)."""

    def __init__(self, fields: dict, seen: set[str]):
        super().__init__(fields)
        self.seen = seen

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)

    def __ror__(self, defaults: dict):  # `DEFAULTS | cfg`: still this config's reads
        return Reads({**defaults, **self}, self.seen)


def transformers_defaults(architecture: str) -> dict:
    """The config.json transformers writes for `architecture` with its config class's defaults."""
    model_type = next(t for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if name == architecture)
    cfg = CONFIG_MAPPING[model_type]().to_dict()
    return {**cfg, "architectures": [architecture], **RUNNABLE.get(architecture, {})}


def fields_read(cfg: dict) -> set[str]:
    """The fields ModelConfig.from_dict reads of `cfg`, whether it takes the config or refuses it."""
    seen: set[str] = set()
    with contextlib.suppress(ModelLoadError):
        ModelConfig.from_dict(Reads(cfg, seen))
    return seen


ARCHITECTURES = [name for decl in DECLARATIONS for name in decl.names]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_config_field_is_read_refused_or_listed(architecture):
    defaults = transformers_defaults(architecture)
    ModelConfig.from_dict(defaults)  # (the defaults describe a model motet serves)
    variants = [defaults, *({**defaults, **branch} for branch in BRANCHES.get(architecture, []))]
    variants += [{**defaults, k: not v} for k, v in defaults.items() if isinstance(v, bool)]
    read = set().union(*map(fields_read, variants))
    listed = NOT_ARITHMETIC.keys() | FAMILY_NOT_ARITHMETIC.get(architecture, {}).keys()
    unhandled = sorted(set(defaults) - read - listed)
    assert unhandled == [], f"{architecture}: fields neither read nor listed as not changing the arithmetic"


def test_the_lists_name_fields_transformers_has_and_motet_does_not_read():
    """No stale entry: each listed field is in a family's transformers config, and motet does not read it there."""
    everywhere = {name: set(transformers_defaults(name)) for name in ARCHITECTURES}
    assert set(NOT_ARITHMETIC) <= set().union(*everywhere.values())
    for name, listed in FAMILY_NOT_ARITHMETIC.items():
        assert set(listed) <= everywhere[name], name
        assert not set(listed) & fields_read(transformers_defaults(name)), name


# transformers' names (ACT2FN) of the activations motet computes: SiLU, GELU (by erf and by tanh), ReLU, ReLU^2
COMMON_ACTIVATIONS = [
    "silu", "swish", "gelu", "gelu_python", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new", "gelu_fast",
    "relu", "relu2",
]  # fmt: skip


@pytest.mark.parametrize("name", COMMON_ACTIVATIONS)
def test_each_activation_name_computes_transformers_function(name):
    """act(gate) * up by motet's name for a config's activation, in torch (the eager decoder) and in the native
    step's table, equal to transformers' ACT2FN[name](gate) * up."""
    gate, up = torch.randn(2, 4096, generator=torch.Generator().manual_seed(0)) * 4
    want = ACT2FN[name](gate) * up
    ours = fields.HIDDEN_ACTS[name]
    assert ours in cpu_native.ACTIVATIONS
    torch.testing.assert_close(activation.act_and_mul_reference(ours, gate, up), want, atol=1e-5, rtol=1e-5)


def test_motet_reads_those_names_only():
    assert sorted(fields.HIDDEN_ACTS) == sorted(COMMON_ACTIVATIONS)


# (tiny_models arch, the activation field, its value, overrides): a dense MLP of each function motet computes,
# experts and a shared expert
ACTIVATED = {
    "llama-gelu": ("llama", "hidden_act", "gelu", {}),
    "qwen2-relu2": ("qwen2", "hidden_act", "relu2", {}),
    "phi3-relu": ("phi3", "hidden_act", "relu", {"pad_token_id": 0}),
    "granite-gelu_new": ("granite", "hidden_act", "gelu_new", {}),
    "gemma3-gelu": ("gemma3", "hidden_activation", "gelu", {"head_dim": 16, "pad_token_id": 0}),
    "qwen2_moe-relu2": (
        "qwen2_moe",
        "hidden_act",
        "relu2",
        dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral-gelu": ("mixtral", "hidden_act", "gelu", dict(num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module", params=list(ACTIVATED))
def activated(request, tmp_path_factory):
    arch, field, value, overrides = ACTIVATED[request.param]
    model_dir = build_tiny_model(
        tmp_path_factory.mktemp(request.param), arch=arch, tied=False, **{field: value}, **overrides
    )
    randomize_norms(model_dir)
    assert json.loads((model_dir / "config.json").read_text())[field] == value
    return model_dir


@pytest.mark.parametrize("compiled", PATHS)
def test_a_models_activation_matches_transformers(activated, compiled):
    llm = LLM(str(activated), num_kv_blocks=64, block_size=8, compile_step=compiled)
    assert (llm.engine.runner.native is not None) == compiled
    for chunk in (None, 7):
        for got, p in zip(engine_logits(llm.engine, PROMPTS, chunk=chunk), PROMPTS, strict=True):
            torch.testing.assert_close(got, hf_logits(activated, p), atol=2e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[5]]
    assert [o.token_ids for o in llm.generate(prompts, params)] == hf_greedy_outputs(activated, prompts, 16)


@pytest.mark.parametrize(
    "architecture, field, value",
    [
        ("LlamaForCausalLM", "hidden_act", "gelu_10"),  # (a valid ACT2FN name motet does not compute)
        ("Qwen2ForCausalLM", "hidden_act", "mish"),
        ("MixtralForCausalLM", "hidden_act", "quick_gelu"),
        ("Gemma3ForCausalLM", "hidden_activation", "gelu_accurate"),
        ("LlamaForCausalLM", "hidden_act", 3),
    ],
)
def test_an_activation_motet_does_not_compute_is_refused_naming_it(architecture, field, value):
    cfg = {**transformers_defaults(architecture), field: value}
    with pytest.raises(
        ModelLoadError, match=rf"config.json: {field} {value!r} is not an activation motet computes"
    ):
        ModelConfig.from_dict(cfg)
