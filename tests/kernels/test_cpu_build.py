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
