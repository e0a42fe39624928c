"""How much memory the KV cache and the adapters' pool get: from `--gpu-memory-utilization` (vLLM's flag), a
share of the device's memory that the weights, a step's activations, the adapters' pool and the KV cache share.

On CUDA the share is of the device's total memory, as vLLM reads it, and that much must be free when the
engine starts; on CPU it is of the host memory available at start-up (MemAvailable), since a host is
shared with everything else it runs. The weights are measured once loaded; a step's activations are estimated
from the shapes; the adapters' pool takes `adapter_memory_fraction` of what is left (or `adapter_memory_gb`), the
KV cache the rest. `--num-kv-blocks` wins over this, and this over `--kv-cache-memory-gb`; with neither of the
two, CUDA takes this path with vLLM's default share and a CPU a fixed size (`EngineConfig.memory_utilization`).
Without a share, the pool takes its fraction of the host memory available at start-up on a CPU, of the device's
free memory once the KV cache is allocated on CUDA.

`check_fits` runs before anything loads (`motet serve` calls it before it binds its port): this module imports
torch and the model's modules only where a function reads a device or a loaded model.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from motet.engine.config import CUDA_GPU_MEMORY_UTILIZATION, MIN_MODEL_LEN, EngineConfig, context_length
from motet.models.config import ModelConfig
from motet.models.declaration import ModelLoadError

if TYPE_CHECKING:
    import torch

    from motet.kernels.quant import QuantizedWeight


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    """A block's bytes over all layers: per token what the declaration's layers keep (ModelConfig.cache_layout),
    each value `dtype_bytes` (the cache's dtype's itemsize)."""
    return cfg.kv_elements_per_token * block_size * dtype_bytes


def check_fits(config: EngineConfig, model: ModelConfig) -> int:
    """The context length, once what the flags ask of the model and the memory is checked against them, before
    anything loads (a ModelLoadError naming the flag, instead of an allocator's error once the server has
    started): `--max-model-len` within the model's positions; a KV cache (`--num-kv-blocks`, or
    `--kv-cache-memory-gb`) holding at least MIN_MODEL_LEN tokens; and the KV cache, the adapters' pool
    (`--adapter-memory-gb`) and the KV RAM tier (`--kv-offload-gb`) each within the memory there is (on a CPU
    the host's available memory, on CUDA the device's)."""
    max_len = context_length(model, config.max_model_len)
    on_host = config.device_type == "cpu"
    host = available_host_memory()
    device_total = host if on_host else _device_memory(config.torch_device)[1]
    where = "this host's available memory" if on_host else "the device's memory"
    ranks = config.tensor_parallel_size  # (the KV cache's memory is per rank; on CUDA each rank has a device)
    per_rank = model.cache_layout.rank_share(1 / ranks)  # a rank's share of a block
    block = kv_block_bytes(model, config.block_size, config.dtype_bytes) * per_rank
    asked: list[tuple[str, float, int]] = []  # (the flag as given, bytes, the room for them)
    if config.num_kv_blocks is not None:
        kv_flag = f"--num-kv-blocks {config.num_kv_blocks}"
        kv_bytes, kv_tokens = config.num_kv_blocks * block, config.num_kv_blocks * config.block_size
    elif config.memory_utilization is None:  # (a share of the memory is sized and checked by memory_budget)
        kv_flag = f"--kv-cache-memory-gb {config.kv_cache_gb:g}"
        kv_bytes = config.kv_cache_gb * 2**30
        kv_tokens = int(kv_bytes // block) * config.block_size
    else:
        kv_flag, kv_bytes, kv_tokens = "", 0, MIN_MODEL_LEN
    if kv_tokens < min(MIN_MODEL_LEN, max_len):
        raise ModelLoadError(
            f"{kv_flag} holds a KV cache of {kv_tokens} tokens (blocks of {config.block_size}), fewer than the "
            f"{MIN_MODEL_LEN} a request needs at least (a chat template and a short answer); give at least "
            f"{-(-MIN_MODEL_LEN // config.block_size)} blocks or {MIN_MODEL_LEN * block / config.block_size / 2**30:.3g} GiB"
        )
    if kv_flag:
        asked.append((kv_flag, kv_bytes * (ranks if on_host else 1), device_total))
    if config.adapter_memory_gb is not None:
        asked.append((f"--adapter-memory-gb {config.adapter_memory_gb:g}", config.adapter_memory_gb * 2**30,
                      device_total))  # fmt: skip
    if config.kv_offload_gb:
        asked.append((f"--kv-offload-gb {config.kv_offload_gb:g}", config.kv_offload_gb * 2**30, host))
    for flag, size, room in asked:
        if size > room:
            room_where = where if room == device_total else "this host's available memory"
            raise ModelLoadError(
                f"{flag} asks for {size / 2**30:.4g} GiB, more than {room_where} ({room / 2**30:.1f} GiB); "
                "lower it"
            )
    return max_len


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of zeros whose memory is taken as it is first written: an anonymous private mapping, whose
    pages read as zeros and take no memory until written (Linux, macOS), so a KV cache reserved at its size holds
    the memory of what fills it (as llama.cpp's). torch.zeros writes every page at once; torch.empty may hand back
    memory written before, which a cache must not read."""
    import math
    import mmap

    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)  # (the tensor keeps the mapping alive)


