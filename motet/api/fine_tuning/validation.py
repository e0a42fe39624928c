"""A fine-tuning job's files checked and tokenized into its run directory (motet/training/run_setup.py), as OpenAI
validates them: before `POST /v1/fine_tuning/jobs` answers where they are small (at most INLINE_BYTES together: a
bad line is a 400 then), after it where they are larger (the job is `validating_files` meanwhile, and a bad line ends
it `failed`, its `error` the 400's code, message and param). A validation the server's restart cut short is done
again when it starts (the job's run.json, written before any example is read, says what to do).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from motet.api.files.store import FileStore, StoredFile
from motet.training.data_format import DataError, max_line_bytes
from motet.training.dataset import Prepared, write_rows
from motet.training.eval_file import EVAL_ROWS, eval_rows
from motet.training.run_setup import FileError, RunFiles, prepare_files
from motet.training.trainer import TrainingRun

T = TypeVar("T")
# The files of a job validated before its create call answers, at most (their bytes together): ~1,000 chat examples
# of the default model, tokenized in about a second; a larger job is answered `validating_files` at once
INLINE_BYTES = 256 << 10
FILES = ("training_file", "validation_file", "eval_file")


def inline(files: list[StoredFile | None]) -> bool:
    """Whether a job of these files is validated before its create call answers."""
    return sum(f.bytes for f in files if f is not None) <= INLINE_BYTES


@dataclass(frozen=True)
class Refusal:
    """A file that cannot be trained on, as OpenAI says it: the 400 of a create call, or a failed job's `error`."""

    code: str
    message: str
    param: str

    @classmethod
    def of(cls, e: FileError, file_id: str) -> Refusal:
        return cls(f"invalid_{e.which}", f"invalid {e.which} {file_id}: {e}", e.which)


def prepare_job(
    files: FileStore, model: RunFiles, run: TrainingRun, tenant: str, ids: dict[str, str | None]
) -> Prepared:
    """The job's files (`ids`: each of FILES, or None) checked and tokenized into the run's directory; FileError
    names the file and its first bad line (a file deleted before it was read is one too)."""

    def opened(which: str):
        stored = files.get(tenant, ids[which]) if ids.get(which) else None
        if ids.get(which) and stored is None:
            raise FileError(DataError("the file was deleted before it was validated"), which)
        return None if stored is None else files.open(stored)

    train, valid = opened("training_file"), opened("validation_file")
    try:
        prepared, _ = prepare_files(model, run.method, train, valid, run.run_dir)
    finally:
        for f in (train, valid):
            if f is not None:
                f.close()
    if (source := opened("eval_file")) is not None:
        with source:
            try:
                rows = eval_rows(source, model.tokenizer, max_line_bytes(model.max_tokens))
            except DataError as e:
                raise FileError(e, "eval_file") from None
        write_rows(run.run_dir / EVAL_ROWS, rows)
    return prepared


def cpu_timed(call: Callable[[], T], spent: list[float]) -> Callable[[], T]:
    """`call`, its thread's CPU time added to `spent[0]`."""

    def timed() -> T:
        start = time.thread_time()
        try:
            return call()
        finally:
            spent[0] += time.thread_time() - start

    return timed


def validated_event(prepared: Prepared) -> str:
    return (f"Files validated ({prepared.examples} examples, {prepared.tokens} tokens an epoch), moving job to "
            "queued state")  # fmt: skip
