"""Model and engine configuration: plain dataclasses, validated on construction.

Nothing here imports torch at module level: the flags' parser takes its defaults from `EngineConfig`, and
`motet serve` builds and checks one before it binds its port, in well under a second (a device named `cpu`, or
`auto` where this torch build has no GPU, is known without asking torch; the torch objects are read on use:
`torch_device`, `torch_dtype`).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from motet.engine.core.fairness import check_tenant_weights
from motet.engine.weights.gguf_model import is_gguf_file
from motet.engine.weights.quantization_config import CHECKPOINT_QUANTIZATIONS
from motet.grammar.specs import BACKEND_NAMES as GRAMMAR_BACKENDS
from motet.grammar.specs import DEFAULT_BACKEND as DEFAULT_GRAMMAR_BACKEND
from motet.kernels.quant_names import QUANTIZE_FORMATS
from motet.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

# The default step budgets (EngineConfig.max_num_batched_tokens). On the 2-core CPU machine a prompt token costs
# no more in a 256-token step than in a 2048-token one (6.3 against 7.4 ms, one thread), so the smaller step
# loses no throughput, and it bounds how long a request arriving meanwhile waits for the step in flight
# (benchmarks/tenant_fairness.py: another tenant's TTFT under a burst).
CPU_STEP_TOKENS = 256
CUDA_STEP_TOKENS = 2048
# The most a CPU step grows to while prompts wait (EngineConfig.max_step_tokens): 8 tokens for each running row
# (motet/engine/core/step_budget.py), so from 32 rows on; 1,024 at 128 rows.
CPU_MAX_STEP_TOKENS = 1024
# The default TPOT targets of latency isolation (EngineConfig.tpot_target_ms). A CPU step is compute-bound (its time
# grows with its tokens), so every row that yields buys a light tenant time and costs the heavy one throughput.
# On the 2-core machine (benchmarks/tenant_fairness.py, 2026-11-25, a 160-request burst beside a light tenant's
# 16-token requests): off, the light E2E p50 / p99 were 15x / 35x its time alone and the burst kept 96% of its
# tokens/s; 60 ms: 3.0x / 6.5x and 86% (a second run: 2.5x / 5.9x and 80%); 40 ms: 1.3x / 3.4x and 62%; 25 ms (an
# earlier rule for who is light): 1.4x at p50 and 62%. 60 ms keeps the burst's throughput near the 85% the
# operator was promised.
CPU_TPOT_TARGET_MS = 60.0
CUDA_TPOT_TARGET_MS = 50.0
# The KV cache's size where neither --num-kv-blocks, --gpu-memory-utilization nor --kv-cache-memory-gb says: on
# CUDA, as vLLM, what is left of this share of the device's memory once the weights, a step's activations and
# the adapters' pool have theirs (motet/engine/worker/memory.py): the GPU serves nothing else; on a CPU, whose memory the
# host shares with everything else it runs, a fixed size.
CUDA_GPU_MEMORY_UTILIZATION = 0.9
CPU_KV_CACHE_MEMORY_GB = 1.0
WEIGHTS_CACHE_GB = 16.0  # the prepared-weights cache's default bound (EngineConfig.weights_cache_gb)
SPECULATIVE_MODES = ("auto", "off", "ngram")
OVERLAP_MODES = ("auto", "on", "off")
# --quantization: a block format to quantize a float checkpoint into, "gguf": the model directory's GGUF file
# served in its own blocks (motet/engine/weights/gguf_weights.py), or the method of a checkpoint quantized by GPTQ or
# AWQ (motet/engine/weights/quantized_checkpoint.py; such a checkpoint is served in its own 4-bit weights without it).
GGUF_QUANTIZATION = "gguf"
QUANTIZATIONS = (*QUANTIZE_FORMATS, GGUF_QUANTIZATION, *CHECKPOINT_QUANTIZATIONS)


# The devices motet runs on (EngineConfig.device, --device): "auto" (cuda where torch sees a GPU, else cpu), cpu,
# cuda or cuda:N.
DEVICE_TYPES = ("cpu", "cuda")


def checked_device(name: str) -> torch.device:
    """The torch device `name` names, where this machine and this torch build have it; ValueError saying why
    not (an unknown device, CUDA not in this torch build or not seen, no such device index)."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise ValueError(
            f"unknown device {name!r:.60}: motet runs on auto (cuda where available, else cpu), cpu, cuda or cuda:N"
        )
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise ValueError(
                f"{name}: CUDA is not available in this torch build (torch {torch.__version__}, built without "
                "CUDA); use cpu, or install a CUDA build of torch"
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(
                f"{name}: torch {torch.__version__} sees no CUDA device on this machine; use cpu"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{name}: no such device index: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    return device


def device_type(name: str) -> str:
    """The type ("cpu", "cuda") of the device `name` names, checked as `checked_device` checks it; known without
    importing torch where it is `cpu`, or `auto` and the installed torch has no GPU build."""
    if name == "cpu" or (name == "auto" and not _torch_may_see_a_gpu()):
        return "cpu"
    return checked_device(name).type


def _torch_may_see_a_gpu() -> bool:
    """False where the installed torch cannot see a GPU, read from its package's metadata without importing it: a
    CPU wheel (its version's local label `+cpu`), or a macOS build (no CUDA there). Once torch is imported, or
    where the metadata cannot tell, True: torch is asked (`checked_device`)."""
    if "torch" in sys.modules:
        return True
    if sys.platform == "darwin":
        return False
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return True
    return "+cpu" not in version


# --dtype's names -> the torch dtype's name (EngineConfig.torch_dtype), and its bytes per value
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
AUTO_DTYPE = "auto"  # as vLLM's: `auto_dtype` picks one of DTYPES for the device
# What an engine loads in unless told: EngineConfig's default, so LLM's and every `motet` command's `--dtype`.
DEFAULT_DTYPE = AUTO_DTYPE


def auto_dtype(device: torch.device | str) -> tuple[str, str]:
    """vLLM's `--dtype auto` for `device` (a torch device or its name: cpu, cuda, cuda:N): (dtype, why). bfloat16
    where the hardware computes it natively (a CUDA GPU that supports it; a CPU with AVX512_BF16, AMX or Arm's
    BF16, whose kernels then run at about twice float32's speed: docs/cpu.md), float32 elsewhere (bf16 weights
    would be widened to fp32 for every product)."""
    if str(device).partition(":")[0] == "cuda":
        import torch

        if torch.cuda.is_bf16_supported():
            return "bfloat16", "this GPU computes bf16"
        return "float32", "this GPU does not compute bf16"
    from motet.kernels.cpu_isa import native_bf16

    flag = native_bf16()
    if flag is not None:
        return "bfloat16", f"this CPU computes bf16 ({flag})"
    return "float32", "this CPU has no native bf16 (avx512_bf16, amx_bf16)"


def loaded_dtype(config: EngineConfig, asked: str, option: str = "--dtype {}") -> str:
    """The dtype `config` loads in, for a start-up line; with why, where `asked` (the dtype the caller was given)
    is AUTO_DTYPE, and how to ask for the other (`option`: how the caller's users set it, `--dtype {}` or
    `dtype="{}"`)."""
    if asked != AUTO_DTYPE:
        return config.dtype
    other = "float32" if config.dtype == "bfloat16" else "bfloat16"
    why = auto_dtype(config.device_type)[1]
    return f"{config.dtype} ({option.format(AUTO_DTYPE)}: {why}; {option.format(other)} for {other})"


# --max-model-len's floor, and the fewest tokens a KV cache may hold (motet/engine/worker/memory.py `check_fits`):
# a chat request's template and a short answer (SmolLM2's template with its default system prompt is 30 tokens).
MIN_MODEL_LEN = 64
MAX_BLOCK_SIZE = 256  # tokens per KV block: vLLM's largest
_STRETCHED_ROPES = ("linear", "dynamic", "yarn")  # a rope scaling whose factor stretches the stated positions


def model_positions(model: ModelConfig) -> int:
    """The longest context the model's positions reach, as vLLM derives it: max_position_embeddings, times the
    factor of a rope scaling that stretches it (YaRN's from its original length); llama3's and longrope's
    configs state the stretched length already."""
    scaling = model.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
    if kind not in _STRETCHED_ROPES or not factor:
        return model.max_position_embeddings
    base = model.max_position_embeddings
    if kind == "yarn":
        base = scaling.get("original_max_position_embeddings") or base
    return max(model.max_position_embeddings, int(base * factor))


def context_length(model: ModelConfig, max_model_len: int | None) -> int:
    """The longest sequence an engine serves: `max_model_len`, or else the model's positions (past a sliding
    window too: those layers keep only their window, motet/engine/core/kv_window.py). A `max_model_len` past
    the model's positions is refused, as vLLM refuses it: the model was never trained there (and
    `--max-model-len 10000000000` once died allocating a 80 GB rotary table)."""
    positions = model_positions(model)
    if max_model_len is not None and max_model_len > positions:
        raise ValueError(
            f"--max-model-len {max_model_len} is more than the model's {positions} positions (config.json's "
            f"max_position_embeddings{' and rope_scaling' if positions != model.max_position_embeddings else ''});"
            f" give at most {positions}, or leave it out"
        )
    return max_model_len or model.max_position_embeddings


# From this many cores on, serving keeps one for the event loop (HTTP, tokenizing, detokenizing): there it
# costs the forward little. Below, the forward needs every core: on 2 cores one compute thread serves 1.5-1.8x
# fewer tokens/s than two at 1 to 64 clients (benchmarks/reports/threads/).
RESERVE_CORE_FROM = 8


def default_cpu_threads(replicas: int = 1) -> int:
    """Compute threads per replica when --threads is not given: the cores this process may run on, all but
    one on a machine with RESERVE_CORE_FROM or more, shared by the replicas."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    usable = cores - 1 if cores >= RESERVE_CORE_FROM else cores
    return max(1, usable // replicas)


# The files one of which a tokenizer directory holds (what AutoTokenizer reads: a fast tokenizer's, SentencePiece's,
# a byte-level BPE's vocabulary)
TOKENIZER_DIR_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_tokenizer_dir(path: str) -> str:
    """`--tokenizer`'s directory as an absolute path, or ValueError naming the flag: none there, or no tokenizer in it."""
    where = Path(path).expanduser()
    if not where.is_dir():
        raise ValueError(
            f"--tokenizer {path}: no such directory (it names a Hugging Face tokenizer's directory)"
        )
    if not any((where / name).is_file() for name in TOKENIZER_DIR_FILES):
        raise ValueError(
            f"--tokenizer {path}: no tokenizer in that directory (none of {', '.join(TOKENIZER_DIR_FILES)})"
        )
    return str(where.resolve())


@dataclass
class EngineConfig:
    """Limits of one engine instance; defaults suit the default model on a small CPU machine."""

    model: str = "SmolLM2-135M-Instruct"
    # vLLM's --tokenizer: a directory whose Hugging Face tokenizer (and its chat template) serves the model instead
    # of the model's own (a GGUF file's, derived from its metadata, or the checkpoint directory's). None: the model's.
    tokenizer: str | None = None
    # One of DTYPES, or auto (DEFAULT_DTYPE): bfloat16 where the device computes it natively, else float32.
    dtype: str = field(default_factory=lambda: DEFAULT_DTYPE)
    # Quantized projections (the embedding table stays in `dtype`), one of QUANTIZATIONS: "int8" (Q8_0's
    # blocks) or "int4" (Q4_1's) quantize a float checkpoint's decoder projections on load, and its lm_head
    # into int8; "gguf" serves the directory's GGUF file in its own blocks, and is implied when `model` is a
    # .gguf file; "gptq" / "awq" name a GPTQ / AWQ checkpoint's own method (optional: such a checkpoint is
    # served 4-bit either way, and any other value conflicts). None: the checkpoint's weights.
    quantization: str | None = None
    device: str = "auto"  # "auto": cuda when available, else cpu; cpu, cuda or cuda:N (DEVICE_TYPES)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: from memory_utilization, or else kv_cache_gb
    # GiB for the KV cache; None: the device's default (memory_utilization on CUDA, CPU_KV_CACHE_MEMORY_GB on CPU).
    kv_cache_memory_gb: float | None = None
    # vLLM's share of the device's memory for weights, activations and KV cache (motet/engine/worker/memory.py); wins
    # over kv_cache_memory_gb. None: the device's default (memory_utilization).
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    # Tokens one step computes (decode rows, prompt chunks, drafts). None: CPU_STEP_TOKENS on a CPU, whose
    # step time grows with them (a 2048-token step takes seconds on 2 cores, and every request arriving
    # meanwhile waits for it: no latency target holds), CUDA_STEP_TOKENS on a GPU.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    # Prefix-cache blocks are shared only within a tenant by default (a hit is observable, so a shared block
    # would reveal another tenant's prompt); True shares base-model prefixes across tenants, as one trust
    # domain. A request's cache_salt separates further either way (block_manager.prefix_salt).
    shared_prefix_cache: bool = False
    # KV tiers past the device's cache (motet/engine/core/kv_connector.py): prefix-cache blocks are kept in host RAM
    # (an LRU of kv_offload_gb GiB) and on local disk under kv_disk_dir (kv_disk_gb GiB, checksummed, kept
    # across restarts), and a prefix the device no longer holds is loaded from them instead of recomputed.
    # 0: that tier is off (the default: both cost memory or disk the operator must grant).
    kv_offload_gb: float = 0.0
    kv_disk_gb: float = 0.0
    kv_disk_dir: str | None = None  # `motet serve`: <--data-dir>/kv-cache
    # A KV tier every replica reads and writes (motet/engine/core/kv_shared.py): a directory or fsspec URL, None: off;
    # this replica keeps the entries it knows of within kv_shared_gb GiB. Prefill/decode disaggregation hands
    # prompts' KV over through it (motet/cluster/disaggregation.py).
    kv_shared_dir: str | None = None
    kv_shared_gb: float = 16.0
    # Adapters are resident in a pool bounded by bytes (motet/lora/pool.py), each at its own rank and targets:
    # `adapter_memory_gb` GiB, or else `adapter_memory_fraction` of the host memory available at start-up on a
    # CPU, and on CUDA of the memory left for the KV cache and the pool once the weights and a step have theirs.
    # The host cache of loaded adapters in front of the disk holds a quarter of the pool on a CPU, and that
    # fraction of the host's memory beside a GPU.
    adapter_memory_gb: float | None = None
    adapter_memory_fraction: float = 0.1
    max_loras: int | None = (
        None  # vLLM's cap on distinct adapters among the running requests; None: memory decides
    )
    max_cpu_loras: int | None = None  # a cap on adapters in the host cache (its bytes bound it anyway)
    max_lora_rank: int = 64  # higher-rank adapters are refused
    lora_time_slice: int = 32  # steps an adapter keeps admitting work while others wait for room
    num_threads: int | None = None  # CPU intra-op threads for the forward pass; None: torch's default
    grammar_backend: str = DEFAULT_GRAMMAR_BACKEND  # one of GRAMMAR_BACKENDS (the others: fallback)
    grammar_timeout_s: float = 10.0  # a grammar that takes longer to compile is refused
    # Append the tokens a grammar forces without sampling them. Off by default: on the CPU attention path
    # the multi-token rows it creates cost more than the steps it saves (benchmarks/grammar_overhead.py).
    jump_forward: bool = False
    # The compiled step: on CPU the whole decoder stack in one native call (motet/engine/worker/cpu_forward.py), on CUDA
    # decode steps replayed from CUDA graphs (motet/engine/worker/cuda_graphs.py). False: the eager model, the reference.
    compile_step: bool = True
    # The prepared-weights cache (motet/engine/worker/prepared_weights.py): the native CPU step's weights as it
    # reads them (packed panels, requantized blocks), written once per model file, settings and instruction-set
    # tier under $MOTET_WEIGHTS_CACHE_DIR (else <MOTET_CACHE_DIR or ~/.cache/motet>/weights) and mapped at later
    # starts; at most this many GiB of entries, the least recently used evicted. 0: off.
    weights_cache_gb: float = WEIGHTS_CACHE_GB
    # Make a step's outputs (detokenizing, stop strings) while the device runs the next step, on a thread of the
    # engine's own (motet/engine/llm_engine.py); the outputs are the same. "off": strictly one step after another.
    # "auto": on where the host has a core the forward pass does not use (CUDA; a CPU with more cores than the
    # step's threads). Where the forward pass uses every core, the outputs' Python takes a core from it: on a
    # 2-core machine with 2 threads no faster, and up to 10% slower at batch 256.
    overlap_output: str = "auto"
    # With the outputs overlapped: schedule and launch step N+1 before step N's tokens reach the host, as vLLM's
    # async scheduling does (the forward thread feeds each row its sampled token). Taken where nothing in step N+1
    # depends on a step-N token but that input (each feature that needs it on the host says so:
    # `LLMEngine.needs_token_on_host`, `needs_landed_steps`; motet/engine/stepping.py); a row whose step-N token
    # is its last (by length) waits for it; one that ends on EOS or a stop id computes one token more, which is
    # dropped. Off: step N's tokens land before step N+1 is scheduled.
    async_scheduling: bool = True
    # Speculative decoding (motet/engine/speculative/): "ngram" drafts from prompt lookup and the grammar's forced
    # tokens, verified in the normal batch; "off". Up to `num_speculative_tokens` drafts per row, each kept
    # while its expected tokens beat its cost; `speculative_overhead_tokens` is a step's fixed cost in
    # token-times (measured by benchmarks/spec_threshold.py: 10.8 for the default model on this 2-core CPU).
    # "auto": ngram on CPU, where benchmarks/spec_bench.py measured it faster on every workload at 1 and 16
    # clients; off on CUDA, where it is unmeasured (verification rows replay from the decode CUDA graphs too).
    speculative: str = "auto"
    num_speculative_tokens: int = 8
    speculative_overhead_tokens: float = 10.0
    # Each tenant's share of a busy engine: {"tenant": weight}, positive finite numbers; tenants not named
    # weigh 1 (motet/engine/core/fairness.py; `motet serve --tenant-weights FILE`).
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # Latency isolation (motet/engine/core/latency.py): while a light tenant's request (or any interactive one beside
    # batch work) runs, the other rows get only the tokens that keep a step within this many milliseconds.
    # None: the device's default (CPU_TPOT_TARGET_MS, CUDA_TPOT_TARGET_MS); 0: off.
    tpot_target_ms: float | None = None
    # Tensor parallelism (motet/engine/worker/parallel.py): the model split over this many ranks, rank 0 this engine's
    # own runner, the others worker processes on this machine (motet/engine/worker/tp_workers.py) joined by
    # torch.distributed (gloo on CPU, NCCL on CUDA); num_threads and the KV cache's memory are per rank.
    tensor_parallel_size: int = 1
    # A mixture-of-experts model's experts split whole across the ranks, tokens sent to them by all-to-all,
    # instead of every expert's intermediate columns split (attention stays tensor-parallel).
    enable_expert_parallel: bool = False
    seed: int = 0

    def __post_init__(self):
        kind = self.device_type  # (checks the device before anything asks torch_device)
        if self.dtype == AUTO_DTYPE:
            self.dtype = auto_dtype(kind)[0]
        if self.tokenizer is not None:
            self.tokenizer = check_tokenizer_dir(self.tokenizer)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be {AUTO_DTYPE!r} or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {list(QUANTIZATIONS)} or None, got {self.quantization!r}"
            )
        # A GGUF file's weights are its blocks: there is nothing else to quantize them into.
        if is_gguf_file(self.model):
            if self.quantization not in (None, GGUF_QUANTIZATION):
                raise ValueError(
                    f"quantization {self.quantization!r}: {self.model} is a GGUF file, served in its own "
                    f"quantized blocks; leave --quantization out (or give {GGUF_QUANTIZATION}), or serve a float "
                    f"checkpoint directory to quantize it to {self.quantization}"
                )
            self.quantization = GGUF_QUANTIZATION
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.tpot_target_ms is not None and not (0 <= self.tpot_target_ms < float("inf")):
            raise ValueError(f"tpot_target_ms must be >= 0 (0: off), got {self.tpot_target_ms}")
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE}, got {self.block_size}")
        for name in ("block_size", "max_num_seqs", "max_lora_rank", "lora_time_slice"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_loras", "max_cpu_loras"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or None: no cap), got {getattr(self, name)}")
        gb, fraction = self.adapter_memory_gb, self.adapter_memory_fraction
        if gb is not None and not (isinstance(gb, int | float) and math.isfinite(gb) and gb > 0):
            raise ValueError(f"adapter_memory_gb must be a finite number > 0, got {gb!r}")
        if not (isinstance(fraction, int | float) and 0 < fraction < 1):
            raise ValueError(f"adapter_memory_fraction must be in (0, 1), got {fraction!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(f"speculative must be one of {SPECULATIVE_MODES}, got {self.speculative!r}")
        if self.overlap_output not in OVERLAP_MODES:
            raise ValueError(f"overlap_output must be one of {OVERLAP_MODES}, got {self.overlap_output!r}")
        for name in ("num_speculative_tokens", "speculative_overhead_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        self.tenant_weights = check_tenant_weights(self.tenant_weights)
        for name in ("kv_offload_gb", "kv_disk_gb", "kv_shared_gb", "weights_cache_gb"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.kv_disk_gb > 0 and not self.kv_disk_dir:
            raise ValueError("kv_disk_gb needs kv_disk_dir, the directory of the disk tier")
        if self.kv_shared_dir and not self.enable_prefix_caching:
            raise ValueError("the shared KV tier (kv_shared_dir) extends the prefix cache: enable it")
        if self.kv_shared_dir and self.tensor_parallel_size > 1:  # as the other tiers (below)
            raise ValueError("the shared KV tier (kv_shared_dir) does not work with tensor parallelism yet")
        if (self.kv_offload_gb > 0 or self.kv_disk_gb > 0) and not self.enable_prefix_caching:
            raise ValueError("the KV tiers (kv_offload_gb, kv_disk_gb) extend the prefix cache: enable it")
        if (self.kv_offload_gb > 0 or self.kv_disk_gb > 0) and self.tensor_parallel_size > 1:
            # each rank holds a shard of the KV heads; the tiers copy one process's blocks (not yet every rank's)
            raise ValueError(
                "the KV tiers (kv_offload_gb, kv_disk_gb) do not work with tensor parallelism yet"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        gb = self.kv_cache_memory_gb
        if gb is not None and not (isinstance(gb, int | float) and math.isfinite(gb) and gb > 0):
            raise ValueError(f"kv_cache_memory_gb must be a finite number > 0, got {gb!r}")

    @property
    def memory_utilization(self) -> float | None:
        """The share of the device's memory the KV cache is sized from (motet/engine/worker/memory.py):
        gpu_memory_utilization, else on CUDA CUDA_GPU_MEMORY_UTILIZATION unless kv_cache_memory_gb is given;
        None: the KV cache takes kv_cache_gb."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        if self.kv_cache_memory_gb is None and self.device_type == "cuda":
            return CUDA_GPU_MEMORY_UTILIZATION
        return None

    @property
    def kv_cache_gb(self) -> float:
        """The KV cache's GiB where no share of the memory sizes it: kv_cache_memory_gb, or the CPU's default."""
        return self.kv_cache_memory_gb if self.kv_cache_memory_gb is not None else CPU_KV_CACHE_MEMORY_GB

    @property
    def speculative_mode(self) -> str:
        if self.speculative == "auto":
            return "ngram" if self.device_type == "cpu" else "off"
        return self.speculative

    @property
    def tpot_target_s(self) -> float | None:
        """Latency isolation's step target in seconds; None: off."""
        ms = self.tpot_target_ms
        if ms is None:
            ms = CPU_TPOT_TARGET_MS if self.device_type == "cpu" else CUDA_TPOT_TARGET_MS
        return ms / 1000 if ms > 0 else None

    @property
    def step_tokens(self) -> int:
        """The step's token budget: `max_num_batched_tokens`, or the device's default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_STEP_TOKENS if self.device_type == "cpu" else CUDA_STEP_TOKENS

    @property
    def max_step_tokens(self) -> int:
        """The most tokens a step grows to while prompts wait (`step_tokens` while they keep up): where
        `max_num_batched_tokens` is given, it (vLLM's meaning: every step's bound); on a CPU, CPU_MAX_STEP_TOKENS."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_MAX_STEP_TOKENS if self.device_type == "cpu" else self.step_tokens

    @property
    def device_type(self) -> str:
        """ "cpu" or "cuda" (`device_type`: without torch where it can be)."""
        return device_type(self.device)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per value of `dtype`."""
        return DTYPE_BYTES[DTYPES[self.dtype]]

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, DTYPES[self.dtype])

    @property
    def torch_device(self) -> torch.device:
        return checked_device(self.device)
