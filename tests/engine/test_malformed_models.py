"""A model is input: a config.json or GGUF file whose hyperparameters are out of range (context length 0, no
attention heads, 2**32-1 layers, ...) or a model path that is not a regular file (a FIFO) is refused at
start-up with one line naming the field and its range, exit 2, before anything is allocated or served (such
files used to segfault in the native attention, raise ZeroDivisionError, or grow without end).

The loader checks every field it reads (its type, a finite number, its range, its fit with the others): a
config.json that is no object or nests without end, an integer of 1e999 or -Infinity, a rope factor of 0 or "2",
a llama3 band of no width, a YaRN context past any model's, a sliding layer without a window, a weight stored in
integers, a weights file that is a directory or a FIFO: each is one ModelLoadError naming the field or file (what
LLM() raises and the CLI prints in one line), never a traceback, a hang, or NaN and wrong tokens served."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from motet.api.cli import main
from motet.engine.tokenizer import load_tokenizer
from motet.engine.weights.model_config import load_model_config
from motet.engine.weights.quantization_config import declared_quantization
from motet.engine.weights.quantized_checkpoint import iter_checkpoint_weights
from motet.models.declaration import ModelLoadError
from tests.engine.test_gguf_model_file import write_gguf_file
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("source"))


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))


def refused(model, capsys) -> str:
    """`motet generate --model MODEL`'s exit status must be 2; its one line on stderr."""
    capsys.readouterr()  # (what made the model wrote progress bars)
    assert main(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("max_position_embeddings", 0, "max_position_embeddings must be from 1 to 16777216, got 0"),
        ("num_attention_heads", 0, "num_attention_heads must be from 1 to 1024, got 0"),
        ("num_hidden_layers", 2**32 - 1, "num_hidden_layers must be from 1 to 1024, got 4294967295"),
        (
            "num_key_value_heads",
            3,
            r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
        ),
        ("vocab_size", -5, "vocab_size must be from 1 to 16777216, got -5"),
        ("rms_norm_eps", 0, "rms_norm_eps must be a number above 0 and below 1, got 0"),
        ("num_hidden_layers", "many", "num_hidden_layers must be an integer from 1 to 1024, got 'many'"),
        ("hidden_size", 2.5, "hidden_size must be an integer from 1 to 65536, got 2.5"),
    ],
)
def test_out_of_range_config_json_is_one_line(source, tmp_path, capsys, field, value, message):
    model = tmp_path / "m"
    shutil.copytree(source, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg[field] = value
    (model / "config.json").write_text(json.dumps(cfg))
    line = refused(model, capsys)
    assert str(model / "config.json") in line and re.search(message, line), line


@pytest.mark.parametrize(
    "key, value",
    [
        ("llama.context_length", 0),
        ("llama.attention.head_count", 0),
        ("llama.block_count", 0xFFFFFFFF),
        ("llama.embedding_length", 0),
    ],
)
def test_out_of_range_gguf_metadata_is_one_line(source, tmp_path, capsys, key, value):
    path = write_gguf_file(source, tmp_path / "g" / "bad.gguf", {}, meta={key: value})
    line = refused(path, capsys)
    assert f"bad.gguf: {key} must be from" in line and f"got {value}" in line


def test_a_fifo_as_the_model_is_refused(tmp_path, capsys):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    line = refused(fifo, capsys)
    assert "is not a regular file or a directory" in line


def patch(**fields):
    """config.json with `fields` set (json writes inf as Infinity, as a config may say it)."""

    def mutate(model):
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, **fields}))

    return mutate


def text(old: str, new: str):
    """config.json's text with `old` replaced (a number JSON spells as 1e999)."""

    def mutate(model):
        cfg = (model / "config.json").read_text()
        assert old in cfg
        (model / "config.json").write_text(cfg.replace(old, new))

    return mutate


def whole(content: str):
    def mutate(model):
        (model / "config.json").write_text(content)

    return mutate


def rope(**params):
    return patch(rope_parameters={"rope_theta": 10000.0, **params})


def llama3(**params):
    band = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    return rope(rope_type="llama3", **{**band, **params})


def weights_file(make):
    def mutate(model):
        (model / "model.safetensors").unlink()
        make(model / "model.safetensors")

    return mutate


def int32_o_proj(model):
    state = load_file(model / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    state[name] = (state[name] * 100).to(torch.int32)
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})


GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
GRANITE = {"architectures": ["GraniteForCausalLM"], "model_type": "granite"}

