"""A parent for the tests' `motet serve` processes that has imported what a server imports, and forks one per server.

A server started as `python -m motet.api.cli serve` spends ~4.5 of its ~6 CPU-seconds to ready importing torch,
transformers (through xgrammar) and motet; the suite starts ~95 of them on 2 cores. Forked from this process, a
server runs the same `python -m motet.api.cli` module as `__main__` (runpy, as `-m` does) with its own argv,
environment, working directory and log, on its own port: only the imports are shared.

The tests' in-process engines' tensor-parallel ranks (motet/engine/worker/tp_rank.py) are forked from it too.

Protocol (one Unix-socket connection per process): the test sends one JSON line {module, argv, env, cwd, log,
new_session, stdin (base64)}; this process answers the child's pid on a line, then its exit code (Popen's: -N for
signal N) on a line when it exits. It exits, killing its children, when its stdin (a pipe from the test worker)
closes: a worker that dies leaves no server behind.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
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


def main(socket_path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import gc

    gc.freeze()  # the imported objects stay in pages the children share (a collection would touch them)
    request = serve(socket_path)  # returns in a forked child only
    run_server(request)


def serve(socket_path: str) -> dict:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler, so that the wakeup fd hears it)
    children: dict[int, socket.socket] = {}
    events = selectors.DefaultSelector()
    events.register(listener, selectors.EVENT_READ, "accept")
    events.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
    events.register(wake_r, selectors.EVENT_READ, "child")
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
            else:
                conn, _ = listener.accept()
                request = json.loads(conn.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:  # the server: none of this process's loop or descriptors
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    events.close()
                    listener.close()
                    for other in [*children.values(), conn]:
                        other.close()
                    return request
                conn.sendall(f"{pid}\n".encode())
                children[pid] = conn
        reap(children)


def reap(children: dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def run_server(request: dict) -> None:
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
    sys.argv = [request["module"], *request["argv"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    sys.exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
