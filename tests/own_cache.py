"""A test's own motet cache (MOTET_CACHE_DIR) that shares the machine's native CPU kernels: the test's derived
configs, tokenizers and weights stay its own, while the kernels, which such a test does not check, are not compiled
again for it (~20 s of a core each time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from motet.kernels import cpu_native


def own_cache(monkeypatch: pytest.MonkeyPatch, root: Path) -> Path:
    """MOTET_CACHE_DIR set to `root` (created), its kernels/ the cache's in use before; `root`."""
    kernels = cpu_native._cache_dir()
    kernels.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("MOTET_CACHE_DIR", str(root))
    return root
