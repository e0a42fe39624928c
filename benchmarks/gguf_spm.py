"""A SentencePiece GGUF file (`tokenizer.ggml.model` "llama": Gemma's, Llama 2's, Mistral 7B's, Phi-3's) served by motet
beside llama.cpp's server, in the formats users download: the same greedy text?

    python -m benchmarks.gguf_spm FILE.gguf [--types Q4_K_M Q5_K_M Q6_K Q8_0] [--max-tokens 48] [--threads 2]
                                            [--jobs 1] [--out DIR]

llama.cpp's `llama-server` and `llama-quantize` come from benchmarks/llamacpp.py's build (downloaded and built
once, with --jobs). Each type of --types is the file itself where its general.file_type is that type, else
`llama-quantize` writes it from the file (`--allow-requantize` from a quantized one: its blocks dequantized, then
quantized again in the type's mix). Each file is then served alone, by motet (`motet serve FILE.gguf`) and by
llama-server, one after the other, with the same 32 completion prompts sent one at a time (greedy, BOS added as the
file says, at most --max-tokens tokens, stopping at EOS as each server would): the prompts' token ids (/tokenize of
both) and the greedy texts are compared. Where the texts part, the report shows the first token where they do and
each server's top-two log-probability margin there (a near-tie, where the two engines' rounding picks differently,
shows as a small margin on both sides).

With --peer-url the peer is a server already running there, serving FILE as it is (nothing built or quantized, one
row, FILE's own type), asked through motet's API: another `motet serve` (the smoke test's, tests/benchmarks/).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import httpx

from benchmarks import write_report
from benchmarks.llamacpp import LlamaServer, cache_root, ensure_built, gguf_file_type, run
from benchmarks.peers import PEER_URL_HELP, RunningPeer, run_main
from motet.evals.server import ManagedServer
from motet.evals.serving_bench import machine

# llama-quantize's type names -> GGUF general.file_type (llama_ftype)
FILE_TYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7}
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Water boils at",
    "import numpy as np\n\n# Compute the mean of a list\n",
    "A haiku about autumn:\n",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "Les mathématiques sont",
    "Photosynthesis is the process by which",
    "SELECT name FROM users WHERE",
    "The quick brown fox",
    "In 1492, Christopher Columbus",
    "Q: What is 12 times 12?\nA:",
    "My favourite book is",
    "The theory of relativity states that",
    "<html>\n<head>\n  <title>",
    "Ingredients for pancakes:\n-",
    "The weather today is",
    "Der Hund läuft",
    "1, 2, 3, 5, 8, 13,",
    "The meaning of life is",
    "Dear hiring manager,\n\n",
    "Shakespeare wrote",
    "東京は",
    "The most important thing about machine learning is",
    "class Stack:\n    def __init__(self):\n",
    "A good night's sleep helps",
    "The Pacific Ocean",
    "Here is a list of fruits: apples, bananas,",
    "In summary, the results show that",
]


def quantized(src: Path, path: Path, qtype: str, out_dir: Path) -> Path:
    """`path` itself where it is of `qtype`, else llama-quantize's `qtype` of it (cached in out_dir)."""
    if gguf_file_type(path) == FILE_TYPES[qtype]:
        return path
    out = out_dir / f"{path.stem}-{qtype}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        run([src / "build" / "bin" / "llama-quantize", "--allow-requantize", path, tmp, qtype], quiet=True)
        tmp.rename(out)
    return out


def motet_answer(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> dict:
    """motet's greedy completion: its text, token ids, and the top-two log-probabilities at each token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
            "return_token_ids": True}  # fmt: skip
    r = http.post("/v1/completions", json=body)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    tops = [sorted(d.values(), reverse=True) for d in choice["logprobs"]["top_logprobs"]]
    return {"text": choice["text"], "ids": choice["token_ids"], "top2": [t[:2] for t in tops]}


def llama_answer(http: httpx.Client, prompt: str, max_tokens: int) -> dict:
    """llama-server's greedy completion (its native /completion, the prompt cache off: every prompt evaluated
    whole, as motet's first request of it is)."""
    body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "n_probs": 2, "return_tokens": True,
            "cache_prompt": False}  # fmt: skip
    r = http.post("/completion", json=body)
    r.raise_for_status()
    out = r.json()
    tops = [
        sorted((t["logprob"] for t in p["top_logprobs"]), reverse=True)
        for p in out["completion_probabilities"]
    ]
    return {"text": out["content"], "ids": out["tokens"], "top2": [t[:2] for t in tops]}


def tokenize(http: httpx.Client, llama: bool, model: str, prompt: str) -> list[int]:
    if llama:
        r = http.post("/tokenize", json={"content": prompt, "add_special": True, "parse_special": True})
    else:
        r = http.post("/tokenize", json={"model": model, "prompt": prompt})
    r.raise_for_status()
    return r.json()["tokens"]


def margin(top2: list[list[float]], i: int) -> float | None:
    return top2[i][0] - top2[i][1] if i < len(top2) and len(top2[i]) == 2 else None


