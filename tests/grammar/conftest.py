"""What the grammar tests share."""

from __future__ import annotations

import pytest

import motet.grammar.cache as cache_mod
from tests.grammar.slow_backend import SlowBackend


@pytest.fixture
def slow_backend(monkeypatch):
    """The "slow" backend in the cache's registry, held until the test sets SlowBackend.release (or ends)."""
    monkeypatch.setitem(cache_mod.BACKENDS, "slow", (SlowBackend.__module__, SlowBackend.__name__))
    SlowBackend.release.clear()
    yield
    SlowBackend.release.set()
