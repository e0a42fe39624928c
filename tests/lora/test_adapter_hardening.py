"""Adversarial PEFT LoRA adapters (the hardening issue): every one is refused with an AdapterError naming the
field or key at fault, quickly, and never with another exception; real adapters still load.

1. slow (catastrophically backtracking) and overlong config regexes are refused under a time bound;
2. malformed regexes in any config field (and out-of-range rank/alpha pattern values) are AdapterErrors;
3. adapters whose weights or scale would overflow the delta are refused at load;
4. every other malformed config field is an AdapterError naming the field.
"""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from motet.evals.lora_reference import lora_config, random_lora_factors
from motet.lora.adapter import AdapterError, load_adapter
from tests.lora.test_lora_pool import BASE

QV = ("q_proj", "v_proj")
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
SLOW_S = 5.0  # a refusal must come well within this (the slow inputs took from seconds to hours before)


def write_adapter(
    path: Path,
    *,
    rank: int = 2,
    modules=QV,
    fill: float | None = None,
    dtype=torch.float32,
    config_text: str | None = None,
    **config,
) -> Path:
    """A PEFT-format adapter dir (the files PEFT's save_pretrained writes): small random factors
    (or every value `fill`) for `modules` of every layer, and `config` over a plain LoRA config."""
    tensors = random_lora_factors(BASE, modules, rank, seed=0, a_std=0.1, b_std=0.1)
    if fill is not None:
        tensors = {name: torch.full(t.shape, fill, dtype=torch.float64) for name, t in tensors.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: t.to(dtype) for name, t in tensors.items()}, path / "adapter_model.safetensors")
    cfg = lora_config(rank, modules) | config
    (path / "adapter_config.json").write_text(config_text if config_text is not None else json.dumps(cfg))
    return path


def refused(path: Path, match: str, **kwargs) -> float:
    """Assert load_adapter refuses `path` with an AdapterError matching `match`; return the seconds it took."""
    start = time.perf_counter()
    with pytest.raises(AdapterError, match=match):
        load_adapter(path, BASE, **kwargs)
    return time.perf_counter() - start


def test_plain_adapter_loads(tmp_path):
    adapter = load_adapter(write_adapter(tmp_path / "a"), BASE)
    assert set(adapter.weights) == {(i, m) for i in range(2) for m in QV}
    assert adapter.weights[(0, "q_proj")][2] == 2.0


def test_committed_trained_adapters_are_within_the_limits():
    """The real trained adapters (SmolLM2-135M, r=8) load: the bounds are far from what training produces."""
    smollm = SimpleNamespace(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        is_moe=False,
        weight_scales={},
    )
    for name in ("upper", "json"):
        adapter = load_adapter(Path(__file__).parents[1] / "fixtures" / "adapters" / name, smollm)
        assert adapter.rank == 8 and len(adapter.weights) == 30 * 7


# --- 1. slow and overlong regexes ----------------------------------------------------------------------------

# Catastrophic backtracking: `(.|.)*` before a suffix that never matches tries 2^len(name) ways with `re`
# (and the `regex` engine finds no shortcut through it either).
EVIL = r"(.|.)*[xyz]"


@pytest.mark.timeout(15)
@pytest.mark.parametrize(
    "config, match",
    [
        # the pattern (12.5 s of CPU on the real model's longer names): no module matches it
        (dict(target_modules=r"model\.layer(.+)+[0-9]"), "target_modules"),
        (dict(target_modules=r"(.+)+[0-9]"), "target_modules"),
        (dict(target_modules=EVIL), "target_modules: pattern too slow"),
        (
            dict(target_modules=r".*\.(q_proj|v_proj)", exclude_modules=EVIL),
            "exclude_modules: pattern too slow",
        ),
        (dict(rank_pattern={EVIL: 2}), rf"rank_pattern\[{re.escape(repr(EVIL))}\]: pattern too slow"),
        (dict(alpha_pattern={EVIL: 2}), rf"alpha_pattern\[{re.escape(repr(EVIL))}\]: pattern too slow"),
        (dict(layers_to_transform=[0], layers_pattern=EVIL), "layers_pattern: pattern too slow"),
    ],
    ids=["issue", "nested-plus", "target", "exclude", "rank_pattern", "alpha_pattern", "layers_pattern"],
)
def test_slow_regex_refused_quickly(tmp_path, config, match):
    assert refused(write_adapter(tmp_path / "a", **config), match) < SLOW_S


def test_overlong_regex_refused(tmp_path):
    long = r".*\.(q_proj|v_proj" + "|nothing" * 200 + ")"  # valid and selects q/v, but 1.6k characters
    refused(write_adapter(tmp_path / "a", target_modules=long), "target_modules: pattern too long")
    refused(write_adapter(tmp_path / "b", rank_pattern={long: 2}), "rank_pattern.*: pattern too long")


def test_overlong_lists_refused(tmp_path):
    many = list(QV) + [f"unused_{i}" for i in range(20_000)]
    refused(write_adapter(tmp_path / "a", target_modules=many), "target_modules: 20002 entries")
    refused(write_adapter(tmp_path / "b", exclude_modules=many[2:]), "exclude_modules: 20000 entries")
    refused(
        write_adapter(tmp_path / "c", rank_pattern={f"x{i}": 2 for i in range(20_000)}),
        "rank_pattern: 20000 entries",
    )