def compare(motet: dict, llama: dict) -> dict:
    """Whether two answers' texts are equal; where not, the first token where they part and each side's margin."""
    row = {"equal": motet["text"] == llama["text"]}
    if not row["equal"]:
        a, b = motet["ids"], llama["ids"]
        i = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
        row |= {"first_diff": i, "motet_token": a[i] if i < len(a) else None, "llama_token": b[i] if i < len(b) else None,
                "motet_margin": margin(motet["top2"], i), "llama_margin": margin(llama["top2"], i)}  # fmt: skip
    return row


def serve_and_ask(server, llama: bool, model: str, max_tokens: int) -> tuple[list[dict], list[list[int]]]:
    """Every prompt's token ids and greedy answer from `server` (llama-server's API where `llama`, else motet's)."""
    with server, httpx.Client(base_url=server.url, timeout=600) as http:
        ids = [tokenize(http, llama, model, p) for p in PROMPTS]
        ask = (
            (lambda p: llama_answer(http, p, max_tokens))
            if llama
            else (lambda p: motet_answer(http, model, p, max_tokens))
        )
        return [ask(p) for p in PROMPTS], ids


def summary_md(report: dict) -> str:
    lines = [f"# motet vs llama.cpp's server on a SentencePiece GGUF file ({Path(report['source']).name})", "",
             f"{len(PROMPTS)} completion prompts, greedy, at most {report['max_tokens']} tokens, one at a time; "
             f"{report['threads']} threads each; motet's activations in {report.get('dtype', 'auto')}; the peer: "
             f"{report['peer']}.", "",
             "| type | file | prompts tokenized alike | greedy texts equal | parting at (token: motet margin / llama.cpp margin, nats) |",
             "|---|---|---:|---:|---|"]  # fmt: skip
    for t in report["types"]:
        parts = [f"{r['first_diff']}: {r['motet_margin']:.3f} / {r['llama_margin']:.3f}" if r["motet_margin"] is not None
                 and r["llama_margin"] is not None else f"{r.get('first_diff')}" for r in t["rows"] if not r["equal"]]  # fmt: skip
        equal = sum(r["equal"] for r in t["rows"])
        lines.append(f"| {t['type']} | {Path(t['file']).name} | {t['tokenized_alike']}/{len(PROMPTS)} | "
                     f"{equal}/{len(PROMPTS)} ({100 * equal / len(PROMPTS):.0f}%) | {'; '.join(parts) or '-'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path, help="a GGUF file with a SentencePiece vocabulary")
    ap.add_argument("--types", nargs="+", default=list(FILE_TYPES), choices=list(FILE_TYPES))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="each server's compute threads")
    ap.add_argument(
        "--dtype",
        default="float32",
        help="motet's activations' dtype (llama.cpp's CPU path computes "
        "its activations in float32, quantized to 8 bits a block for each product)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="parallel jobs for llama.cpp's build")
    ap.add_argument("--peer-url", default=None, help=PEER_URL_HELP + " (see above)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    root = cache_root()
    source = args.file.resolve()
    src = None if args.peer_url else ensure_built(root, args.jobs, ("llama-server", "llama-quantize"))
    out = Path(args.out or f"benchmarks/reports/gguf_spm/{time.strftime('%Y-%m-%d')}")
    report = {"source": str(source), "max_tokens": args.max_tokens, "threads": args.threads, "dtype": args.dtype,
              "peer": args.peer_url or "llama-server", "machine": machine(), "types": []}  # fmt: skip
    own = {v: k for k, v in FILE_TYPES.items()}.get(gguf_file_type(source), "as is")
    for qtype in [own] if args.peer_url else args.types:
        path = source if args.peer_url else quantized(src, source, qtype, root)
        print(f"{qtype}: {path}", flush=True)
        motet = ManagedServer(["--model", str(path), "--threads", str(args.threads), "--max-num-seqs", "4",
                               "--max-model-len", "1024", "--dtype", args.dtype],
                              log_path=out / f"motet-{qtype}.log")  # fmt: skip
        ours, our_ids = serve_and_ask(motet, False, path.stem, args.max_tokens)
        if args.peer_url:
            theirs, their_ids = serve_and_ask(RunningPeer(args.peer_url), False, path.stem, args.max_tokens)
        else:
            peer = LlamaServer(src, path, args.threads, 1, 1024, [], out / f"llama-server-{qtype}.log")
            theirs, their_ids = serve_and_ask(peer, True, path.stem, args.max_tokens)
        rows = [compare(a, b) | {"prompt": p, "motet": a["text"], "llama.cpp": b["text"]}
                for p, a, b in zip(PROMPTS, ours, theirs, strict=True)]  # fmt: skip
        alike = sum(a == b for a, b in zip(our_ids, their_ids, strict=True))
        report["types"].append({"type": qtype, "file": str(path), "tokenized_alike": alike, "rows": rows})
        print(f"{qtype}: tokenized alike {alike}/{len(PROMPTS)}, texts equal "
              f"{sum(r['equal'] for r in rows)}/{len(PROMPTS)}", flush=True)  # fmt: skip
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    run_main(main)
