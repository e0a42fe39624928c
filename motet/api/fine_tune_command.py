"""`motet fine-tune FILE.jsonl [--validation FILE] [--method sft|dpo] [--out DIR]`: the server's fine-tuning
(docs/fine-tuning.md) offline, in this process, with a progress bar.

The file is checked and tokenized as a fine-tuning job's (motet/training/run_setup.py: the first bad line is
named, and the command exits 2), then trained by the same trainer (motet/training/trainer.py). DIR ends up a PEFT
adapter directory (adapter_config.json, adapter_model.safetensors) that `motet serve --lora NAME=DIR` (vLLM's
`--lora-modules NAME=DIR`) serves, with a checkpoint of each epoch under DIR/checkpoints/ (each a PEFT adapter
too). Run again on the same DIR, it goes on from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import sys

from motet.flag_types import input_file, integer, number, output_directory

METHODS = {"sft": "supervised", "dpo": "dpo"}


def add_fine_tune_parser(sub, **fmt) -> None:
    p = sub.add_parser(
        "fine-tune",
        help="train a LoRA adapter on a JSONL file of chats (or preference pairs) offline",
        description=__doc__.split("\n\n")[1],
        **fmt,
    )
    p.add_argument(
        "file",
        type=input_file,
        metavar="FILE",
        help="training examples, one a line (OpenAI's fine-tuning formats)",
    )
    p.add_argument(
        "--validation", type=input_file, default=None, help="validation examples (its loss each epoch)"
    )
    p.add_argument(
        "--method", choices=tuple(METHODS), default="sft", help="sft: chats; dpo: preference pairs"
    )
    p.add_argument(
        "--out",
        type=output_directory,
        default=None,
        help="the adapter's directory (default: FILE's name, -adapter)",
    )
    p.add_argument("--model", default=None, help="the base model (default: the default model)")
    p.add_argument("--seed", type=integer(0, 2**31 - 1), default=0)
    auto = "(default: auto)"
    p.add_argument("--n-epochs", type=integer(1, 50), default=None, help=f"epochs {auto}")
    p.add_argument("--batch-size", type=integer(1, 256), default=None, help=f"examples a step {auto}")
    p.add_argument("--learning-rate-multiplier", type=number(0, 10, above=True), default=None,
                   help=f"of a learning rate of 2e-4 {auto}")  # fmt: skip
    p.add_argument("--beta", type=number(0, 2, above=True), default=None, help=f"DPO's beta {auto}")
    p.add_argument("--lora-rank", type=integer(1, 64), default=None,
                   help="LoRA's rank, at most serve's default --max-lora-rank (default: 8)")  # fmt: skip
    p.add_argument("--lora-alpha", type=number(0, 1024, above=True), default=None,
                   help="LoRA's alpha (default: twice the rank)")  # fmt: skip
    p.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="the projections to adapt (default: all of the decoder's)")  # fmt: skip
    p.add_argument("--max-model-len", type=integer(1), default=None,
                   help="the longest example in tokens (default: the model's context)")  # fmt: skip
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="the base weights' dtype (auto: bfloat16 where the CPU computes it)")  # fmt: skip
    p.add_argument("--threads", type=integer(1), default=None, help="compute threads (default: the cores)")
    p.set_defaults(func=cmd_fine_tune)


def say(text: str) -> None:
    """A line of the command's on stderr (stdout stays empty)."""
    print(f"motet fine-tune: {text}", file=sys.stderr, flush=True)


HYPERPARAMETERS = ("n_epochs", "batch_size", "learning_rate_multiplier", "lora_rank", "lora_alpha",
                   "lora_target_modules")  # fmt: skip


def cmd_fine_tune(args) -> int:
    """What the flags, the model's config and the files' lines decide first, quickly (a refusal: one line, exit 2);
    then it says what it does, and (a line at least every 5 s: `load_progress.Heartbeat`) imports the trainer's
    libraries, reads the tokenizer and tokenizes the files before the bar shows."""
    from motet.engine.config import context_length
    from motet.engine.weights import load_progress
    from motet.engine.weights.model_config import load_model_config
    from motet.engine.weights.model_store import resolve_model

    method = METHODS[args.method]
    given = {n: getattr(args, n) for n in (*HYPERPARAMETERS, *(("beta",) if method == "dpo" else ()))}
    given = {n: v for n, v in given.items() if v is not None}  # the others: auto
    if method != "dpo" and args.beta is not None:
        raise ValueError("--beta is DPO's (--method dpo)")
    model_dir = resolve_model(args.model)
    config = load_model_config(model_dir)
    max_tokens = context_length(config, args.max_model_len)
    out = args.out or args.file.with_name(f"{args.file.stem}-adapter")
    check_files(args, method, given, config, max_tokens, out)
    say(
        f"{method} fine-tuning of {model_dir.name} on {args.file}: tokenizing the examples, then training ..."
    )
    load_progress.phase("importing the trainer's libraries")
    with load_progress.Heartbeat(say=say):
        prepared = _prepare(args, method, given, model_dir, config, max_tokens, out)
    return train_run(*prepared)


