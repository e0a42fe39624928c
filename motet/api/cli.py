"""The `motet` command line: pull, generate, serve, run-batch, eval. The engine's flags take their defaults from
`EngineConfig`, so the two never disagree. Heavy imports happen inside the commands (`motet --help` stays
fast)."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys

from motet.api.cache_command import add_cache_parser
from motet.flag_types import (
    OneLineErrors,
    device,
    input_file,
    integer,
    model_name,
    number,
    or_url,
    output_directory,
    output_file,
    seconds,
    threads,
)
from motet.parent_death import die_with_parent
from motet.settings_flags import SettingsFlags


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help shows its default, unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if re.search(r"\bdefault:", help_, re.IGNORECASE) or action.default is argparse.SUPPRESS:
            return help_
        if action.nargs == 0:  # a switch (store_true, store_false, ...): not given unless asked for
            return f"{help_} (default: off)"
        if action.default is None:
            return f"{help_} (default: none)"
        return super()._get_help_string(action)


class _Version(argparse.Action):
    """`motet --version`: the installed distribution's version (motet/version.py), read only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(
            option_strings, dest=dest, default=default, nargs=0, help="print the version and exit"
        )

    def __call__(self, parser, namespace, values, option_string=None):
        from motet.version import __version__

        print(f"motet {__version__}")  # (stdout, as argparse's own version action prints it)
        parser.exit()


# The engine's flags that set an EngineConfig field of their own (the others: `engine_config`).
ENGINE_FLAGS = SettingsFlags()


