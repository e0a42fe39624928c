"""How much memory the KV cache gets from `--gpu-memory-utilization` (vLLM's flag): a share of the device's
memory that the weights, a step's activations, the LoRA slots and the KV cache share.

On CUDA the share is of the device's total memory, as vLLM reads it, and that much must be free when the
engine starts; on CPU it is of the host memory available at start-up (MemAvailable), since a host is
shared with everything else it runs. The weights are measured once loaded; a step's activations and the
LoRA slots (allocated with the first adapter) are estimated from the shapes. `--num-kv-blocks` wins over
this, and this over `--kv-cache-memory-gb`; with neither of the two, CUDA takes this path with vLLM's default
share and a CPU a fixed size (`EngineConfig.memory_utilization`).
"""

from __future__ import annotations

import os

import torch

from motet.engine.config import CUDA_GPU_MEMORY_UTILIZATION, EngineConfig, ModelConfig, ModelLoadError
from motet.engine.model import Linear
from motet.lora.peft_format import TARGET_MODULES, module_shape


def memory_budget(fraction: float, device: torch.device) -> int:
    """The bytes `fraction` stands for, read before the weights are loaded."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
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
        return torch.cuda.memory_allocated(device)
    tensors = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    quantized = [m.quantized for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    return tensors + sum(q.nbytes for q in quantized)


def step_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """An estimate of a step's largest activations: one layer's intermediates for the step's tokens, and the
    fp32 logits (with the sampler's copies) of every row that samples, drafts included."""
    elem = torch.tensor([], dtype=dtype).element_size()
    q_kv = (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim
    per_token = 4 * model.hidden_size + 3 * model.intermediate_size + q_kv
    rows = config.max_num_seqs * (1 + config.num_speculative_tokens)
    return config.step_tokens * per_token * elem + 4 * rows * model.vocab_size * 4


def lora_slot_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """The device's LoRA stacks: every target module of every layer, `max_loras` slots of `max_lora_rank`."""
    elem = torch.tensor([], dtype=dtype).element_size()
    per_layer = sum(sum(module_shape(model, m)) for m in TARGET_MODULES)
    return model.num_hidden_layers * config.max_loras * config.max_lora_rank * per_layer * elem


def kv_cache_bytes(
    budget: int, used: int, config: EngineConfig, model: ModelConfig, dtype: torch.dtype
) -> int:
    """What is left of `budget` for the KV cache once the weights (`used`), a step and the LoRA slots have
    theirs; ModelLoadError when that is nothing."""
    rest = budget - used - step_bytes(config, model, dtype) - lora_slot_bytes(config, model, dtype)
    if rest <= 0:
        raise ModelLoadError(
            f"--gpu-memory-utilization {config.memory_utilization:g} ({budget / 2**30:.2f} GiB) leaves no "
            f"memory for the KV cache after the weights ({used / 2**30:.2f} GiB), a step's activations and the "
            "LoRA slots; raise it, or lower --max-num-batched-tokens, --max-loras or --max-lora-rank"
        )
    return rest