# (how the tiny checkpoint is broken, what the one line says). The first rows used to end in a traceback (an
# OverflowError, AttributeError, RecursionError, ZeroDivisionError, TypeError, OSError); the others loaded and
# served NaN or wrong tokens.
MALFORMED = [
    pytest.param(
        text('"vocab_size": 320', '"vocab_size": 1e999'), "vocab_size must be an integer", id="1e999"
    ),
    pytest.param(
        patch(intermediate_size=float("-inf")), "intermediate_size must be an integer", id="-Infinity"
    ),
    pytest.param(
        patch(max_position_embeddings=float("inf")), "max_position_embeddings must be", id="inf-context"
    ),
    pytest.param(patch(num_key_value_heads=float("-inf")), "num_key_value_heads must be", id="-inf-kv-heads"),
    pytest.param(patch(head_dim=float("inf")), "head_dim must be an integer", id="inf-head-dim"),
    pytest.param(patch(eos_token_id=float("-inf")), "eos_token_id must be an integer", id="-inf-eos"),
    pytest.param(whole("null"), "must be a JSON object", id="null"),
    pytest.param(whole("[1, 2]"), "must be a JSON object", id="list"),
    pytest.param(whole("[" * 100_000 + "]" * 100_000), "nested too deeply", id="nested"),
    pytest.param(
        patch(**GEMMA3, query_pre_attn_scalar=0),
        "query_pre_attn_scalar must be a number at least 1e-06 and at most 1e.06, got 0",
        id="gemma-q0",
    ),
    pytest.param(llama3(low_freq_factor=0), "low_freq_factor must be a positive number", id="llama3-low-0"),
    pytest.param(
        llama3(low_freq_factor=4.0), "high_freq_factor must be a number above 4", id="llama3-no-band"
    ),
    pytest.param(
        rope(rope_type="linear", factor="2"), r"factor must be a number at least 1, got '2'", id="str"
    ),
    pytest.param(weights_file(os.mkdir), "model.safetensors: not a regular file", id="weights-dir"),
    pytest.param(
        rope(rope_type="linear", factor=0), "rope_parameters.factor must be a number at least 1", id="0"
    ),
    pytest.param(
        rope(rope_type="linear", factor=-2.0), "factor must be a number at least 1, got -2.0", id="neg"
    ),
    pytest.param(rope(rope_type="yarn", factor=0), "factor must be a number at least 1, got 0", id="yarn-0"),
    pytest.param(  # finite in float64, inf in the float32 the model computes in
        rope(rope_theta=1e39), "rope_parameters.rope_theta must be finite in float32", id="theta-1e39"
    ),
    pytest.param(rope(rope_type="linear", factor=1e39), "factor must be finite in float32", id="factor-1e39"),
    pytest.param(
        patch(**GEMMA3, rope_local_base_freq=-1e4),
        "rope_local_base_freq must be a number at least 1",
        id="base",
    ),
    pytest.param(
        patch(
            **GEMMA3,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": -1e4},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        ),
        "rope_parameters.sliding_attention.rope_theta must be a number at least 1, got -10000.0",
        id="local-base",
    ),
    pytest.param(
        rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=1e9),
        "original_max_position_embeddings must be from 1 to 16777216, got 1000000000",
        id="yarn-1e9",
    ),
    pytest.param(
        rope(rope_type="yarn", original_max_position_embeddings=8192),
        r"original_max_position_embeddings \(8192\) is above max_position_embeddings \(4096\)",
        id="yarn-below-1",
    ),
    pytest.param(
        rope(rope_type="yarn", factor=4.0, beta_slow=-1), "beta_slow must be a positive", id="yarn-beta"
    ),
    pytest.param(int32_o_proj, "'model.layers.0.self_attn.o_proj.weight' .* is stored as int32", id="int32"),
    pytest.param(
        patch(**GEMMA3, sliding_window=None),
        "layer_types makes layer.s. 0, 1 sliding_attention, but no sliding_window",
        id="gemma-no-window",
    ),
    pytest.param(
        patch(**QWEN2, use_sliding_window=False, layer_types=["sliding_attention", "full_attention"]),
        "layer_types makes layer.s. 0 sliding_attention, but no sliding_window",
        id="qwen-no-window",
    ),
    pytest.param(patch(layer_types=["sliding_attention"], **GEMMA3), "layer_types must list 2", id="types"),
    pytest.param(rope(rope_type="dynamic", factor=2.0), "type 'dynamic' is not supported", id="dynamic"),
    pytest.param(patch(tie_word_embeddings="false"), "tie_word_embeddings must be true or false", id="bool"),
    pytest.param(patch(eos_token_id=[2, "3"]), "eos_token_id must be an integer", id="eos-str"),
    # finite in float32, but scales that overflow it in the model's products (issue 68, finding 13: DeepSeek's
    # routed_scaling_factor of 1e38 served an empty abort to every request)
    pytest.param(
        patch(**GRANITE, embedding_multiplier=1e38),
        r"embedding_multiplier must be a number at least 1e-06 and at most 1e\+06, got 1e\+38",
        id="granite-1e38",
    ),
    pytest.param(
        patch(**GRANITE, logits_scaling=1e-38), "logits_scaling must be a number at least 1e-06", id="divisor"
    ),
    pytest.param(
        patch(**GEMMA3, final_logit_softcapping=1e30),
        "final_logit_softcapping must be .* at most 1e",
        id="cap",
    ),
    pytest.param(
        rope(rope_theta=1e-38), "rope_parameters.rope_theta must be a number at least 1", id="theta"
    ),
    pytest.param(
        rope(rope_type="yarn", factor=4.0, attention_factor=1e30),
        "attention_factor must be .* at most",
        id="yarn",
    ),
    pytest.param(patch(hidden_act="gelu_10"), "hidden_act 'gelu_10' is not an activation", id="act"),
    pytest.param(patch(mlp_bias=True), "mlp_bias true: motet's MLPs have no biases", id="mlp-bias"),
    pytest.param(
        patch(**GEMMA3, use_bidirectional_attention=True),
        "use_bidirectional_attention true: motet's attention is causal",
        id="bidirectional",
    ),
]