def _engine_args(p: argparse.ArgumentParser) -> None:
    from motet.engine.config import (
        AUTO_DTYPE,
        CPU_KV_CACHE_MEMORY_GB,
        CPU_MAX_STEP_TOKENS,
        CPU_STEP_TOKENS,
        CPU_TPOT_TARGET_MS,
        CUDA_GPU_MEMORY_UTILIZATION,
        CUDA_STEP_TOKENS,
        CUDA_TPOT_TARGET_MS,
        DEFAULT_DTYPE,
        DTYPES,
        GRAMMAR_BACKENDS,
        MAX_BLOCK_SIZE,
        MIN_MODEL_LEN,
        OVERLAP_MODES,
        QUANTIZATIONS,
        SPECULATIVE_MODES,
        EngineConfig,
    )

    d = EngineConfig  # the defaults
    flag = ENGINE_FLAGS.adder(p, EngineConfig)
    p.add_argument(
        "--model",
        default=d.model,
        help="model name, local HF checkpoint dir of a family motet serves (docs/models.md), or a GGUF file of one "
        "(path/to/file.gguf: config, tokenizer and chat template from its metadata, projections served in its own "
        "blocks as with --quantization gguf); a local model is served by its directory's name (a GGUF file's stem) "
        f"unless --served-model-name (default: {d.model})",
    )
    flag(
        "--tokenizer",
        metavar="DIR",
        help="a Hugging Face tokenizer directory (tokenizer.json or tokenizer.model, tokenizer_config.json) whose "
        "tokenizer and chat template serve the model instead of its own, as vLLM's --tokenizer: the original "
        "model's beside its GGUF file, say (default: the model's own; a GGUF file's from its metadata)",
    )
    flag(
        "--dtype",
        choices=[AUTO_DTYPE, *sorted(DTYPES)],
        default=DEFAULT_DTYPE,
        help="weights' and KV cache's type; auto (the default, as vLLM's): bfloat16 where the hardware computes it "
        "natively (a CPU with AVX512_BF16, AMX or Arm's BF16; a CUDA GPU that has it), float32 elsewhere",
    )
    flag(
        "--quantization",
        choices=QUANTIZATIONS,
        help="quantized decoder projections: int8 (blocks of 32 with a scale, as GGUF Q8_0) or int4 (blocks "
        "of 32 with a scale and a min, as GGUF Q4_1) quantize the float checkpoint on load; gguf serves the "
        "model directory's GGUF file (Q8_0/Q4_1/Q4_0/Q4_K kept in their blocks, other types requantized to "
        "int8; the default model keeps its Q4_1 file), and is implied by a --model that is a .gguf file; "
        "gptq|awq name a GPTQ/AWQ 4-bit checkpoint's own method (such a checkpoint is served in its own "
        "weights without the flag; other values conflict). With int4 or int8 the lm_head is quantized to "
        "int8; the embedding table and LoRA adapters stay in --dtype (default: none, the checkpoint's weights)",
    )
    flag("--device", type=device, help="auto (cuda when available), cpu, cuda or cuda:N")
    flag("--block-size", type=integer(1, MAX_BLOCK_SIZE), help="tokens per KV block")
    flag(
        "--num-kv-blocks",
        type=integer(1),
        help="KV cache blocks: at least the tokens of a short request, at most what the memory holds (default: "
        "from --gpu-memory-utilization or --kv-cache-memory-gb)",
    )
    flag(
        "--kv-cache-memory-gb",
        type=number(0, above=True),
        help="memory for the KV cache, in GiB; --gpu-memory-utilization wins over it (default: on CUDA "
        f"what {CUDA_GPU_MEMORY_UTILIZATION:g} of the device's memory leaves once the weights, a step and the "
        f"LoRA slots have theirs, as vLLM; on CPU {CPU_KV_CACHE_MEMORY_GB:g})",
    )
    flag("--max-num-seqs", type=integer(1), help="requests running at once")
    flag(
        "--max-num-batched-tokens",
        type=integer(1),
        help=f"tokens per step, every step's bound where given (default on CPU: {CPU_STEP_TOKENS}, and while prompts "
        f"wait 8 for each running row, up to {CPU_MAX_STEP_TOKENS}; on CUDA: {CUDA_STEP_TOKENS})",
    )
    flag(
        "--tpot-target-ms",
        type=number(0),
        help="latency isolation: while a light tenant's request runs, the other tenants' rows yield so that a "
        f"step stays within this many ms (default: {CPU_TPOT_TARGET_MS:g} on CPU, {CUDA_TPOT_TARGET_MS:g} on "
        "CUDA; 0: off)",
    )
    flag(
        "--max-model-len",
        type=integer(MIN_MODEL_LEN),
        help="the longest sequence, prompt and answer, at most the model's context length (default: the model's "
        "context length)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="never reuse the KV blocks of earlier prompts' prefixes",
    )
    flag(
        "--shared-prefix-cache",
        action="store_true",
        help="share cached base-model prompt prefixes across tenants (default: each tenant's prefix cache is "
        "its own, since a cache hit shows in cached_tokens and timing and would reveal another tenant's "
        "prompts); only for tenants who trust each other",
    )
    flag(
        "--kv-offload-gb",
        type=number(0),
        help="host RAM, in GiB, for KV blocks evicted from the KV cache (an LRU): a returning prompt prefix is "
        "copied back instead of recomputed; 0: off",
    )
    flag(
        "--kv-disk-gb",
        type=number(0),
        help="local disk, in GiB, for KV blocks under <data dir>/kv-cache (--data-dir, else $MOTET_DATA_DIR, "
        "else the model's own under ~/.local/share/motet): kept across restarts, each entry checksummed and bound to the model, "
        "dtype and KV layout; 0: off",
    )
    flag(
        "--weights-cache-gb",
        type=number(0),
        help="disk, in GiB, for the prepared-weights cache (a CPU's native step: each model's weights packed and "
        "requantized once, mapped at later starts; under $MOTET_WEIGHTS_CACHE_DIR, else <$MOTET_CACHE_DIR or "
        "~/.cache/motet>/weights; the least recently used evicted; `motet cache ls|rm`); 0: off",
    )
    flag(
        "--threads",
        field="num_threads",
        type=threads(),
        help="CPU threads for the forward pass, at most the cores this process may run on (default: all cores; "
        "when serving on 8 or more, all but one, left to the event loop)",
    )
    flag(
        "--grammar-backend",
        choices=GRAMMAR_BACKENDS,
        help="structured output backend; the others are the fallback for what it cannot compile",
    )
    flag(
        "--grammar-timeout",
        field="grammar_timeout_s",
        type=seconds(0, above=True),
        help="seconds a grammar may take to compile",
    )
    flag(
        "--jump-forward",
        action="store_true",
        help="append the tokens a grammar forces without sampling them (fewer steps; on CPU, slower)",
    )
    flag(
        "--overlap-output",
        choices=OVERLAP_MODES,
        help="make each step's outputs (detokenizing, stop strings) while the device runs the next step; auto: "
        "where a core is spare (CUDA, or a CPU with more cores than the step's threads)",
    )
    flag(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="with the outputs overlapped, schedule and launch each step before the previous step's tokens "
        "reach the host, where no row needs them but as its input (docs/gpu.md)",
    )
    flag(
        "--speculative",
        choices=SPECULATIVE_MODES,
        help="speculative decoding: ngram drafts from prompt lookup and the grammar's forced tokens, "
        "verified in the normal batch (the same output, fewer steps where outputs repeat their input)",
    )
    flag("--num-speculative-tokens", type=integer(0), help="most drafts per row")
    flag(
        "--speculative-overhead-tokens",
        type=number(0),
        help="a step's fixed cost in token-times, which drafts are priced against (benchmarks/spec_threshold.py)",
    )
    p.add_argument(
        "--no-compile",
        action="store_true",
        help="run the eager model (the reference) instead of the compiled step (native CPU forward, CUDA graphs)",
    )
    flag(
        "--tensor-parallel-size",
        "-tp",
        type=integer(1),
        help="split the model over this many ranks (worker processes on this machine joined by torch.distributed: "
        "gloo on CPU, NCCL on CUDA); the attention and KV heads, MLP columns and vocabulary are split, so they "
        "must divide by it; --threads and the KV cache's memory are per rank",
    )
    flag(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: a mixture-of-experts model's experts split whole across the ranks, "
        "tokens sent to them by all-to-all (default: every expert's intermediate columns split)",
    )
    flag(
        "--adapter-memory-gb",
        type=number(0, above=True),
        help="GiB for resident LoRA adapters, each at its own rank (default: --adapter-memory-fraction)",
    )
    flag(
        "--adapter-memory-fraction",
        type=number(0, 1, above=True),
        help="the resident adapters' share of the host memory available at start-up on a CPU, and on CUDA of "
        "the memory the KV cache and the adapters share (default: %(default)s)",
    )
    flag(
        "--max-loras",
        type=integer(1),
        help="a cap on distinct LoRA adapters among the running requests (default: none, memory decides)",
    )
    flag(
        "--max-cpu-loras",
        type=integer(1),
        help="a cap on loaded LoRA adapters kept in host memory (default: none, their bytes decide)",
    )
    flag("--max-lora-rank", type=integer(1), help="higher-rank adapters are refused")