def test_regex_semantics_equal_peft(tmp_path):
    """String target_modules are re.fullmatch'ed against the whole module name (PEFT), pattern keys match a
    dotted suffix; constructs that the `regex` engine reads differently from `re` are refused, not reinterpreted."""
    adapter = load_adapter(
        write_adapter(
            tmp_path / "a",
            modules=("q_proj",),
            target_modules=r"model\.layers\.(0|1)\.self_attn\.(q)_proj",
            alpha_pattern={r"layers\.1\.self_attn\.q_(p|x)roj": 1, "q_proj": 8},
        ),
        BASE,
    )
    assert adapter.weights[(0, "q_proj")][2] == 4.0 and adapter.weights[(1, "q_proj")][2] == 0.5
    # `{e<=1}` is a literal in `re` but fuzzy matching in `regex`; `[[:alpha:]]` a POSIX class only in `regex`
    for i, pattern in enumerate((r".*\.q_proj(?:{e<=1})?", r".*\.[[:alpha:]_]+\.q_proj")):
        path = write_adapter(tmp_path / f"b{i}", modules=("q_proj",), target_modules=pattern)
        refused(path, "target_modules: pattern uses")


def test_pattern_keys_first_match_wins_like_peft(tmp_path):
    """Many alpha_pattern keys (plain ones are folded into alternations of 256): each module gets the value of
    the first key that PEFT's get_pattern_key picks, plain or regex."""
    from peft.utils.other import get_pattern_key

    alphas = {f"nothing_{i}.q_proj": 1 for i in range(300)}
    alphas |= {
        r"layers\.1\..*": 3,
        "model.layers.0.self_attn.v_proj": 5,
        "q_proj": 6,
        "^model.layers.1.self_attn.v_proj": 9,
    }
    adapter = load_adapter(write_adapter(tmp_path / "a", alpha_pattern=alphas), BASE)
    for (layer, module), (_, _, scale) in adapter.weights.items():
        name = f"model.layers.{layer}.self_attn.{module}"
        assert scale * 2 == alphas.get(get_pattern_key(list(alphas), name), 4), name
    assert {s for _, _, s in adapter.weights.values()} == {1.5, 2.5, 3.0}


def test_the_regex_budget_leaves_the_garbage_collectors_time_out(tmp_path):
    """CI refused the config above as "pattern too slow": its checks take milliseconds, but a collection of
    the test process's whole heap ran in the same thread and was counted. Here the first collection inside the
    budgeted regex work costs 1.2 s of CPU: the adapter still loads, and a hostile pattern is still cut off."""
    import gc
    import sys

    burned = []

    def slow_collection(phase: str, _info: dict) -> None:
        frame = sys._getframe(1)
        timed = ("_compile", "run")  # _Regexes' budgeted methods
        while frame and not (
            frame.f_code.co_filename.endswith("peft_config.py") and frame.f_code.co_name in timed
        ):
            frame = frame.f_back
        if phase == "start" and frame and not burned:
            burned.append(True)
            end = time.thread_time() + 1.2
            while time.thread_time() < end:
                pass

    # names of this test's own: `re` caches what it compiled (the test above's keys), and a cached compile
    # allocates nothing that would start a collection
    alphas = {f"collected_{i}.q_proj": 1 for i in range(300)} | {r"layers\.1\.(self_attn|mlp)\..*": 3}
    threshold = gc.get_threshold()
    gc.callbacks.append(slow_collection)
    gc.set_threshold(50)  # a collection every few allocations: many during the load
    try:
        adapter = load_adapter(write_adapter(tmp_path / "a", alpha_pattern=alphas), BASE)
        assert burned and {s for _, _, s in adapter.weights.values()} == {1.5, 2.0}  # 3 / 2 and 4 / 2
        with pytest.raises(AdapterError, match="alpha_pattern.*: pattern too slow"):
            load_adapter(write_adapter(tmp_path / "b", alpha_pattern={EVIL: 2}), BASE)
    finally:
        gc.callbacks.remove(slow_collection)
        gc.set_threshold(*threshold)