def _device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device."""
    import torch

    return torch.cuda.mem_get_info(device)


def memory_budget(fraction: float, device: torch.device) -> int:
    """The bytes `fraction` stands for, read before the weights are loaded."""
    if device.type == "cuda":
        free, total = _device_memory(device)
        budget = int(fraction * total)
        if free < budget:
            raise ModelLoadError(
                f"--gpu-memory-utilization {fraction:g} (on CUDA {CUDA_GPU_MEMORY_UTILIZATION:g} by default) asks "
                f"for {budget / 2**30:.1f} GiB of the device's {total / 2**30:.1f} GiB, but only "
                f"{free / 2**30:.1f} GiB are free; lower it, or size the KV cache with --kv-cache-memory-gb"
            )
        return budget
    return int(fraction * available_host_memory())


def available_host_memory() -> int:
    """The host memory a new allocation can have without swapping (Linux's MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def weights_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """What the loaded model holds on its device."""
    if device.type == "cuda":
        import torch

        return torch.cuda.memory_allocated(device)
    tensors = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return tensors + sum(q.nbytes for q in quantized_weights(model))


def quantized_weights(model: torch.nn.Module) -> list[QuantizedWeight]:
    """The weights the model holds in blocks: its quantized linear layers' and experts'."""
    from motet.engine.worker.layers import Linear
    from motet.engine.worker.model import Experts

    out = [m.quantized for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    return out + [q.weight for m in model.modules() if isinstance(m, Experts) for q in m.quantized.values()]


def weights_line(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """The start-up line on the weights' bytes: resident, and in `dtype` had the blocks been dequantized."""
    held = weights_bytes(model, device)
    quantized = quantized_weights(model)
    if not quantized:
        return f"weights: {_size(held)}"
    blocks = sum(q.nbytes for q in quantized)
    floats = sum(q.shape[0] * q.shape[1] for q in quantized) * dtype.itemsize
    formats = ", ".join(sorted({q.format.name for q in quantized}))
    return (
        f"weights: {_size(held)}, of which {_size(blocks)} in {formats} blocks ({_size(floats)} in "
        f"{str(dtype).removeprefix('torch.')}: {_size(held - blocks + floats)} in all, dequantized)"
    )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def step_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """An estimate of a step's largest activations: one layer's intermediates for the step's tokens, and the
    fp32 logits (with the sampler's copies) of every row that samples, drafts included."""
    elem = dtype.itemsize
    q_kv = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    per_token = 4 * model.hidden_size + 3 * model.intermediate_size + q_kv
    rows = config.max_num_seqs * (1 + config.num_speculative_tokens)
    return config.max_step_tokens * per_token * elem + 4 * rows * model.vocab_size * 4


def adapter_bytes(config: EngineConfig, device: torch.device, left: int | None = None) -> int:
    """The adapters' pool: `adapter_memory_gb`, else its fraction of `left` (what a memory share leaves for the
    KV cache and the pool), else of the host memory available now (a CPU) or of the device's free memory."""
    if config.adapter_memory_gb is not None:
        return int(config.adapter_memory_gb * 2**30)
    if left is None:
        left = available_host_memory() if device.type == "cpu" else _device_memory(device)[0]
    return int(config.adapter_memory_fraction * left)


def kv_cache_bytes(
    budget: int, used: int, config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> tuple[int, int]:
    """(KV cache, adapters' pool) bytes of `budget` once the weights (`used`) and a step have theirs;
    ModelLoadError when nothing is left for the KV cache."""
    left = budget - used - step_bytes(config, model, dtype)
    adapters = adapter_bytes(config, device, max(0, left))
    rest = left - adapters
    if rest <= 0:
        raise ModelLoadError(
            f"--gpu-memory-utilization {config.memory_utilization:g} ({budget / 2**30:.2f} GiB) leaves no "
            f"memory for the KV cache after the weights ({used / 2**30:.2f} GiB), a step's activations and the "
            f"adapters' pool ({adapters / 2**30:.2f} GiB); raise it, or lower --max-num-batched-tokens or "
            "--adapter-memory-gb"
        )
    return rest, adapters
