"""KV tiers: the time to first token of a returning conversation whose KV blocks were evicted, recomputed vs
loaded from the host-RAM tier vs from the disk tier, and of a repeated system prompt after a restart.

    python -m benchmarks.kv_tiers [--history 4000] [--conversations 3] [--system-prompt 2000] [--threads 2]
                                  [--dtype float32] [--out DIR]

Returning conversations: --conversations histories of --history tokens each, on a KV cache that holds about
1.5 of them (so each conversation's blocks are evicted by the next ones). Each first turn runs once (16
output tokens) on an engine with both tiers; then each conversation returns with its history, its output and
a new 32-token user turn, and its TTFT is taken three ways, on the same prompts' lengths: from RAM (the same
engine: the blocks were evicted from the device, the RAM tier holds them), from disk (a new engine on the same
directory, no RAM tier, each entry's pages dropped from the OS page cache first: a cold read), and recomputed
(an engine without tiers). Each returning turn has its own new user turn, so only the history is cached.
System prompt: an engine with the disk tier serves a --system-prompt-token system prompt and a question, is
closed, and a new engine on the same directory serves it with another question: TTFT before and after, and the
tokens the restarted engine found cached. Offline engine (motet/engine/llm_engine.py), greedy, speculation off.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import write_report
from motet.engine.config import DEFAULT_DTYPE, EngineConfig
from motet.engine.core.block_manager import chain_block_hashes
from motet.engine.core.kv_blocks import KVLayout
from motet.engine.core.kv_tiers import KV_CACHE_SUBDIR
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.model_config import load_model_config
from motet.engine.weights.model_store import resolve_model
from motet.evals.serving_bench import machine

NEW_TURN = 32  # tokens of a returning conversation's new user turn
FIRST_OUTPUT = 16  # tokens a first turn generates (part of the history when it returns)


def engine(args, model_dir, num_blocks: int, **tiers) -> LLMEngine:
    """An engine, warmed up by a short request (its first step's one-time costs stay out of the figures)."""
    config = EngineConfig(
        model=str(model_dir),
        dtype=args.dtype,
        num_kv_blocks=num_blocks,
        num_threads=args.threads,
        speculative="off",
        **tiers,
    )
    e = LLMEngine(config, model_dir)
    run(e, random_ids(random.Random(2), 2 * NEW_TURN, e.model_config.vocab_size), 2)
    return e


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """`n` random token ids away from the vocabulary's ends (where the special tokens are); any ids do: the KV's
    cost does not depend on them."""
    margin = min(100, vocab // 8)
    return [rng.randrange(margin, vocab - margin) for _ in range(n)]


def run(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(TTFT in seconds, output tokens, cached prompt tokens) of one greedy request run alone."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    ttft, answers = None, RequestOutputs()
    while engine.has_unfinished():
        for out in answers.step(engine):
            if out.request_id == rid and out.num_new_tokens and ttft is None:
                ttft = time.perf_counter() - t0
            if out.request_id == rid and out.finished:
                return ttft, out.token_ids, out.num_cached_tokens
    raise RuntimeError("the request did not finish")


def on_device(engine: LLMEngine, prompt: list[int]) -> int:
    """Blocks of the prompt's prefix the device cache holds."""
    bs = engine.config.block_size
    hashes = chain_block_hashes(prompt, 0, 0, bs, len(prompt) - 1)
    return sum(h in engine.block_manager.cached for h in hashes)


def drop_page_cache(directory: Path) -> int:
    """Evict the entries' pages from the OS page cache (written back first), so their next read is from disk."""
    n = 0
    for path in directory.rglob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def tier_hits(engine: LLMEngine) -> dict[str, int]:
    return {t.tier: t.hit_tokens for t in engine.stats().kv_tiers}


def load_seconds(engine: LLMEngine) -> float:
    return sum(t.load_seconds_sum for t in engine.stats().kv_tiers)


def from_tier(engine: LLMEngine, prompt: list[int], tier: str) -> dict:
    """A returning request's TTFT and cached prompt tokens, with the tokens `tier` served and the seconds its
    loads took (the engine's counters before and after)."""
    before, load_before = tier_hits(engine), load_seconds(engine)
    ttft, _, cached = run(engine, prompt, 1)
    return {
        "ttft_s": ttft,
        "cached_tokens": cached,
        f"{tier}_hit_tokens": tier_hits(engine)[tier] - before[tier],
        "load_s": load_seconds(engine) - load_before,
    }


def close(engine: LLMEngine) -> None:
    engine.close()
    del engine
    gc.collect()


def returning_conversations(args, model_dir, data_dir: Path) -> dict:
    rng = random.Random(0)
    bs = EngineConfig.block_size
    vocab = load_model_config(model_dir).vocab_size

    def tokens(n):
        return random_ids(rng, n, vocab)

    histories = [tokens(args.history) for _ in range(args.conversations)]
    turns = {mode: [tokens(NEW_TURN) for _ in histories] for mode in ("ram", "disk", "recompute")}
    # A KV cache a little larger than one conversation: with three or more, each conversation's blocks are all
    # evicted by the two that run between it and its return.
    num_blocks = int(1.25 * (args.history + FIRST_OUTPUT + NEW_TURN) / bs) + 1
    tiers = {"kv_offload_gb": args.ram_gb, "kv_disk_gb": args.disk_gb, "kv_disk_dir": str(data_dir)}

    both = engine(args, model_dir, num_blocks, **tiers)
    layout = KVLayout.of(both.runner.kv_caches)
    first_ttft, returning = [], []
    for h in histories:
        ttft, out, _ = run(both, h, FIRST_OUTPUT)
        first_ttft.append(ttft)
        returning.append(h + out[:-1])  # the output's last token has no KV yet: the new turn follows it
    both.kv_connector.flush()
    rows = {"ram": [], "disk": [], "recompute": []}
    for i, history in enumerate(returning):
        prompt = history + turns["ram"][i]
        device_blocks = on_device(both, prompt)  # 0: all evicted
        rows["ram"].append(from_tier(both, prompt, "ram") | {"device_blocks": device_blocks})
    close(both)

    disk = engine(args, model_dir, num_blocks, kv_disk_gb=args.disk_gb, kv_disk_dir=str(data_dir))
    for i, history in enumerate(returning):
        dropped = drop_page_cache(data_dir)
        rows["disk"].append(
            from_tier(disk, history + turns["disk"][i], "disk") | {"entries_uncached": dropped}
        )
    close(disk)

    off = engine(args, model_dir, num_blocks)
    for i, history in enumerate(returning):
        ttft, _, cached = run(off, history + turns["recompute"][i], 1)
        rows["recompute"].append({"ttft_s": ttft, "cached_tokens": cached})
    close(off)

    p50 = {mode: statistics.median(r["ttft_s"] for r in rs) for mode, rs in rows.items()}
    return {
        "history_tokens": args.history,
        "returning_prompt_tokens": len(returning[0]) + NEW_TURN,
        "conversations": args.conversations,
        "kv_cache_blocks": num_blocks,
        "block_size": bs,
        "kv_bytes_per_token": layout.block_bytes // bs,
        "first_turn_ttft_s": first_ttft,
        "rows": rows,
        "ttft_p50_s": p50,
        "ttft_max_s": {mode: max(r["ttft_s"] for r in rs) for mode, rs in rows.items()},
        "speedup_ram": p50["recompute"] / p50["ram"],
        "speedup_disk": p50["recompute"] / p50["disk"],
    }


def restarted_system_prompt(args, model_dir, data_dir: Path) -> dict:
    rng = random.Random(1)
    vocab = load_model_config(model_dir).vocab_size
    system = random_ids(rng, args.system_prompt, vocab)
    questions = [random_ids(rng, NEW_TURN, vocab) for _ in range(2)]
    num_blocks = 2 * (args.system_prompt + NEW_TURN) // EngineConfig.block_size + 1
    tiers = {"kv_disk_gb": args.disk_gb, "kv_disk_dir": str(data_dir)}
    first = engine(args, model_dir, num_blocks, **tiers)
    cold_ttft, _, cold_cached = run(first, system + questions[0], 1)
    close(first)
    restarted = engine(args, model_dir, num_blocks, **tiers)
    dropped = drop_page_cache(data_dir)
    before = tier_hits(restarted)["disk"]  # (its warm-up request's blocks came from disk too)
    ttft, _, cached = run(restarted, system + questions[1], 1)
    hits = tier_hits(restarted)["disk"] - before
    close(restarted)
    return {
        "system_prompt_tokens": args.system_prompt,
        "before_restart": {"ttft_s": cold_ttft, "cached_tokens": cold_cached},
        "after_restart": {
            "ttft_s": ttft,
            "cached_tokens": cached,
            "disk_hit_tokens": hits,
            "entries_uncached": dropped,
        },
        "speedup": cold_ttft / ttft,
    }


def summary_md(report: dict) -> str:
    conv, sysp = report["conversations"], report["system_prompt"]
    p50 = conv["ttft_p50_s"]
    lines = [
        f"# KV tiers ({report['model']}, {report['dtype']}, {report['threads']} threads; {report['machine']})",
        "",
        f"Returning conversations: {conv['conversations']} histories of {conv['history_tokens']} tokens "
        f"(returning prompts of {conv['returning_prompt_tokens']} tokens, {conv['kv_bytes_per_token'] / 1e3:.0f} KB "
        f"of KV per token) on a KV cache of {conv['kv_cache_blocks']} blocks of {conv['block_size']} tokens.",
        "",
        "| served from | TTFT p50 (s) | TTFT max (s) | cached tokens | vs recompute |",
        "|---|---|---|---|---|",
    ]
    for mode in ("recompute", "ram", "disk"):
        cached = statistics.median(r["cached_tokens"] for r in conv["rows"][mode])
        lines.append(
            f"| {mode} | {p50[mode]:.3f} | {conv['ttft_max_s'][mode]:.3f} | {cached:.0f} | "
            f"{p50['recompute'] / p50[mode]:.1f}x |"
        )
    lines += [
        "",
        f"System prompt of {sysp['system_prompt_tokens']} tokens after a restart: TTFT "
        f"{sysp['before_restart']['ttft_s']:.3f} s before (recomputed), {sysp['after_restart']['ttft_s']:.3f} s "
        f"after ({sysp['after_restart']['cached_tokens']} tokens cached, "
        f"{sysp['after_restart']['disk_hit_tokens']} from disk): {sysp['speedup']:.1f}x.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default=DEFAULT_DTYPE)
    ap.add_argument("--history", type=int, default=4000, help="tokens of each conversation's history")
    ap.add_argument("--conversations", type=int, default=3, help="at least 3")
    ap.add_argument("--system-prompt", type=int, default=2000, help="tokens of the repeated system prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ram-gb", type=float, default=2.0, help="the RAM tier's size")
    ap.add_argument("--disk-gb", type=float, default=4.0, help="the disk tier's size")
    ap.add_argument(
        "--data-dir", default=None, help="where the disk tier goes (default: a temporary directory)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.conversations < 3:
        ap.error(
            "--conversations must be >= 3 (fewer leave some of each conversation's blocks on the device)"
        )
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="motet-kv-bench-", dir=args.data_dir) as tmp:
        conversations = returning_conversations(
            args, model_dir, Path(tmp) / "conversations" / KV_CACHE_SUBDIR
        )
        system_prompt = restarted_system_prompt(args, model_dir, Path(tmp) / "system" / KV_CACHE_SUBDIR)
    report = {
        "model": model_dir.name,
        "dtype": args.dtype,
        "threads": args.threads,
        "machine": machine(),
        "conversations": conversations,
        "system_prompt": system_prompt,
    }
    out = Path(args.out or f"benchmarks/reports/kv_tiers/{time.strftime('%Y%m%d-%H%M%S')}")
    write_report(out, report, summary_md(report))


if __name__ == "__main__":
    main()