# --- 2. malformed regexes and pattern values -------------------------------------------------------------


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(exclude_modules="("), "exclude_modules .* is not a valid regex"),
        (dict(layers_to_transform=[0], layers_pattern="("), "layers_pattern .* is not a valid regex"),
        (
            dict(layers_to_transform=[0], layers_pattern=["layers", "("]),
            "layers_pattern .* is not a valid regex",
        ),
        (
            dict(layers_to_transform=[0], layers_pattern="(?P<idx>x)"),
            "layers_pattern .* is not a valid regex",
        ),
        (dict(rank_pattern={"(?i)q_proj": 1}), r"rank_pattern\['\(\?i\)q_proj'\] is not a valid regex"),
        (dict(alpha_pattern={"(?i)q_proj": 1}), r"alpha_pattern\['\(\?i\)q_proj'\] is not a valid regex"),
        # PEFT's layer-index regex matches with no `idx` group: no layer index, so nothing is selected
        (dict(layers_to_transform=[0], layers_pattern="model|x"), "selects no module"),
        (dict(layers_to_transform=[0], layers_pattern=5), "layers_pattern must be"),
        (dict(layers_to_transform=[0], layers_pattern=[5]), "layers_pattern must be"),
        (dict(rank_pattern={"q_proj": 10**400}), r"rank_pattern\['q_proj'\] must be a positive integer"),
        (dict(rank_pattern={"k_proj": 10**9}), r"rank_pattern\['k_proj'\] must be a positive integer"),
        (dict(alpha_pattern={"q_proj": 10**400}), r"alpha_pattern\['q_proj'\] must be a positive number"),
        (dict(alpha_pattern={"k_proj": 1e30}), r"alpha_pattern\['k_proj'\] must be a positive number"),
    ],
    ids=[
        "exclude",
        "layers_pattern",
        "layers_pattern-list",
        "layers_pattern-idx-group",
        "rank_pattern-key",
        "alpha_pattern-key",
        "layers_pattern-no-idx",
        "layers_pattern-int",
        "layers_pattern-int-list",
        "rank-value-huge-int",
        "rank-value-unused-huge",
        "alpha-value-huge-int",
        "alpha-value-unused-huge",
    ],
)
def test_malformed_patterns_refused(tmp_path, config, match):
    refused(write_adapter(tmp_path / "a", **config), match)


# --- 3. overflowing adapters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=1, fill=1e38), rf"'{Q_A}' has values up to 1e\+38"),
        (dict(rank=1, fill=1e39, dtype=torch.float64), rf"'{Q_A}' has values up to 1e\+39"),  # inf in fp32
        (dict(rank=1, fill=1e5, dtype=torch.float16), rf"'{Q_A}' has non-finite"),  # inf in fp16 already
        (dict(rank=1, lora_alpha=1e30), r"lora_alpha must be a positive number .*got 1e\+30"),
        (dict(rank=1, lora_alpha=5e5), r"q_proj: scale 500000 \(alpha 500000 / r 1\)"),
        (dict(rank=1, lora_alpha=2e4, use_rslora=True), r"scale 20000"),
        (dict(rank=2, alpha_pattern={"v_proj": 1e5}), r"v_proj: scale 50000"),
        # every factor and the scale are moderate, but B @ A * scale can amplify an input 1.3e6-fold
        (dict(rank=2, fill=100.0), r"q_proj: the weight delta .* amplifies an input up to 1\.28e\+06"),
    ],
    ids=[
        "weights-1e38",
        "f64-weights",
        "f16-inf",
        "alpha-1e30",
        "scale",
        "rslora-scale",
        "alpha-pattern-scale",
        "gain",
    ],
)
def test_overflowing_adapters_refused(tmp_path, kwargs, match):
    refused(write_adapter(tmp_path / "a", **kwargs), match)


# --- 4. every other config field ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(r=10**400), "r must be a positive integer"),
        (dict(r=1e400), "r must be a positive integer"),  # json writes Infinity
        (dict(r=2**70), "r must be a positive integer"),
        (dict(r=True), "r must be a positive integer"),
        (dict(r=-2), "r must be a positive integer"),
        (dict(r=2.5), "r must be a positive integer"),
        (dict(r=None), "r must be a positive integer"),
        (dict(lora_alpha=10**400), "lora_alpha must be a positive number"),
        (dict(lora_alpha=float("inf")), "lora_alpha must be a positive number"),
        (dict(lora_alpha="16"), "lora_alpha must be a positive number"),
        (dict(lora_alpha=None), "lora_alpha must be a positive number"),
        (dict(target_modules=5), "target_modules must be"),
        (dict(target_modules=[["q_proj"]]), "target_modules must be"),
        (dict(target_modules={"q_proj": 1}), "target_modules must be"),
        (dict(exclude_modules=[1]), "exclude_modules must be"),
        (dict(exclude_modules=7), "exclude_modules must be"),
        (dict(layers_to_transform=[0.5]), "layers_to_transform must be"),
        (dict(peft_type="lora"), "peft_type is 'lora'"),
        (dict(peft_type=["LORA"]), r"peft_type is \['LORA'\]"),
    ],
)
def test_config_fields_refused(tmp_path, config, match):
    refused(write_adapter(tmp_path / "a", **config), match)


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"peft_type": "LORA", "r": ' + "1" * 5000 + "}", "adapter_config.json: not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "adapter_config.json: not valid JSON"),
    ],
    ids=["huge-int", "deep-nesting"],
)
def test_unparseable_config_refused(tmp_path, text, match):
    refused(write_adapter(tmp_path / "a", config_text=text), match)


@pytest.mark.parametrize(
    "header",
    [b'{"x": ' + b"1" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000],
    ids=["huge-int", "deep-nesting"],
)
def test_unparseable_safetensors_header_refused(tmp_path, header):
    path = write_adapter(tmp_path / "a")
    (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    refused(path, "safetensors header is not valid JSON")
