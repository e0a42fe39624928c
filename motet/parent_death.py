"""A child process that dies with the harness that started it (Linux's PR_SET_PDEATHSIG), set in the child.

The harness (motet/evals/server.py) names itself in the environment; the child (`motet serve`) sets its death
signal at start. Not in a preexec_fn: that makes the harness fork its whole address space instead of vfork, and a
large one (a test run's) can be refused by the kernel (ENOMEM)."""

from __future__ import annotations

import os
import signal
import sys

DIE_WITH_PARENT = "MOTET_DIE_WITH_PARENT"  # the harness's pid


def child_env() -> dict[str, str]:
    """The environment for a child that should die with this process."""
    return {**os.environ, DIE_WITH_PARENT: str(os.getpid())}


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In the child: `sig` when the harness dies, however it dies (Linux; elsewhere nothing). A process stopped
    (SIGSTOP) dies of SIGKILL only: the kernel keeps any other signal pending until it is continued."""
    parent = os.environ.pop(DIE_WITH_PARENT, None)  # (not inherited by this process's own children)
    if parent is not None:
        _death_signal(sig, int(parent))


def die_with_current_parent(sig: int = signal.SIGKILL) -> None:
    """In a child started without the harness's variable (a fork server's, a tensor-parallel rank): `sig` when the
    process that is its parent now dies (Linux; elsewhere nothing). A parent that is already init (pid 1) means the
    real one died first: the process exits."""
    parent = os.getppid()
    if parent == 1:
        os._exit(1)
    _death_signal(sig, parent)


def _death_signal(sig: int, parent: int) -> None:
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)
