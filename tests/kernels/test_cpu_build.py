"""The native CPU kernels build wherever a C++ compiler is: a source that fails to compile must fail the suite,
not turn every native test into a skip (their skip reads "no C++ compiler")."""

import pytest

from motet.kernels import cpu_isa, cpu_native


def test_the_kernels_build_where_a_compiler_is():
    compiler = cpu_native.compiler()
    if compiler is None or not cpu_native.enabled():
        pytest.skip("no C++ compiler (or MOTET_CPU_KERNELS=0): the torch references serve")
    tier = cpu_isa.BY_NAME[cpu_native.isa()]
    assert cpu_native._build(compiler, tier).exists()  # raises with the compiler's errors
    assert cpu_native.library() is not None


def test_builders_starting_together_compile_once(tmp_path, monkeypatch):
    """Builders of one library starting together (a server's tensor-parallel ranks, test workers on a new
    machine) run the compiler once: the others wait for its build and load it."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    compiler = tmp_path / "c++"  # a compiler that takes a second, counting its runs, and writes its -o file
    compiler.write_text(
        f'#!/bin/sh\necho run >> "{calls}"\nsleep 1\n'
        'for a; do if [ "$prev" = -o ]; then : > "$a"; fi; prev=$a; done\n'
    )
    compiler.chmod(0o755)
    tier = cpu_isa.BY_NAME[cpu_native.isa()]
    with ThreadPoolExecutor(3) as pool:
        built = list(pool.map(lambda _: cpu_native._build(str(compiler), tier), range(3)))
    assert len(set(built)) == 1 and built[0].is_file()
    assert calls.read_text().split() == ["run"]
