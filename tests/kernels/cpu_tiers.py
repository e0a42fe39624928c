"""The native CPU kernels' instruction-set tiers as test parameters: every tier this CPU runs, each forced as
`MOTET_CPU_ISA` would force it; a tier the CPU cannot run is skipped with the flags it lacks (never left out)."""

from __future__ import annotations

import pytest

from motet.kernels import cpu_isa, cpu_native

TIERS = [
    pytest.param(
        t.name,
        id=t.name,
        marks=pytest.mark.skipif(
            bool(cpu_isa.missing(t)), reason=f"tier {t.name}: this CPU lacks {', '.join(cpu_isa.missing(t))}"
        ),
    )
    for t in cpu_isa.TIERS
]


def use_tier(monkeypatch: pytest.MonkeyPatch, name: str):
    """Force tier `name` for the rest of the test (the monkeypatch undoes it; call `reset` after)."""
    monkeypatch.setenv(cpu_isa.ENV, name)
    cpu_isa.selected.cache_clear()
    assert cpu_native.isa() == name


def reset() -> None:
    cpu_isa.selected.cache_clear()


def ref_activations(x, w_dtype):
    """x as the running tier multiplies it with weights of `w_dtype` (bf16-rounded, or as it is)."""
    import torch

    return x.bfloat16().to(x.dtype) if w_dtype == torch.bfloat16 and cpu_native.bf16_activations() else x
