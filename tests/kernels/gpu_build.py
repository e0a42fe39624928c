"""Triton kernels built for a GPU on a machine without one: triton's compiler and ptxas, as a launch builds them,
run in a child process without TRITON_INTERPRET, and cuobjdump's count of each build's registers and stack.
The tests that hold a kernel's build to no spills and no global scratch share this."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def cuobjdump() -> Path:
    """triton's own cuobjdump; the test is skipped where triton came without its NVIDIA toolchain."""
    import pytest
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        pytest.skip("triton without its NVIDIA toolchain")
    return path


def resource_usage(compiled, function: str) -> dict:
    """A compiled kernel's registers, stack (spills) and global scratch, from its cubin (in the child process,
    whose working directory is the test's own)."""
    Path("k.cubin").write_bytes(compiled.asm["cubin"])
    usage = subprocess.run(
        [str(cuobjdump()), "--dump-resource-usage", "k.cubin"], capture_output=True, text=True
    ).stdout
    fields = dict(f.split(":") for f in usage.split(f"Function {function}:")[1].split()[:3])
    scratch = getattr(compiled.metadata, "global_scratch_size", 0)
    return dict(regs=int(fields["REG"]), spill=int(fields["STACK"]), scratch=scratch)


def gpu_builds(script: str, cases: list, tmp_path: Path) -> list[dict]:
    """Run `script` (Python that reads the JSON `cases` from argv[1] and prints one JSON list of builds as its
    last line) in a child process that compiles for the GPU; its builds."""
    cuobjdump()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
