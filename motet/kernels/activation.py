"""The gated MLP's activations, act(gate) * up, by motet's names (`GATED`: their torch references, the model's
computation; the native CPU step's are motet/kernels/csrc's, cpu_native.ACTIVATIONS), and SwiGLU's, SiLU(gate) *
up, from the fused gate/up projection's output in one launch.

``gate_up [T, 2I]`` holds each row's gate in its first ``I`` columns and its up in the last ``I``. The torch
path splits it, applies SiLU (one kernel, rounded to the activations' dtype) and multiplies (a second); the
kernel reads both halves once and writes ``[T, I]``, computing in fp32 with the same rounding of SiLU's
output to the activations' dtype in between. ``silu_and_mul_reference`` defines the meaning (the model's
computation off CUDA); ``silu_and_mul`` is the Triton launch (CUDA, or CPU tensors under
``TRITON_INTERPRET=1``); ``applies`` says where the model uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from motet.kernels import triton_support

BLOCK = 1024  # columns per program

# act(gate) as transformers' ACT2FN computes it, by motet's name (ModelConfig.hidden_act, which
# motet/models/fields.py HIDDEN_ACTS reads config.json's names into)
GATED = {
    "silu": F.silu,
    "gelu": F.gelu,  # by the error function
    "gelu_tanh": lambda gate: F.gelu(gate, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda gate: F.relu(gate).square(),
}


def act_and_mul_reference(name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, act by its name in GATED."""
    return GATED[name](gate) * up


def applies(x: torch.Tensor) -> bool:
    """Whether the MLP's activation on `x` goes through `silu_and_mul` (CUDA, Triton installed)."""
    return triton_support.AVAILABLE and x.is_cuda


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return act_and_mul_reference("silu", gate, up)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul_reference` in one launch: a new [T, I] tensor in gate_up's dtype."""
    if not triton_support.AVAILABLE:
        raise RuntimeError("silu_and_mul needs triton")
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has {width} columns: gate and up halves need an even number")
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    block = min(BLOCK, triton_support.next_power_of_2(inter))
    _jit()._silu_and_mul_kernel[(rows, triton_support.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), gate_up.stride(1), inter, BLOCK=block, num_warps=max(1, block // 256)
    )
    return out


def _jit():
    """This module's Triton kernels (motet/kernels/jit/activation.py), imported at their first launch."""
    return triton_support.kernels(__name__)
