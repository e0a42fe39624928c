"""A training file made ready to train: every example checked and tokenized, counted, and written as TRL's
tokenized rows (JSON lines), which is all the trainer reads.

The same preparation serves the API (before a job is queued: a bad line is a 400 naming it), `motet fine-tune`
(before the run) and the restart of a job (its prepared rows are kept in its directory, so a job never depends on
its file being kept). A file's examples are counted before any is read (`count_examples`): a file of too many is
refused before the first is tokenized.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from motet.training.chat_encoding import ChatEncoder
from motet.training.data_format import ChatExample, DataError, max_line_bytes, read_examples

MAX_EXAMPLES = 100_000  # OpenAI's limit is on tokens; this bounds a job's preparation and its rows on disk
_BLOCK = 1 << 20
_TEXT_LINE = re.compile(rb"^[ \t\r\f\v]*\S", re.MULTILINE)  # where a line that is not blank starts


@dataclass
class Prepared:
    path: Path  # TRL's tokenized rows, a JSON line each
    examples: int
    tokens: int  # the tokens of all examples: what one epoch trains on


def prepare(
    source: BinaryIO, method: str, encoder: ChatEncoder, path: Path, max_examples: int = MAX_EXAMPLES
) -> Prepared:
    """The file's examples as rows, written to `path` as they are made (DataError at the first line that cannot
    be trained on: then nothing is left at `path`)."""
    if source.seekable():  # (a pipe `motet fine-tune` reads is read once)
        count_examples(source, max_examples)
    counts = [0, 0]

    def rows():
        for example in read_examples(source, method, max_line_bytes(encoder.max_tokens), max_examples):
            encoded = (
                encoder.supervised(example) if isinstance(example, ChatExample) else encoder.pair(example)
            )
            counts[0] += 1
            counts[1] += encoded.tokens
            yield encoded.record()

    write_rows(path, rows())
    return Prepared(path, *counts)


def count_examples(source: BinaryIO, max_examples: int) -> int:
    """The file's examples (its lines that are not blank, as `read_examples` reads them), counted a block at a
    time without parsing any, then the file rewound: DataError for a file of none or of more than `max_examples`,
    as `read_examples` says it."""
    count, at_line_start, line_has_text = 0, True, False
    while block := source.read(_BLOCK):
        if not at_line_start:  # the rest of the line the last block ended inside
            end = block.find(b"\n")
            head, block = (block, b"") if end < 0 else (block[:end], block[end + 1 :])
            if not line_has_text and head.strip():
                count, line_has_text = count + 1, True
            at_line_start = end >= 0
        if at_line_start:
            count += len(_TEXT_LINE.findall(block))
            tail = block[block.rfind(b"\n") + 1 :]
            at_line_start, line_has_text = not tail, bool(tail.strip())
        if count > max_examples:
            raise DataError(f"the file holds more than {max_examples} examples, the most a job may train on")
    if count == 0:
        raise DataError("the file holds no examples")
    source.seek(0)
    return count


def write_rows(path: Path, rows: Iterable[dict]) -> None:
    """Written whole under a temporary name, then renamed into place (nothing is left of a failed write)."""
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