def engine_config(args):
    from motet.api.vllm_flags import served_model
    from motet.engine.config import EngineConfig

    model = served_model(args, EngineConfig.model)  # `motet serve MODEL` too
    return EngineConfig(
        **ENGINE_FLAGS.values(args),
        model=model,
        enable_prefix_caching=not args.no_prefix_caching,
        compile_step=not args.no_compile,
        kv_disk_dir=kv_disk_dir(args, model),
        # `serve`'s own: vLLM's (motet/api/vllm_flags.py) and the scale-out flags (motet/cluster/serve_flags.py)
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
        kv_shared_dir=getattr(args, "kv_shared_dir", None),
        **({"kv_shared_gb": args.kv_shared_gb} if getattr(args, "kv_shared_gb", None) else {}),
    )


def kv_disk_dir(args, model: str) -> str | None:
    """The KV disk tier's directory, under the data directory (`motet serve --data-dir`), when it is on."""
    if not args.kv_disk_gb:
        return None
    from motet.api.server import data_dir
    from motet.engine.core.kv_tiers import KV_CACHE_SUBDIR

    return str(data_dir(getattr(args, "data_dir", None), model) / KV_CACHE_SUBDIR)


def cmd_pull(args) -> int:
    from motet.engine.weights.model_store import pull

    print(pull(cache_dir=args.cache_dir, force=args.force, progress=True))
    return 0


def starting(config, what: str) -> None:
    """An offline command's first line, said as it begins (before the engine's libraries are imported: seconds on
    a busy machine), and its phase from then on, which a `load_progress.Heartbeat` repeats where no line comes."""
    from motet.engine.weights import load_progress

    load_progress.begin(
        f"{what}: loading {config.model} in {config.dtype}", "the engine's libraries, then the weights"
    )
    load_progress.phase("importing the engine's libraries")


def cmd_generate(args) -> int:
    from motet.api.server import check_model
    from motet.engine.weights import load_progress

    config = engine_config(args)
    check_model(config)  # a flag the model or the memory refuses: one line, before anything loads
    # the engine's start-up lines on stderr (a minute on a busy CPU); stdout holds the answer alone
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("motet").setLevel(logging.INFO)
    starting(config, "motet generate")
    with load_progress.Heartbeat():
        from motet.engine.llm_engine import LLMEngine
        from motet.engine.outputs import RequestOutputs
        from motet.engine.sampling_params import SamplingParams

        engine, answers = LLMEngine(config), RequestOutputs()
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, top_p=args.top_p
    )
    if args.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished():
        for out in answers.step(engine):
            if not args.json:
                print(out.delta, end="", flush=True)
            if out.finished:
                final = out
    if args.json:
        print(
            json.dumps(
                {"text": final.text, "token_ids": final.token_ids, "finish_reason": final.finish_reason}
            )
        )
    else:
        print()
    return 0


def cmd_serve(args) -> int:
    from motet.api.server import serve

    return serve(args, engine_config(args))


