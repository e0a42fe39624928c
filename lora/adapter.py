"""PEFT LoRA adapters: load `adapter_config.json` + `adapter_model.safetensors` and validate them strictly.

An adapter is untrusted tenant input: every refusal is an `AdapterError` whose message names the file and
the key or field to fix. What loads is exactly what PEFT would apply: per (layer, module) the factors
A [r, in] and B [out, r] and the scale alpha/r (alpha/sqrt(r) with rsLoRA), so that the weight delta
is `B @ A * scale`.
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

from lora.base_shape import BaseShape

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {m: "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp" for m in TARGET_MODULES}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")  # PEFT's default for the Llama family when target_modules is null

# Config fields that change what the adapter computes beyond y += B A x * scale: refuse when set.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) is not supported; merge the adapter or retrain as plain LoRA",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "trainable_token_indices": "trainable_token_indices (embedding updates) is not supported",
    "arrow_config": "arrow_config (adapter routing) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "use_bdlora": "BD-LoRA (use_bdlora) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
}
_ST_DTYPES = {"F64", "F32", "F16", "BF16"}
# PEFT key: [base_model.model.]model.layers.{i}.{parent}.{module}.lora_{A|B}[.{adapter name}].weight
_KEY_RE = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>\w+)\.(?P<module>\w+)"
    r"\.lora_(?P<ab>[AB])(?:\.[\w.-]+)?\.weight"
)


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file and the key or field to fix."""


class AdapterTooLarge(AdapterError):
    """An adapter (or one of its files) above a size limit: HTTP 413 rather than 400."""


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


def module_shape(base: BaseShape, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder layer's linear module."""
    h, q, kv = (
        base.hidden_size,
        base.num_attention_heads * base.head_dim,
        base.num_key_value_heads * base.head_dim,
    )
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, base.intermediate_size),
        "up_proj": (h, base.intermediate_size),
        "down_proj": (base.intermediate_size, h),
    }
    if module not in shapes:
        raise AdapterError(f"unknown module {module!r}; LoRA applies to {', '.join(TARGET_MODULES)}")
    return shapes[module]


def _module_name(layer: int, module: str) -> str:
    """The module's name inside the HF model, as PEFT matches target_modules against it."""
    return f"model.layers.{layer}.{_PARENT[module]}.{module}"


def _layer_of(name: str, layers_pattern) -> int | None:
    """PEFT's layer index of a module name: the first numbered segment (after `layers_pattern` if given)."""
    patterns = [layers_pattern] if isinstance(layers_pattern, str) else (layers_pattern or [None])
    for p in patterns:
        m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." if p else r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        if m:
            return int(m["idx"])
    return None


def _targeted(cfg: dict, name: str) -> bool:
    """PEFT's check_target_module_exists for one module name of the base model."""
    exclude = cfg.get("exclude_modules")
    if isinstance(exclude, str) and re.fullmatch(exclude, name):
        return False
    if isinstance(exclude, list) and (name in exclude or any(name.endswith(f".{e}") for e in exclude)):
        return False
    targets = cfg["target_modules"]
    if isinstance(targets, str) and targets.lower() == "all-linear":  # PEFT: all linears but the output head
        return name.rsplit(".", 1)[-1] in TARGET_MODULES
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    if not (name in targets or any(name.endswith(f".{t}") for t in targets)):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    idx = _layer_of(name, cfg.get("layers_pattern"))
    return idx is not None and (idx == layers if isinstance(layers, int) else idx in layers)


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's get_pattern_key: the first pattern that matches a suffix of the module name wins."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{file}: missing; a PEFT LoRA adapter needs {CONFIG_FILE}")
    if file.stat().st_size > 1 << 20:
        raise AdapterError(f"{file}: larger than 1 MiB")
    try:
        cfg = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{file}: must be a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(f"{file}: peft_type is {cfg.get('peft_type')!r}; motet serves only LORA adapters")
    for field, reason in _UNSUPPORTED.items():
        if cfg.get(field):
            raise AdapterError(f"{file}: {reason}")
    if cfg.get("modules_to_save"):
        raise AdapterError(
            f"{file}: modules_to_save {cfg['modules_to_save']!r} is not supported "
            "(the adapter would replace base model modules)"
        )
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias {cfg['bias']!r} is not supported; only 'none'")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError(f"{file}: fan_in_fan_out=true (Conv1D weights) is not supported for Llama models")

    def positive(field, value, integer):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0) or integer and not isinstance(value, int):
            raise AdapterError(
                f"{file}: {field} must be a positive {'integer' if integer else 'number'}, got {value!r}"
            )

    positive("r", cfg.setdefault("r", 8), True)
    positive("lora_alpha", cfg.setdefault("lora_alpha", 8), False)
    for field in ("rank_pattern", "alpha_pattern"):
        patterns = cfg.get(field) or {}
        if not isinstance(patterns, dict):
            raise AdapterError(f"{file}: {field} must be an object")
        for key, value in patterns.items():
            positive(f"{field}[{key!r}]", value, field == "rank_pattern")
            try:
                re.compile(key)
            except re.error as e:
                raise AdapterError(f"{file}: {field} key {key!r} is not a valid regex ({e})") from None

    targets = cfg.get("target_modules")
    if targets is None:
        targets = list(PEFT_DEFAULT_TARGETS)
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise AdapterError(f"{file}: target_modules {targets!r} is not a valid regex ({e})") from None
    elif not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise AdapterError(f"{file}: target_modules must be a list of module names or a regex string")
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (
        isinstance(layers, int) or isinstance(layers, list) and all(isinstance(i, int) for i in layers)
    ):
        raise AdapterError(f"{file}: layers_to_transform must be an int or a list of ints")
    exclude = cfg.get("exclude_modules")
    if exclude is not None and not isinstance(exclude, str | list):
        raise AdapterError(f"{file}: exclude_modules must be a list of module names or a regex string")
    return {**cfg, "target_modules": targets}


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
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterError(f"{file}: safetensors header is not valid JSON ({e})") from None
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


