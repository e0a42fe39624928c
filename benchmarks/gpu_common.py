"""What the decode benchmarks on a GPU share: real architectures' shapes with random weights, the prompts, a
motet engine serving random adapters, kernel times from CUDA-graph replay, the device's copy bandwidth and the
bytes a decode step must read.

Random weights: decode speed does not depend on the values, equality with HF holds for any weights, and a
checkpoint built on the device needs no download (the GPU machine has no network). The tokenizer is a
word-level one with a word per id, so every id the model may emit detokenizes.
"""

from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Weights are drawn N(0, (INIT_GAIN / fan_in)^2): about HF's default 0.02 at 4096 wide, and logits spread far
# enough at the tiny shape that greedy choices are not near-ties (a near-tie flips on rounding, not a bug).
INIT_GAIN = 1.2


@dataclass(frozen=True)
class Shape:
    """A decoder's architecture: the HF config class and its fields (no weights)."""

    config_class: str  # a transformers config class: LlamaConfig, Qwen2Config
    fields: dict

    def hf_config(self):
        import transformers

        return getattr(transformers, self.config_class)(**self.fields)


def _rope(theta: float) -> dict:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}


# The published configs of the models named (their config.json), less the weights.
SHAPES = {
    "smollm2-135m": Shape("LlamaConfig", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, **_rope(100000.0))),
    "qwen2.5-1.5b": Shape("Qwen2Config", dict(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False, bos_token_id=151643, eos_token_id=151645, **_rope(1000000.0))),
    "llama-3-8b": Shape("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128009, **_rope(500000.0))),
    # A smoke test's model: two layers, seconds on a CPU.
    "tiny": Shape("LlamaConfig", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, **_rope(10000.0))),
}  # fmt: skip


def word_tokenizer(vocab_size: int, bos: int | None, eos: int | None):
    """A fast tokenizer with one word per id ("t0" .. "t{n-1}"): every id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"unk_token": "t0"}
    if bos is not None:
        special["bos_token"] = f"t{bos}"
    if eos is not None:
        special["eos_token"] = f"t{eos}"
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def random_checkpoint(shape: str, path: Path, dtype: torch.dtype, device: str, seed: int = 0):
    """Writes `shape` with random weights (and a word tokenizer) to `path` as a HF checkpoint; returns the
    HF model, in `dtype` on `device`, in eval mode (the same weights the directory holds)."""
    from transformers import AutoModelForCausalLM

    cfg = SHAPES[shape].hf_config()
    with torch.device(device):  # built where it runs: an 8B model never passes through host memory in fp32
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:  # projections and embeddings (norms stay 1)
                p.normal_(0.0, INIT_GAIN / math.sqrt(p.shape[1]), generator=g)
            elif name.endswith(".bias"):  # Qwen2's q/k/v biases: nonzero, so that they are read and checked
                p.normal_(0.0, 0.1, generator=g)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    word_tokenizer(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id).save_pretrained(path)
    eos = cfg.eos_token_id
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos, "bos_token_id": cfg.bos_token_id})
    )
    return model


def prompts(n: int, length: int = 32, vocab_size: int = 4100) -> list[list[int]]:
    """`n` distinct token-id prompts of `length` (ids 100 .. min(4100, vocab_size) - 1)."""
    span = min(4000, vocab_size - 100)
    return [[(i * 7 + j * 13) % span + 100 for j in range(length)] for i in range(n)]


def motet_engine(model_dir: Path, adapter_dir: Path, *, batch: int, adapters: int, rank: int = 16, **config):
    """A fresh LLMEngine for `batch` rows with `adapters` distinct random rank-`rank` adapters loaded (written
    under `adapter_dir` where not already there: the next engine reuses them); returns (engine, adapter
    names). `config`: further EngineConfig fields."""
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from motet.evals.lora_reference import write_random_adapter

    cfg = EngineConfig(model=str(model_dir), max_num_seqs=batch, max_loras=max(adapters, 1), max_lora_rank=rank,
                       **config)  # fmt: skip
    engine = LLMEngine(cfg, model_dir=model_dir)
    names = []
    for i in range(adapters):
        path = adapter_dir / f"a{i}_r{rank}"
        if not (path / "adapter_config.json").is_file():  # written last
            write_random_adapter(path, engine.model_config, rank, seed=i)
        names.append(engine.add_lora(f"a{i}", path))
    return engine, names


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    """Returns what the last model and engine held: Python's references, then the CUDA allocator's cache."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def graph_us(calls: list, replays: int = 20) -> float:
    """Microseconds per call: `calls` (closures) captured back to back in one CUDA graph, replayed (as the
    engine's decode replays them; eager launches of a ~10 us kernel time the host's launch path instead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles, cuBLAS heuristics) outside the capture
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (replays * len(calls))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a copy on `device`, each byte counted read and written: on CUDA a 1 GiB
    device-to-device copy replayed from a CUDA graph, on a CPU a timed 64 MiB copy."""
    if device.type == "cuda":
        nbytes = 2**30
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        us = graph_us([lambda: dst.copy_(src)] * 4, replays=10)
        return 2 * nbytes / (us * 1e-6)
    src = torch.empty(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: every parameter once (a tied lm_head is the embedding),
    less an untied input embedding, of which a step reads only its rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """Bytes of one token's keys and values over all layers (`model_config`: motet's ModelConfig)."""
    c = model_config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * torch.finfo(dtype).bits // 8


def adapter_bytes(model_config, rank: int, dtype: torch.dtype) -> int:
    """Bytes of one random adapter (motet/evals/lora_bench.py: all seven modules of every layer) in `dtype`."""
    from motet.lora.adapter import TARGET_MODULES, module_shape

    per_layer = sum(sum(module_shape(model_config, m)) for m in TARGET_MODULES)
    return model_config.num_hidden_layers * rank * per_layer * torch.finfo(dtype).bits // 8