def cmd_run_batch(args) -> int:
    from motet.api.server import check_model
    from motet.engine.weights import load_progress

    config = engine_config(args)
    check_model(config)  # as serve's: before anything loads
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    starting(config, f"motet run-batch {args.input_file}")
    heartbeat = load_progress.Heartbeat().start()  # (until the engine is ready and the bar shows)
    try:
        from motet.api.offline_batch import run_batch

        return run_batch(args, config, heartbeat.stop)
    finally:
        heartbeat.stop()


def cmd_eval(args) -> int:
    from motet.evals.eval_command import main as eval_main

    return eval_main(args.eval_args)


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True)
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    p.add_argument("--max-tokens", type=integer(1), default=128)
    p.add_argument("--temperature", type=number(0), default=0.0)
    p.add_argument("--top-p", type=number(0, 1, above=True), default=1.0)
    p.add_argument("--seed", type=integer(-(2**63), 2**63 - 1), default=None)
    p.add_argument("--json", action="store_true", help='print {"text", "token_ids", "finish_reason"}')
    _engine_args(p)


def _run_batch_args(p: argparse.ArgumentParser) -> None:
    from motet.api.batch_files import URL_SCHEMES

    p.add_argument(
        "-i",
        "--input-file",
        required=True,
        type=or_url(input_file, URL_SCHEMES),
        help="the batch file: a local path or an http(s) URL (GET)",
    )
    p.add_argument(
        "-o",
        "--output-file",
        required=True,
        type=or_url(output_file, URL_SCHEMES),
        help="where the answers go: a local path or an http(s) URL (PUT)",
    )
    p.add_argument(
        "--max-concurrency",
        type=integer(1),
        default=None,
        help="requests in flight at once (default: twice --max-num-seqs)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        type=model_name,
        default=None,
        metavar="NAME",
        help="the model's name in the requests (the first; the others are aliases); default: --model",
    )
    p.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="a PEFT adapter directory as model NAME (repeatable)",
    )
    from motet.grammar.reasoning import REASONING_FORMATS

    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["none", *REASONING_FORMATS],
        help="as serve's: the model's reasoning comes back as reasoning_content (default: the model's; none: off)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="info: what it loads, with a line at least every 5 s until the progress bar shows",
    )
    _engine_args(p)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `motet` parser; with `command`, only that command's flags (the others are listed, for `motet --help`):
    the engine's flags import its modules, seconds that `motet pull` need not wait. None: every command's."""

    def flags_of(name: str) -> bool:
        return command is None or command == name

    parser = OneLineErrors(prog="motet", description="multi-tenant LLM serving engine")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = {"formatter_class": _HelpFormatter}

    p = sub.add_parser("pull", help="download and convert the default model into the local cache", **fmt)
    p.add_argument(
        "--cache-dir",
        type=output_directory,
        default=None,
        help="cache directory (default: $MOTET_CACHE_DIR or ~/.cache/motet)",
    )
    p.add_argument("--force", action="store_true", help="convert again even if the model is cached")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("generate", help="generate text offline from one prompt", **fmt)
    p.set_defaults(func=cmd_generate)
    if flags_of("generate"):
        _generate_args(p)

    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API", **fmt)
    p.set_defaults(func=cmd_serve)
    if flags_of("serve"):
        from motet.api.server import add_serve_args

        add_serve_args(p)
        _engine_args(p)

    p = sub.add_parser(
        "run-batch",
        help="run a Batch API file (JSONL) offline, as `vllm run-batch` does",
        description="Each input line {custom_id, method, url, body} is answered by the engine in this process, "
        "through the same routes and validation as `motet serve`; the answers go to -o in the input's order.",
    )
    p.set_defaults(func=cmd_run_batch)
    if flags_of("run-batch"):
        _run_batch_args(p)

    # Everything after `eval` is evals.eval_command's to parse (no option prefix of its own, so --help passes
    # too).
    p = sub.add_parser("eval", help="run an eval suite and write a report", add_help=False, prefix_chars="\0")
    p.add_argument("eval_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_eval)
    from motet.api.fine_tune_command import add_fine_tune_parser

    add_fine_tune_parser(sub, **fmt)
    add_cache_parser(sub, **fmt)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and not argv[0].startswith("-") else ""  # "": `motet --help`, which lists them
    try:
        args = build_parser(command).parse_args(argv)
    except SystemExit as e:  # a refused flag (its one line is printed) or --help: an exit code, as below
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, no traceback
        print(f"motet: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    die_with_parent()  # where a harness started it (motet/parent_death.py)
    sys.exit(main())
