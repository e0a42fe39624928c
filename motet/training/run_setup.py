"""A training run set up from its files: the examples checked and tokenized (motet/training/dataset.py), the
hyperparameters resolved (motet/training/hyperparameters.py), and the run's directory written (its rows and
run.json, all the worker reads). What the server does before it queues a job and `motet fine-tune` before it
trains, alike. What can be refused without reading an example comes first: the files' examples counted
(`count_file`), the hyperparameters resolved for that many (`plan_run`); then the examples are tokenized.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from motet.grammar.tool_formats import ToolFormat
from motet.lora.peft_format import base_modules
from motet.models.config import ModelConfig
from motet.training.chat_encoding import ChatEncoder
from motet.training.data_format import DataError
from motet.training.dataset import Prepared, count_examples, prepare
from motet.training.hyperparameters import AUTO, LORA_NAMES, HyperparameterError, resolve
from motet.training.trainer import TRAIN_ROWS, VALID_ROWS, TrainingRun
from motet.training.worker import RUN_SPEC


class FileError(DataError):
    """A DataError of one of the job's files: `which` is "training_file", "validation_file" or "eval_file"."""

    def __init__(self, error: DataError, which: str):
        super().__init__(error.reason, error.line)
        self.which = which


@dataclass
class RunFiles:
    """What training needs to know of the model: its directory and config, the tokenizer and the tool-call format
    serving renders with, the context length, the largest adapter rank served."""

    model_dir: Path
    model_config: ModelConfig
    tokenizer: object  # motet/engine/tokenizer.py's
    tool_format: ToolFormat
    max_tokens: int
    max_rank: int


def prepare_files(
    model: RunFiles, method: str, train: BinaryIO, valid: BinaryIO | None, run_dir: Path
) -> tuple[Prepared, Prepared | None]:
    """Both files checked and tokenized into the run's directory (FileError names the file and the line)."""
    encoder = ChatEncoder(model.tokenizer, model.tool_format, model.max_tokens)
    run_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for which, source, name in (("training_file", train, TRAIN_ROWS), ("validation_file", valid, VALID_ROWS)):
        if source is None:
            out.append(None)
            continue
        try:
            out.append(prepare(source, method, encoder, run_dir / name))
        except DataError as e:
            raise FileError(e, which) from None
    return out[0], out[1]


def count_file(source: BinaryIO, which: str, max_examples: int) -> int:
    """The examples of one of the job's files, counted without reading them (FileError past `max_examples`)."""
    try:
        return count_examples(source, max_examples)
    except DataError as e:
        raise FileError(e, which) from None


def set_up(
    model: RunFiles,
    method: str,
    train: Prepared,
    hyperparameters: dict,
    *,
    seed: int,
    run_dir: Path,
    dtype: str,
    base_name: str,
    adapter_dir: Path | None = None,
    init_adapter: Path | None = None,
) -> TrainingRun:
    """The run of the files `prepare_files` wrote, its spec written to `run_dir` (HyperparameterError: a
    hyperparameter to fix; nothing is written then)."""
    run = plan_run(model, method, train.examples, hyperparameters, seed=seed, run_dir=run_dir, dtype=dtype,
                   base_name=base_name, adapter_dir=adapter_dir, init_adapter=init_adapter)  # fmt: skip
    write_run(run)
    return run


def plan_run(
    model: RunFiles,
    method: str,
    examples: int,
    hyperparameters: dict,
    *,
    seed: int,
    run_dir: Path,
    dtype: str,
    base_name: str,
    adapter_dir: Path | None = None,
    init_adapter: Path | None = None,
) -> TrainingRun:
    """The run of a training file of `examples` examples, its hyperparameters resolved (HyperparameterError: a
    hyperparameter to fix); nothing is written."""
    h = resolve(method, hyperparameters, examples, max_rank=model.max_rank,
                modules=base_modules(model.model_config))  # fmt: skip
    if init_adapter is not None:  # training goes on in the adapter's own shape
        if given := [n for n in LORA_NAMES if hyperparameters.get(n, AUTO) not in (AUTO, None)]:
            raise HyperparameterError(f"{given[0]}: an adapter trained on keeps its own", given[0])
        config = json.loads((init_adapter / "adapter_config.json").read_text())
        targets = config.get("target_modules") or h.lora_target_modules
        h = dataclasses.replace(
            h, lora_rank=config.get("r", h.lora_rank), lora_alpha=config.get("lora_alpha", h.lora_alpha),
            lora_dropout=config.get("lora_dropout", 0.0),
            lora_target_modules=tuple([targets] if isinstance(targets, str) else targets),
        )  # fmt: skip
    return TrainingRun(model.model_dir, method, h, seed, run_dir, dtype, base_name, adapter_dir, init_adapter)


def write_run(run: TrainingRun) -> None:
    """The run's spec written to its directory: all the worker reads beside the rows."""
    spec = run.run_dir / RUN_SPEC
    tmp = spec.with_name(f".{spec.name}.partial")
    tmp.write_text(json.dumps(run.spec(), indent=1))
    os.replace(tmp, spec)
