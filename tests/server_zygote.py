"""A parent for the tests' `motet serve` processes that has imported what a server imports, and forks one per server.

A server started as `python -m motet.api.cli serve` spends ~4.5 of its ~6 CPU-seconds to ready importing torch,
transformers (through xgrammar) and motet; the suite starts ~95 of them on 2 cores. Forked from this process, a
server runs the same `python -m motet.api.cli` module as `__main__` (runpy, as `-m` does) with its own argv,
environment, working directory and log, on its own port: only the imports are shared.

The tests' in-process engines' tensor-parallel ranks (motet/engine/worker/tp_rank.py) are forked from it too.

Its training branch: a child that has imported the fine-tuning libraries too (motet/training/preload.py: datasets,
PEFT, TRL; ~7 CPU-seconds), forked from it when a server first asks for it. A server the tests start with
`training_branch`, and the test process itself (tests/conftest.py), fork their fine-tuning fork server (multiprocessing's forkserver, motet/api/fine_tuning/workers.py)
from the branch instead of starting it as `python -c` (~10.5 CPU-seconds each, ~12 a run): the same
`multiprocessing.forkserver.main` with the server's listener, its alive pipe, its stdout and stderr at the same
descriptor numbers, its environment and directory. The fork server is then the branch's child, not the server's:
it still exits when the server's end of the alive pipe closes, and the jobs it forks with it.

Protocol (one Unix-socket connection per process): the client sends one byte carrying the descriptors the process is
to have (SCM_RIGHTS, none for most), then one JSON line {module, argv | exec, env, cwd, log, new_session, stdin
(base64), fds (the numbers the descriptors get), training_branch}; this process answers the child's pid on a line,
then its exit code (Popen's: -N for signal N) on a line when it exits. It exits, killing its children, when its
stdin (a pipe from the test worker) closes: a worker that dies leaves no server behind.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import tempfile

# What `motet serve` imports on its way to ready and while idle (its grammar vocabulary: transformers' tokenizer
# classes through xgrammar). Imported only: nothing here may run a torch op, start a thread or read a setting
# that a server's own environment could change (OpenMP's pool would not survive the fork).
PRELOAD = (
    "torch",
    "numpy",
    "transformers",
    "transformers.tokenization_utils_tokenizers",
    "transformers.convert_slow_tokenizer",
    "transformers.generation.logits_process",
    "xgrammar",
    "tokenizers",
    "safetensors.torch",
    "uvicorn",
    "starlette.applications",
    "prometheus_client",
    "motet.api.cli",
    "motet.api.server",
    "motet.api.app",
    "motet.actors.system",
    "motet.engine.llm_engine",
    "motet.engine.worker.model_runner",
    "motet.grammar.backend",
    "motet.models.llama",
    "motet.engine.worker.tp_rank",
)
# What the training branch imports besides: what multiprocessing's fork server of a server preloads
TRAINING_PRELOAD = "motet.training.preload"
FORK_SERVER_MAIN = "from multiprocessing.forkserver import main;"  # (its `python -c` command)

# The settings libraries read once, at import (torch's threads, the Hugging Face cache, Python's own): a process whose
# environment differs from the zygote's in one of these is not forked from it.
READ_AT_IMPORT = ("OMP_", "GOMP_", "KMP_", "MKL_", "PYTORCH_", "CUDA", "TRITON_", "HF_", "HUGGINGFACE",
                  "TRANSFORMERS_", "XDG_", "HOME", "PYTHON", "LD_", "TMP", "TEMP")  # fmt: skip
# ... but for these, which a library the worker imports sets in its environment and no server reads: lm_eval's import
# sets HF_XET_HIGH_PERFORMANCE (huggingface_hub's Xet downloads, which the tests' servers never make). A worker that
# had run an lm_eval test forked none of its later servers (run 17: ~30 of ~95 servers started fresh).
SET_BY_THE_WORKERS_IMPORTS = ("HF_XET_HIGH_PERFORMANCE",)


def forkable(env: dict, zygote_env: dict) -> bool:
    """Whether a process with `env` may be forked from a zygote started with `zygote_env`: none of the settings read
    at import differs (the rest, motet's own among them, are read when used)."""
    keys = {k for k in set(env) | set(zygote_env) if k.startswith(READ_AT_IMPORT)} - set(
        SET_BY_THE_WORKERS_IMPORTS
    )
    return all(env.get(k) == zygote_env.get(k) for k in keys)


class ForkedProcess:
    """A process this zygote forked, with the parts of subprocess.Popen's interface the tests use."""

    def __init__(self, conn: socket.socket, args: list[str]):
        self.args = args
        self._conn = conn
        self._lines = conn.makefile("rb")
        self.pid = int(self._lines.readline())
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_exit()
        return self.returncode

    def _read_exit(self) -> None:
        line = self._lines.readline()
        self.returncode = int(line) if line else -signal.SIGKILL  # (no line: the zygote itself died)
        self._lines.close()
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork(socket_path: str, request: dict, fds: list[int] = ()) -> ForkedProcess:
    """The process `request` asks of the zygote listening at `socket_path`, given `fds` (at the numbers in
    request["fds"])."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(socket_path)
    socket.send_fds(conn, [b"\0"], list(fds))
    conn.sendall(json.dumps(request).encode() + b"\n")
    return ForkedProcess(conn, [request.get("module") or "-c", *request.get("argv", [])])


def main(socket_path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import gc

    gc.freeze()  # the imported objects stay in pages the children share (a collection would touch them)
    zygote_env = dict(os.environ)
    request = serve(listening(socket_path), branch=listening(training_socket(socket_path)))
    if "branch" in request:  # (the training branch; it returns in a forked child only, as the zygote)
        importlib.import_module(TRAINING_PRELOAD)
        gc.freeze()
        request = serve(request["branch"], announce=False)
    install_descriptors(request)
    if "exec" in request:
        run_command(request)
    else:
        run_server(request, socket_path, zygote_env)


def training_socket(socket_path: str) -> str:
    return socket_path + "-training"


def listening(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    return listener


def serve(listener: socket.socket, branch: socket.socket | None = None, announce: bool = True) -> dict:
    """Forks a child for each request on `listener` and returns the request in it; forks the training branch on
    the first connection to `branch` (the branch serves it) and returns {"branch": branch} in it."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler, so that the wakeup fd hears it)
    children: dict[int, socket.socket | None] = {}
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ, "accept")
    events.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    events.register(wake_r, selectors.EVENT_READ, "child")
    if branch is not None:
        events.register(branch, selectors.EVENT_READ, "branch")

    def in_child(keep: socket.socket | None = None) -> None:  # none of this process's loop or descriptors
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (wake_r, wake_w):
            os.close(fd)
        events.close()
        for other in [listener, branch, *children.values()]:
            if other is not None and other is not keep:
                other.close()

    if announce:
        print("ready", flush=True)
    while True:
        for key, _ in events.select():
            if key.data == "stdin":
                if not os.read(sys.stdin.fileno(), 4096):  # the worker is gone
                    for pid in children:
                        os.kill(pid, signal.SIGKILL)
                    os._exit(0)
            elif key.data == "child":  # (reaped below)
                os.read(wake_r, 4096)
            elif key.data == "branch":  # (its first connection waits in the backlog for the branch)
                pid = os.fork()
                if pid == 0:
                    in_child(keep=branch)
                    return {"branch": branch}
                events.unregister(branch)
                branch.close()
                branch = None
                children[pid] = None
            else:
                conn, _ = listener.accept()
                _, fds, _, _ = socket.recv_fds(conn, 1, 16)
                request = json.loads(conn.makefile("rb").readline())
                request["received"] = fds
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    in_child()
                    return request
                for fd in fds:
                    os.close(fd)
                conn.sendall(f"{pid}\n".encode())
                children[pid] = conn
        reap(children)


