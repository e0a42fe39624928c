"""PEFT LoRA adapters: load `adapter_config.json` + `adapter_model.safetensors` and validate them strictly.

An adapter is untrusted tenant input: every refusal is an `AdapterError` whose message names the file and
the key or field to fix. What loads is exactly what PEFT would apply: per (layer, module) the factors
A [r, in] and B [out, r] and the scale alpha/r (alpha/sqrt(r) with rsLoRA), so that the weight delta
is `B @ A * scale`.

The config is read by motet/lora/peft_config.py (its regexes under a time budget), the format's facts are in
motet/lora/peft_format.py (re-exported here); this module reads and checks the weights.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from motet.lora.peft_config import brief, read_config, targeted
from motet.lora.peft_format import (  # noqa: F401 - re-exported: the adapter's public names
    CONFIG_FILE,
    FUSED_MODULES,
    MODEL_MODULES,
    MODULE_PARENT,
    PEFT_DEFAULT_TARGETS,
    TARGET_MODULES,
    WEIGHTS_FILE,
    AdapterError,
    AdapterTooLarge,
    base_modules,
    module_name,
    module_shape,
)
from motet.models.config import ModelConfig

_ST_DTYPES = {"F64", "F32", "F16", "BF16"}

# Limits against adversarial adapters. Real PEFT adapters are orders of magnitude inside every one of them
# (the committed trained fixtures: weights <= 0.17, scale 2, delta gain ~30); each refusal names the limit.
MAX_LORA_SCALE = 1e4  # alpha / r (alpha / sqrt(r) with rsLoRA); real scales are ~0.1 .. ~32
MAX_LORA_WEIGHT = 1e4  # |A| and |B| entries; trained factors are ~1e-3 .. ~1e1, and 1e4 is well inside
# fp16 (max 65504) and bf16, the dtypes the slot cache stores them in
MAX_DELTA_GAIN = 1e6  # scale * max row sum |B| * max row sum |A|: bounds |B @ A @ x * scale| / |x| (max
# norms), so that an adapter cannot turn a sane activation into an overflow (bf16 max ~3.4e38) on its own
# PEFT key: [base_model.model.]model.layers.{i}.{parent}.{module}.lora_{A|B}[.{adapter name}].weight
_KEY_RE = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<module>\w+)"
    r"\.lora_(?P<ab>[AB])(?:\.[\w.-]+)?\.weight"
)
# Outside the layers: [base_model.model.]model.embed_tokens.lora_embedding_{A|B}[.{adapter name}] and
# [base_model.model.]lm_head.lora_{A|B}[.{adapter name}].weight; PEFT also saves the two base layers' own weights
# (`save_embedding_layers`, for resized vocabularies): [...].{embed_tokens|lm_head}.base_layer.weight
_MODEL_KEY_RE = re.compile(
    r"(?:base_model\.model\.)?(?:model\.(?P<embed>embed_tokens)\.lora_embedding_(?P<eab>[AB])(?:\.[\w.-]+)?"
    r"|(?P<head>lm_head)\.lora_(?P<hab>[AB])(?:\.[\w.-]+)?\.weight)"
)
_BASE_LAYER_RE = re.compile(
    r"(?:base_model\.model\.)?(?:model\.)?(?P<module>embed_tokens|lm_head)\.base_layer\.weight"
)


# A mixture-of-experts base: LoRA on its attention only, for now (the experts are stacked weights, and a delta per
# expert is not implemented).
_MLP_MODULES = tuple(m for m in TARGET_MODULES if MODULE_PARENT[m] == "mlp")
_MOE_MLP_REFUSAL = (
    "LoRA on a mixture-of-experts model's MLP (experts, shared expert, router, dense MLP layers) is not "
    "supported yet; target the attention only (q_proj, k_proj, v_proj, o_proj)"
)


PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def pickle_refusal(filename: str) -> AdapterError:
    return AdapterError(
        f"{filename}: pickled checkpoints are refused (loading them can run code); upload "
        f"{WEIGHTS_FILE} (PeftModel.save_pretrained(..., safe_serialization=True))"
    )


@dataclass
class LoRAAdapter:
    name: str
    rank: int  # max rank over modules
    weights: dict[
        tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]
    ]  # (layer, module) -> (A, B, scale)

    @property
    def target_modules(self) -> set[str]:
        return {module for _, module in self.weights}


def _check_safetensors_header(
    file: Path, max_file_bytes: int, max_tensors: int, max_header_bytes: int
) -> None:
    """Cheap structural checks before safetensors parses anything: sizes first, then the JSON header."""
    size = file.stat().st_size
    if size > max_file_bytes:
        raise AdapterTooLarge(f"{file}: {size} bytes is above the limit of {max_file_bytes} bytes")
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise AdapterError(f"{file}: truncated; not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > max_header_bytes:
            raise AdapterError(
                f"{file}: safetensors header of {n} bytes is above the limit of {max_header_bytes}"
            )
        if 8 + n > size:
            raise AdapterError(f"{file}: truncated; header length {n} runs past the end of the file")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:  # as for the config: bad UTF-8, huge ints, deep nesting
            raise AdapterError(
                f"{file}: safetensors header is not valid JSON ({brief(str(e), 200)})"
            ) from None
    if not isinstance(header, dict):
        raise AdapterError(f"{file}: safetensors header must be a JSON object")
    count = len(header) - ("__metadata__" in header)
    if count > max_tensors:
        raise AdapterError(f"{file}: {count} tensors is above the limit of {max_tensors}")
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _ST_DTYPES:
            dtype = info.get("dtype") if isinstance(info, dict) else None
            raise AdapterError(
                f"{file}: tensor {key!r} has dtype {dtype!r}; LoRA weights must be floating point"
            )


def _checked_values(file: Path, tensors: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Every tensor finite and within +-MAX_LORA_WEIGHT (AdapterError naming the key), checked a stack of same-shaped
    tensors at a time; returns each as fp32 (contiguous) and the largest row sum of its absolute values."""
    groups: dict[tuple, list[str]] = {}
    for key, t in tensors.items():
        groups.setdefault((tuple(t.shape), t.dtype), []).append(key)
    floats, row_sums = {}, {}
    for keys in groups.values():
        stack = torch.stack([tensors[k] for k in keys])
        finite = torch.isfinite(stack).flatten(1).all(1).tolist()
        peaks = (
            stack.abs().flatten(1).amax(1).tolist()
        )  # in the file's dtype: F64 past fp32's range is caught here
        for key, ok, peak in zip(keys, finite, peaks, strict=True):
            if not ok:
                raise AdapterError(f"{file}: key {key!r} has non-finite values (NaN or inf)")
            if peak > MAX_LORA_WEIGHT:
                raise AdapterError(
                    f"{file}: key {key!r} has values up to {peak:g}; LoRA weights must be within "
                    f"+-{MAX_LORA_WEIGHT:g} (trained ones are ~1e-3 to ~1e1)"
                )
        stack = stack.float()
        for key, t, rows in zip(keys, stack, stack.abs().sum(2).amax(1).tolist(), strict=True):
            floats[key], row_sums[key] = t, rows
    return floats, row_sums


