"""What a Hugging Face checkpoint declares of its quantization (GPTQ, AWQ: 4-bit; MXFP4 experts), read from its
config.json's `quantization_config` (or, as AutoGPTQ writes it, `quantize_config.json`) and checked against
`--quantization`: plain JSON, read before anything loads (and before torch is imported: `motet serve` checks it
before it binds its port). motet/engine/weights/quantized_checkpoint.py reads the weights it declares."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from motet.kernels.quant_names import BLOCK
from motet.models.config import read_json
from motet.models.declaration import ModelLoadError

CHECKPOINT_QUANTIZATIONS = ("gptq", "awq")  # the methods of the checkpoints served in their own 4-bit weights

AUTOGPTQ_CONFIG = "quantize_config.json"  # AutoGPTQ's own file, where config.json has no quantization_config
_GPTQ_FORMATS = {"gptq": True, "gptq_v2": False}  # checkpoint_format -> zeros stored minus one
_AWQ_VERSIONS = ("gemm",)
MXFP4 = "mxfp4"  # a checkpoint's experts in MXFP4, served in their blocks (no --quantization names it)
_SUPPORTED = (
    "motet serves 4-bit GPTQ (checkpoint_format gptq or gptq_v2) and AWQ (version gemm) checkpoints, "
    "MXFP4 experts (served in their blocks), and GGUF files with --quantization gguf"
)


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's declared quantization: its method ("gptq" | "awq" | "mxfp4"), group size (-1: one group per
    row), whether GPTQ's zeros are stored minus one (checkpoint format v1), and the file declaring it."""

    method: str
    group_size: int
    zeros_minus_one: bool
    source: str

    @property
    def served_quantized(self) -> bool:
        """Whether its weights are served in their own blocks (GPTQ's and AWQ's projections, MXFP4's experts)."""
        return True


def _read_config(model_dir: Path) -> tuple[dict, str] | None:
    config = model_dir / "config.json"
    if config.exists():
        found = read_json(config)  # (not an object: the model config's reader says so)
        found = found.get("quantization_config") if isinstance(found, dict) else None
        if found is not None:
            return found, f"{config} quantization_config"
    autogptq = model_dir / AUTOGPTQ_CONFIG
    if autogptq.exists():
        return read_json(autogptq), str(autogptq)
    return None


def _parse(cfg, source: str) -> CheckpointQuantization:
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{source}: expected a JSON object, got {cfg!r}")
    method = str(cfg.get("quant_method", "gptq" if source.endswith(AUTOGPTQ_CONFIG) else "")).lower()
    if method == MXFP4:
        keep = cfg.get("modules_to_not_convert")
        if keep is not None and not (isinstance(keep, list) and all(isinstance(m, str) for m in keep)):
            raise ModelLoadError(
                f"{source}: modules_to_not_convert must be a list of module names, got {keep!r}"
            )
        return CheckpointQuantization(MXFP4, 32, False, source)
    if method not in CHECKPOINT_QUANTIZATIONS:
        raise ModelLoadError(
            f"{source}: quant_method {cfg.get('quant_method')!r} is not supported; {_SUPPORTED}"
        )
    bits = cfg.get("bits", cfg.get("w_bit"))  # AutoAWQ's own keys: w_bit, q_group_size
    if bits != 4:
        raise ModelLoadError(f"{source}: {method} with bits {bits!r} is not supported; {_SUPPORTED}")
    group_size = cfg.get("group_size", cfg.get("q_group_size"))
    if (
        not isinstance(group_size, int)
        or isinstance(group_size, bool)
        or not (group_size == -1 or group_size > 0)
    ):
        raise ModelLoadError(f"{source}: group_size must be a positive integer or -1, got {group_size!r}")
    if group_size != -1 and group_size % BLOCK:
        raise ModelLoadError(
            f"{source}: group_size {group_size} is not supported: motet's int4 blocks take one scale per {BLOCK} "
            f"inputs, so a group must be a multiple of {BLOCK} (or -1, one group per row)"
        )
    zeros_minus_one = False
    if method == "gptq":
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        if cfg.get("is_marlin_format"):  # AutoGPTQ's flag for weights repacked for its Marlin kernel
            fmt = "marlin"
        if fmt not in _GPTQ_FORMATS:
            raise ModelLoadError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported; {_SUPPORTED}")
        pack_dtype = cfg.get("pack_dtype", "int32")
        if pack_dtype != "int32":
            raise ModelLoadError(
                f"{source}: GPTQ pack_dtype {pack_dtype!r}: motet reads int32-packed weights"
            )
        zeros_minus_one = _GPTQ_FORMATS[fmt]
    else:
        version = str(cfg.get("version", "gemm")).lower()
        if version not in _AWQ_VERSIONS:
            raise ModelLoadError(f"{source}: AWQ version {version!r} is not supported; {_SUPPORTED}")
        if cfg.get("zero_point", True) is not True:
            raise ModelLoadError(f"{source}: AWQ without zero points (zero_point false) is not supported")
    return CheckpointQuantization(method, group_size, zeros_minus_one, source)


def declared_quantization(model_dir: str | Path, requested: str | None) -> CheckpointQuantization | None:
    """The GPTQ / AWQ quantization `model_dir` declares (None: none), checked against `--quantization`
    (`requested`): none or the checkpoint's own method; ModelLoadError naming the conflict otherwise."""
    model_dir = Path(model_dir)
    found = _read_config(model_dir) if model_dir.is_dir() else None
    declared = _parse(*found) if found is not None else None
    if declared is None:
        if requested in CHECKPOINT_QUANTIZATIONS:
            raise ModelLoadError(
                f"--quantization {requested}: {model_dir} is not {'an' if requested == 'awq' else 'a'} "
                f"{requested.upper()} checkpoint (its config.json "
                f"has no quantization_config); serve it without --quantization, or with int8|int4"
            )
        return None
    if declared.method == MXFP4 and requested is not None:
        raise ModelLoadError(
            f"--quantization {requested}: {model_dir} is an MXFP4 checkpoint ({declared.source}), its experts "
            f"dequantized to --dtype as they load; drop --quantization"
        )
    if requested not in (None, declared.method):
        raise ModelLoadError(
            f"--quantization {requested}: {model_dir} is a {declared.method.upper()} checkpoint ({declared.source}), "
            f"served in its own 4-bit weights; drop --quantization (or pass --quantization {declared.method})"
        )
    return declared
