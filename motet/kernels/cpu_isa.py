"""The instruction-set tiers of the native CPU kernels: each a build of the same sources with explicit flags.

A tier names the compiler flags its build gets and the CPU flags (as /proc/cpuinfo spells them) it needs. The
CPU's flags are read once; the highest tier they allow runs, or a lower one that `MOTET_CPU_ISA` names (to
test or compare a lower tier's kernels on a bigger CPU; a tier the CPU cannot run is refused with a warning).
The sources choose their kernels by the compiler's feature macros (`__AVX2__`, `__AVX512BF16__`,
`__AVX512VNNI__`), so a tier is nothing but its flags:

- `avx512bf16`: x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) with AVX512_BF16 and AVX512_VNNI (AMD Zen 4 and later, Intel
  Sapphire Rapids and later): bf16 weights through `vdpbf16ps`, the activations rounded to bf16 once per product
  (fp32 accumulation), int8 / int4 weights through `vpdpbusd`.
- `avx512vnni`: x86-64-v4 with AVX512_VNNI but no AVX512_BF16 (Intel Cascade Lake, Ice Lake): the int8 / int4
  products through `vpdpbusd`, bf16 weights widened to fp32 as on `avx2`.
- `avx2`: x86-64-v3 (AVX2, FMA, F16C, BMI1/2): fp32 FMA on bf16 weights widened in registers, int8 / int4 through
  `maddubs`; the kernels every x86 CPU of the last decade runs.
- `scalar`: no vector instructions named (the compiler's baseline for the machine): the portable loops.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("motet.kernels")

ENV = "MOTET_CPU_ISA"


@dataclass(frozen=True)
class Isa:
    name: str
    flags: tuple[str, ...]  # the compiler's
    needs: tuple[str, ...]  # the CPU's, as /proc/cpuinfo names them
    bf16_activations: bool = False  # bf16 weights multiply activations rounded to bf16 (else fp32 ones)


_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")  # x86-64-v3 (abm: lzcnt)
_V4 = (*_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")

# Highest first: the first one the CPU has runs.
TIERS = (
    Isa("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"), (*_V4, "avx512_bf16", "avx512_vnni"),
        bf16_activations=True),
    Isa("avx512vnni", ("-march=x86-64-v4", "-mavx512vnni"), (*_V4, "avx512_vnni")),
    Isa("avx2", ("-march=x86-64-v3",), _V3),
    Isa("scalar", ("-march=x86-64",) if platform.machine() in ("x86_64", "AMD64") else (), ()),
)  # fmt: skip
BY_NAME = {t.name: t for t in TIERS}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo has none: then only `scalar` runs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# The flags of a CPU that computes bf16 products natively (x86: AVX512_BF16's dot products or AMX's tiles;
# Arm: the BF16 extension), where bf16 weights are served at full speed.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def native_bf16() -> str | None:
    """The flag by which this CPU computes bf16 natively, or None."""
    return next((f for f in BF16_FLAGS if f in cpu_flags()), None)


def missing(tier: Isa) -> list[str]:
    """The CPU flags `tier` needs that this CPU lacks (none: it runs here)."""
    if tier.name != "scalar" and platform.machine() not in ("x86_64", "AMD64"):
        return ["x86_64"]
    have = cpu_flags()
    return [f for f in tier.needs if f not in have]


@functools.cache
def selected() -> Isa:
    """The tier that runs: the highest this CPU allows, or the lower one `MOTET_CPU_ISA` names."""
    best = next(t for t in TIERS if not missing(t))
    asked = os.environ.get(ENV, "").strip().lower()
    if not asked:
        return best
    tier = BY_NAME.get(asked)
    if tier is None:
        log.warning("%s=%s names no tier (%s): %s runs", ENV, asked, ", ".join(BY_NAME), best.name)
        return best
    if missing(tier):
        log.warning("%s=%s: this CPU lacks %s: %s runs", ENV, asked, ", ".join(missing(tier)), best.name)
        return best
    return tier