def load(model) -> None:
    """What LLM() reads of a checkpoint before it computes anything: its config and its tensors (not read)."""
    load_model_config(model)
    for _ in iter_checkpoint_weights(model, declared_quantization(model, None)):
        pass


@pytest.mark.parametrize("mutate, message", MALFORMED)
def test_a_malformed_checkpoint_is_one_error_naming_the_field(source, tmp_path, mutate, message):
    model = tmp_path / "m"
    shutil.copytree(source, model)
    mutate(model)
    with pytest.raises(ModelLoadError) as e:
        load(model)
    line = str(e.value)
    assert "\n" not in line and str(model) in line and re.search(message, line), line


def test_serve_refuses_a_malformed_config_in_one_line(source, tmp_path, capsys):
    """`motet serve --model DIR` with a context length of -Infinity: exit 2 and one line, before it listens."""
    model = tmp_path / "m"
    shutil.copytree(source, model)
    patch(max_position_embeddings=float("-inf"))(model)
    capsys.readouterr()
    assert main(["serve", "--model", str(model), "--port", "0", "--data-dir", str(tmp_path / "data")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert f"{model / 'config.json'}: max_position_embeddings must be an integer" in err[0], err


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json"])
def test_a_fifo_in_the_model_directory_is_refused_unopened(source, tmp_path, name):
    """The weights file or the tokenizer a FIFO: refused by name before anything opens it. Opening it used to block
    the start-up for ever, with the GIL held (no timeout ends that); should it block again, a writer opening the
    FIFO after 5 s ends the wait, and the test fails instead of hanging."""
    model = tmp_path / "m"
    shutil.copytree(source, model)
    fifo = model / name
    fifo.unlink()
    os.mkfifo(fifo)
    rescue = subprocess.Popen(["sh", "-c", 'sleep 5; exec 3> "$0"', str(fifo)], start_new_session=True)
    try:
        with pytest.raises(ModelLoadError, match=f"{re.escape(str(fifo))}: not a regular file"):
            load(model)
            load_tokenizer(model)
    finally:
        os.killpg(rescue.pid, signal.SIGKILL)
        rescue.wait()


def without_eos(source, model, tokenizer_too: bool = True):
    """A copy of `source` whose config.json and generation_config.json name no eos_token_id (nor, where
    `tokenizer_too`, its tokenizer_config.json an eos_token)."""
    shutil.copytree(source, model)
    for name, key in [("config.json", "eos_token_id"), ("generation_config.json", "eos_token_id")] + (
        [("tokenizer_config.json", "eos_token")] if tokenizer_too else []
    ):
        fields = json.loads((model / name).read_text())
        fields.pop(key)
        (model / name).write_text(json.dumps(fields))
    return model


def test_a_checkpoint_with_no_eos_anywhere_is_refused_naming_the_files(source, tmp_path, capsys):
    """Issue 68, finding 7: such a checkpoint loaded, then every grammar failed with xgrammar's "stop_token_ids
    cannot be empty" (and answers had no end but max_tokens); now one line at load naming eos_token_id and the
    files looked in, before the weights are read (here not even a weights file)."""
    from motet.engine.llm import LLM

    model = without_eos(source, tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"not weights")
    line = refused(model, capsys)
    assert "no eos_token_id" in line, line
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert str(model / name) in line, line
    with pytest.raises(ModelLoadError, match="no eos_token_id"):
        LLM(str(model), num_kv_blocks=16)


def test_the_tokenizers_eos_ends_answers_where_the_configs_name_none(source, tmp_path):
    """Neither config names one, the tokenizer does: its eos_token_id (as transformers' tokenizer reads it) is the
    model's, and the grammars stop at it."""
    from transformers import AutoTokenizer

    from motet.engine.llm import LLM

    model = without_eos(source, tmp_path / "m", tokenizer_too=False)
    eos = AutoTokenizer.from_pretrained(model).eos_token_id
    assert eos is not None and load_model_config(model).eos_token_ids == (eos,)
    llm = LLM(str(model), num_kv_blocks=16)
    assert llm.engine.grammar_tokenizer.stop_token_ids == [eos]