def reap(children: dict[int, socket.socket | None]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def install_descriptors(request: dict) -> None:
    """The descriptors the request brought, at the numbers it names (each first moved above any of them)."""
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in request["received"]]
    for fd in request["received"]:
        os.close(fd)
    for fd, number in zip(moved, request.get("fds", []), strict=True):
        os.dup2(fd, number)
        os.close(fd)


def run_command(request: dict) -> None:
    """In the child: `python -c EXEC` with the request's environment and directory (the descriptors are in place)."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["-c"]
    exec(request["exec"], {"__name__": "__main__", "__builtins__": __builtins__})
    sys.exit(0)


def run_server(request: dict, socket_path: str, zygote_env: dict) -> None:
    """In the child: the test's environment and directory, its log as stdout and stderr (none: this process's
    stderr) and its stdin, then `python -m MODULE ARGV` (its `__main__` block too) and the interpreter's own exit
    (atexit, threads joined)."""
    from motet.parent_death import DIE_WITH_PARENT, die_with_current_parent

    die_with_current_parent()  # this process's parent, which dies with the worker
    if request["new_session"]:
        os.setsid()
    with tempfile.TemporaryFile() as stdin:
        stdin.write(base64.b64decode(request["stdin"]))
        stdin.seek(0)
        os.dup2(stdin.fileno(), 0)
    if request["log"] is not None:
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 2)
        os.close(log)
    os.dup2(2, 1)  # (never this process's stdout: the worker reads no more of it)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.pop(DIE_WITH_PARENT, None)  # (the harness named is the worker: this one's parent dies with it)
    os.chdir(request["cwd"])
    if request.get("training_branch"):
        import multiprocessing.forkserver
        import multiprocessing.util

        branch = training_socket(socket_path)
        spawn, forkserver_os = forking_from_the_branch(
            lambda env: branch if forkable(env, zygote_env) else None
        )
        multiprocessing.util.spawnv_passfds, multiprocessing.forkserver.os = spawn, forkserver_os
    sys.argv = [request["module"], *request["argv"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


def forking_from_the_branch(branch_for):
    """multiprocessing's fork server (motet/api/fine_tuning/workers.py) forked from the training branch that
    `branch_for(environment)` names (its socket; None: not from one, as where the environment differs in a
    setting read at import) instead of started as `python -c`: the replacements for util.spawnv_passfds, which
    forkserver.ensure_running calls, and for the forkserver module's `os`, whose waitpid (asking whether the fork
    server still runs) asks the branch's connection. The caller installs them."""
    import multiprocessing.util
    import types

    spawn = multiprocessing.util.spawnv_passfds
    forked: dict[int, ForkedProcess] = {}

    def spawnv_passfds(path, args, passfds):
        env = dict(os.environ)
        branch = branch_for(env) if args[-2:-1] == ["-c"] and args[-1].startswith(FORK_SERVER_MAIN) else None
        if branch is None:
            return spawn(path, args, passfds)
        numbers = [*passfds, 1, 2]  # (and this process's stdout and stderr, as a child of its would have)
        request = {"exec": args[-1], "env": env, "cwd": os.getcwd(), "fds": numbers}
        process = fork(branch, request, numbers)
        forked[process.pid] = process
        return process.pid

    def waitpid(pid, options):
        process = forked.get(pid)
        if process is None:
            return os.waitpid(pid, options)
        if options & os.WNOHANG and process.poll() is None:
            return 0, 0
        return pid, process.wait()  # (the status: only its being there is read)

    forkserver_os = types.ModuleType("os")
    forkserver_os.__dict__.update(vars(os))
    forkserver_os.waitpid = waitpid
    return spawnv_passfds, forkserver_os


if __name__ == "__main__":
    main(sys.argv[1])