def load_adapter(
    path: str | Path,
    base: ModelConfig,
    *,
    max_rank: int = 64,
    name: str | None = None,
    max_file_bytes: int = 2 << 30,
    max_tensors: int = 8192,
    max_header_bytes: int = 16 << 20,
) -> LoRAAdapter:
    """Load and validate a PEFT LoRA adapter directory for `base`; tensors come back float32 on CPU."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterError(f"adapter directory {str(path)!r} does not exist")
    cfg_file, file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not file.is_file():
        if (path / "adapter_model.bin").is_file():
            raise AdapterError(
                f"{path / 'adapter_model.bin'}: pickled checkpoints are refused (loading them can run code); "
                f"convert it to {WEIGHTS_FILE}, e.g. save_file(torch.load(bin, weights_only=True), safetensors) "
                "or PeftModel.save_pretrained(..., safe_serialization=True)"
            )
        raise AdapterError(f"{file}: missing; a PEFT LoRA adapter needs {WEIGHTS_FILE}")
    cfg, selection = read_config(path)
    linears = base_modules(base)
    _check_safetensors_header(file, max_file_bytes, max_tensors, max_header_bytes)
    moe = base.is_moe
    if moe and any(
        targeted(selection, module_name(i, m)) for i in range(base.num_hidden_layers) for m in _MLP_MODULES
    ):
        raise AdapterError(
            f"{cfg_file}: target_modules {brief(cfg.get('target_modules'))}: {_MOE_MLP_REFUSAL}"
        )

    # Map every key to (layer, module, A|B); anything else is refused with the reason.
    factors: dict[tuple[int, str], dict[str, str]] = {}
    base_layers: list[
        str
    ] = []  # the embedding's and the head's own weights (PEFT saves them): the base model's
    try:
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                if "lora_magnitude_vector" in key:
                    raise AdapterError(f"{file}: key {key!r} is a DoRA magnitude; DoRA is not supported")
                if (special := _MODEL_KEY_RE.fullmatch(key)) is not None:
                    module = special["embed"] or special["head"]
                    slot = factors.setdefault((0, module), {})
                    ab = special["eab"] or special["hab"]
                    if ab in slot:
                        raise AdapterError(
                            f"{file}: key {key!r}: duplicate lora_{ab} for {MODEL_MODULES[module]}"
                        )
                    slot[ab] = key
                    continue
                if _BASE_LAYER_RE.fullmatch(key) is not None:
                    base_layers.append(key)
                    continue
                if moe and (".mlp." in key or ".block_sparse_moe." in key):
                    raise AdapterError(f"{file}: key {key!r}: {_MOE_MLP_REFUSAL}")
                m = _KEY_RE.fullmatch(key)
                if m is None:
                    raise AdapterError(f"{file}: key {key!r} maps to no LoRA layer/module of the base model")
                layer, module = int(m["layer"]), m["module"]
                if layer >= base.num_hidden_layers:
                    raise AdapterError(
                        f"{file}: key {key!r}: layer {layer} is out of range; "
                        f"the base model has {base.num_hidden_layers} layers"
                    )
                if module not in linears or MODULE_PARENT[module] != m["parent"]:
                    raise AdapterError(
                        f"{file}: key {key!r}: unknown module {m['parent']}.{module}; "
                        f"LoRA applies to {', '.join(linears)}"
                    )
                slot = factors.setdefault((layer, module), {})
                if m["ab"] in slot:
                    raise AdapterError(
                        f"{file}: key {key!r}: duplicate lora_{m['ab']} for layer {layer} {module}"
                    )
                slot[m["ab"]] = key
            for key in base_layers:  # the base model's own weights: only their shape is checked
                want = (base.vocab_size, base.hidden_size)
                if tuple(f.get_slice(key).get_shape()) != want:
                    raise AdapterError(
                        f"{file}: key {key!r} has shape {list(f.get_slice(key).get_shape())}, the base model's is "
                        f"{list(want)}; adapters for a resized vocabulary are not supported"
                    )
            tensors = {k: f.get_tensor(k) for k in keys if k not in base_layers}
    except AdapterError:
        raise
    except Exception as e:  # safetensors' own structural checks (offsets, sizes)
        raise AdapterError(f"{file}: not a valid safetensors file ({e})") from None

    # The config's targets must be exactly the modules that have weights.
    layers = range(base.num_hidden_layers)
    expected = {(i, mod) for i in layers for mod in linears if targeted(selection, module_name(i, mod))}
    expected |= {(0, mod) for mod, name in MODEL_MODULES.items() if targeted(selection, name)}
    if not expected:
        raise AdapterError(
            f"{cfg_file}: target_modules {brief(cfg.get('target_modules'))} selects no module of the base model"
        )
    if extra := sorted(factors.keys() - expected):
        raise AdapterError(
            f"{file}: has weights for {module_name(*extra[0])}, which target_modules in {CONFIG_FILE} does not select"
        )
    if missing := sorted(expected - factors.keys()):
        raise AdapterError(
            f"{file}: no lora_A/lora_B weights for {module_name(*missing[0])}, which {CONFIG_FILE} targets"
        )

    # Shapes and scales module by module; then the values, all tensors of a shape at once (an adapter is ~100 of
    # them: per-tensor checks would cost more than reading the file).
    modules = []
    for (layer, module), ab in sorted(factors.items()):
        mname = module_name(layer, module)
        for have, missing in (("A", "B"), ("B", "A")):
            if missing not in ab:
                raise AdapterError(f"{file}: key {ab[have]!r} has no matching lora_{missing} for {mname}")
        r = selection.rank_pattern.get(mname, cfg["r"])
        alpha = selection.alpha_pattern.get(mname, cfg["lora_alpha"])
        if r > max_rank:
            raise AdapterError(
                f"{cfg_file}: rank {r} of {mname} is above this server's max LoRA rank {max_rank}"
            )
        n_in, n_out = module_shape(base, module)
        for key, want in ((ab["A"], (r, n_in)), (ab["B"], (n_out, r))):
            if tuple(tensors[key].shape) != want:
                raise AdapterError(
                    f"{file}: key {key!r} has shape {list(tensors[key].shape)}, expected {list(want)} "
                    f"(rank {r} from {CONFIG_FILE}, {module} is {n_in} -> {n_out} in the base model)"
                )
        rslora = bool(cfg.get("use_rslora"))
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        if not scale <= MAX_LORA_SCALE:
            raise AdapterError(
                f"{cfg_file}: {mname}: scale {scale:g} (alpha {alpha:g} / {'sqrt(r)' if rslora else 'r'} {r}) "
                f"is above the limit of {MAX_LORA_SCALE:g}"
            )
        modules.append((layer, module, mname, ab["A"], ab["B"], scale))
    floats, row_sums = _checked_values(file, {k: tensors[k] for m in modules for k in m[3:5]})
    # A base whose weights carry a constant scale (Granite's multipliers, folded in as they load): its deltas too.
    folded = base.weight_scales
    weights = {}
    for layer, module, mname, a_key, b_key, scale in modules:
        gain = scale * row_sums[b_key] * row_sums[a_key]
        if not gain <= MAX_DELTA_GAIN:
            raise AdapterError(
                f"{file}: {mname}: the weight delta B @ A * scale amplifies an input up to {gain:.3g}-fold "
                f"(scale x max row sum of |B| x max row sum of |A|), above the limit of {MAX_DELTA_GAIN:g}"
            )
        A, B = floats[a_key], floats[b_key]
        if module in FUSED_MODULES:  # B's rows split as the base's weight is; each part shares A
            parts = FUSED_MODULES[module]
            for part, rows in zip(parts, B.split([module_shape(base, p)[1] for p in parts]), strict=True):
                weights[(layer, part)] = (A, rows.contiguous(), float(scale) * folded.get(part, 1.0))
        else:
            weights[(layer, module)] = (A, B, float(scale) * folded.get(module, 1.0))
    rank = max(A.shape[0] for A, _, _ in weights.values())
    return LoRAAdapter(name=name or path.name, rank=rank, weights=weights)