def load_adapter(
    path: str | Path,
    base: BaseShape,
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
    cfg = _read_config(path)
    _check_safetensors_header(file, max_file_bytes, max_tensors, max_header_bytes)

    # Map every key to (layer, module, A|B); anything else is refused with the reason.
    factors: dict[tuple[int, str], dict[str, str]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                if "lora_magnitude_vector" in key:
                    raise AdapterError(f"{file}: key {key!r} is a DoRA magnitude; DoRA is not supported")
                if "embed_tokens" in key or "lora_embedding" in key:
                    raise AdapterError(f"{file}: key {key!r}: LoRA on embeddings is not supported")
                if "lm_head" in key:
                    raise AdapterError(f"{file}: key {key!r}: LoRA on lm_head is not supported")
                m = _KEY_RE.fullmatch(key)
                if m is None:
                    raise AdapterError(f"{file}: key {key!r} maps to no LoRA layer/module of the base model")
                layer, module = int(m["layer"]), m["module"]
                if layer >= base.num_hidden_layers:
                    raise AdapterError(
                        f"{file}: key {key!r}: layer {layer} is out of range; "
                        f"the base model has {base.num_hidden_layers} layers"
                    )
                if _PARENT.get(module) != m["parent"]:
                    raise AdapterError(
                        f"{file}: key {key!r}: unknown module {m['parent']}.{module}; "
                        f"LoRA applies to {', '.join(TARGET_MODULES)}"
                    )
                slot = factors.setdefault((layer, module), {})
                if m["ab"] in slot:
                    raise AdapterError(
                        f"{file}: key {key!r}: duplicate lora_{m['ab']} for layer {layer} {module}"
                    )
                slot[m["ab"]] = key
            tensors = {k: f.get_tensor(k) for k in keys}
    except AdapterError:
        raise
    except Exception as e:  # safetensors' own structural checks (offsets, sizes)
        raise AdapterError(f"{file}: not a valid safetensors file ({e})") from None

    # The config's targets must be exactly the modules that have weights.
    for special in ("lm_head", "model.embed_tokens"):
        if _targeted(cfg, special):
            raise AdapterError(f"{cfg_file}: target_modules selects {special}; LoRA on it is not supported")
    layers = range(base.num_hidden_layers)
    expected = {(i, mod) for i in layers for mod in TARGET_MODULES if _targeted(cfg, _module_name(i, mod))}
    if not expected:
        raise AdapterError(
            f"{cfg_file}: target_modules {cfg['target_modules']!r} selects no module of the base model"
        )
    if extra := sorted(factors.keys() - expected):
        raise AdapterError(
            f"{file}: has weights for {_module_name(*extra[0])}, which target_modules in {CONFIG_FILE} does not select"
        )
    if missing := sorted(expected - factors.keys()):
        raise AdapterError(
            f"{file}: no lora_A/lora_B weights for {_module_name(*missing[0])}, which {CONFIG_FILE} targets"
        )

    weights = {}
    for (layer, module), ab in sorted(factors.items()):
        mname = _module_name(layer, module)
        for have, missing in (("A", "B"), ("B", "A")):
            if missing not in ab:
                raise AdapterError(f"{file}: key {ab[have]!r} has no matching lora_{missing} for {mname}")
        r = _pattern_value(cfg.get("rank_pattern") or {}, mname, cfg["r"])
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, mname, cfg["lora_alpha"])
        if r > max_rank:
            raise AdapterError(
                f"{cfg_file}: rank {r} of {mname} is above this server's max LoRA rank {max_rank}"
            )
        n_in, n_out = module_shape(base, module)
        A, B = tensors[ab["A"]], tensors[ab["B"]]
        for key, t, want in ((ab["A"], A, (r, n_in)), (ab["B"], B, (n_out, r))):
            if tuple(t.shape) != want:
                raise AdapterError(
                    f"{file}: key {key!r} has shape {list(t.shape)}, expected {list(want)} "
                    f"(rank {r} from {CONFIG_FILE}, {module} is {n_in} -> {n_out} in the base model)"
                )
            if not torch.isfinite(t).all():
                raise AdapterError(f"{file}: key {key!r} has non-finite values (NaN or inf)")
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights[(layer, module)] = (A.float().contiguous(), B.float().contiguous(), float(scale))
    rank = max(A.shape[0] for A, _, _ in weights.values())
    return LoRAAdapter(name=name or path.name, rank=rank, weights=weights)