def check_files(args, method: str, given: dict, config, max_tokens: int, out) -> None:
    """The files' lines read as the job reads its examples (without tokenizing them), the hyperparameters against
    their count and the model, and DIR made: a ValueError naming the file and line, the flag or the path, before
    the trainer's libraries load (seconds: a bad file is refused at once)."""
    from motet.engine.config import EngineConfig
    from motet.lora.peft_format import base_modules
    from motet.training.data_format import DataError, max_line_bytes, read_examples
    from motet.training.dataset import MAX_EXAMPLES
    from motet.training.hyperparameters import HyperparameterError, resolve

    examples = 0
    for path in (args.file, args.validation):
        if path is None:
            continue
        try:
            with open(path, "rb") as f:
                count = sum(1 for _ in read_examples(f, method, max_line_bytes(max_tokens), MAX_EXAMPLES))
        except DataError as e:
            raise ValueError(f"{path}: {e}") from None
        except OSError as e:  # (checked as a flag, but it may change, or be out of our reach)
            raise ValueError(f"{e.filename or path}: {e.strerror or e}") from None
        examples = examples or count  # (the training file's)
    try:
        resolve(method, given, examples, max_rank=EngineConfig.max_lora_rank, modules=base_modules(config))
    except HyperparameterError as e:
        raise ValueError(f"--{e.name.replace('_', '-')}: {e}") from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{e.filename or out}: {e.strerror or e}") from None


def _prepare(args, method: str, given: dict, model_dir, config, max_tokens: int, out) -> tuple:
    """The run set up from the files, tokenized (ValueError naming what to fix): (run, its training data, dtype,
    DIR)."""
    import torch

    from motet.engine.config import EngineConfig, auto_dtype, default_cpu_threads
    from motet.engine.tokenizer import load_tokenizer
    from motet.engine.weights import load_progress
    from motet.grammar.tool_formats import tool_format
    from motet.training.hyperparameters import HyperparameterError
    from motet.training.run_setup import FileError, RunFiles, prepare_files, set_up

    torch.set_num_threads(args.threads or default_cpu_threads())
    load_progress.phase(f"reading {model_dir.name}'s tokenizer")
    tokenizer = load_tokenizer(model_dir)
    load_progress.phase(f"tokenizing {args.file}")
    files = RunFiles(model_dir, config, tokenizer, tool_format(config.declaration.tool_format,
                     tokenizer.hf.chat_template), max_tokens, max_rank=EngineConfig.max_lora_rank)  # fmt: skip
    try:
        with (
            open(args.file, "rb") as f,
            open(args.validation, "rb") if args.validation else contextlib.nullcontext() as v,
        ):
            train_data, valid_data = prepare_files(files, method, f, v, out)
        dtype = auto_dtype("cpu")[0] if args.dtype == "auto" else args.dtype
        run = set_up(files, method, train_data, given, seed=args.seed, run_dir=out, dtype=dtype,
                     base_name=model_dir.name, adapter_dir=out)  # fmt: skip
    except FileError as e:
        where = args.file if e.which == "training_file" else args.validation
        raise ValueError(f"{where}: {e}") from None
    except OSError as e:  # the files or DIR (checked as flags, but either may change, or be out of our reach)
        raise ValueError(f"{e.filename or out}: {e.strerror or e}") from None
    except HyperparameterError as e:
        raise ValueError(f"--{e.name.replace('_', '-')}: {e}") from None
    return run, train_data, dtype, out


def train_run(run, train_data, dtype: str, out) -> int:
    """The run trained, with its progress bar."""
    from tqdm import tqdm

    from motet.training.trainer import train

    h = run.hyperparameters
    print(f"{train_data.examples} examples, {train_data.tokens} tokens; {h.n_epochs} epochs of batches of "
          f"{h.batch_size}, learning rate {h.learning_rate:g}, LoRA rank {h.lora_rank}, {dtype}", file=sys.stderr)  # fmt: skip
    bar = tqdm(unit="step", file=sys.stderr)

    def show(event: dict) -> None:
        kind = event["type"]
        if kind == "started":
            bar.reset(event["total_steps"])
            bar.update(event["step"])
        elif kind == "step":
            bar.set_postfix(loss=f"{event['train_loss']:.4f}")
            bar.update(event["step"] - bar.n)
        elif kind == "validation":
            bar.write(f"step {event['step']}: validation loss {event['valid_loss']:.4f}", file=sys.stderr)
        elif kind == "checkpoint" and event["epoch_end"]:
            bar.write(f"epoch {event['epoch']}: checkpoint {event['path']}", file=sys.stderr)
        elif kind == "resumed":
            bar.write(f"going on from the checkpoint of step {event['step']}", file=sys.stderr)

    train(run, show)
    bar.close()
    print(f"adapter: {out}  (serve it: motet serve --lora NAME={out})", file=sys.stderr)
    return 0
