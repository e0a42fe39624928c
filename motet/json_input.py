"""JSON that someone else wrote, read with bounds: a request body, a batch line, a flag's file (`--api-keys`,
`--tenant-weights`). One guard for all of them:

- `loads`: NaN and Infinity are not JSON, and text nested past what the parser recurses (about 1,000 levels)
  is refused as nested too deeply, never a RecursionError.
- `check`: nesting within MAX_DEPTH levels and text that is valid Unicode (a lone surrogate escape such as
  \\ud800 parses into a str that no tokenizer can encode, nor any file or answer line hold); an explicit stack,
  so deep input cannot recurse us; the error names where (`messages[0].content`).
- `parse`: both, for JSON given as text inside JSON already read (a tool call's `arguments`, a training file's
  line), the error naming what the text is.
- `read_file` / `load_file`: a regular file only (a FIFO's reader waits for a writer, /dev/zero never ends),
  opened without blocking, at most `max_bytes` read.

Each refusal is a ValueError that says what to fix; callers put their own name in front (`request body is
nested more than 64 levels deep`, `--tenant-weights FILE: not a regular file (a FIFO)`).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

MAX_DEPTH = 64  # nesting of a request body; JSONSchemaBench's deepest schema nests 22 levels
KEY_CHARS = 40  # of each key where an error names a place


class JSONBoundsError(ValueError):
    """JSON past a bound; `param` is where (`input[0].content`), or None for the whole."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def loads(text: bytes | str):
    """`text` parsed; a ValueError saying why not ("not valid JSON: ...", "nested more than 64 levels deep")."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)  # NaN, Infinity: not JSON
    except RecursionError:
        raise JSONBoundsError(f"nested more than {MAX_DEPTH} levels deep") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not valid JSON: {e}") from None


def check(data, limit: int = MAX_DEPTH) -> None:
    """Nesting of at most `limit` levels, and strings (keys too) that are valid Unicode; JSONBoundsError
    otherwise ("is nested more than 64 levels deep", "holds invalid Unicode (a lone surrogate escape) at x")."""
    stack: list[tuple[object, int, tuple | None]] = [(data, 1, None)]  # (value, depth, where: (parent, key))
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                param = _param(where)
                at = f" at {param}" if param else ""
                raise JSONBoundsError(f"holds invalid Unicode (a lone surrogate escape){at}", param) from None
        elif isinstance(value, dict | list):
            if depth > limit:
                raise JSONBoundsError(f"is nested more than {limit} levels deep", _param(where))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in items:
                stack.append((key, depth, where))  # a key is checked as part of its object
                stack.append((child, depth + 1, (where, key)))


def parse(text: bytes | str, what: str):
    """`text` read as a request body is: `loads`, then `check`. Otherwise a ValueError naming `what`: "WHAT is not
    valid JSON: ...", or a JSONBoundsError whose param is where in the value ("WHAT holds invalid Unicode (a lone
    surrogate escape) at a.b", "WHAT is nested more than 64 levels deep")."""
    try:
        value = loads(text)
    except ValueError as e:  # (a JSONBoundsError stays one)
        raise type(e)(f"{what} is {e}") from None
    try:
        check(value)
    except JSONBoundsError as e:
        raise JSONBoundsError(f"{what} {e}", e.param) from None
    return value


def _param(where: tuple | None) -> str | None:
    """A location on check's stack as a param (`input[0].content`), built only for an error, with each key
    readable (escaped) and short."""
    keys = []
    while where is not None:
        where, key = where
        keys.append(key)
    out = ""
    for key in reversed(keys):
        if isinstance(key, int):
            out += f"[{key}]"
        else:
            text = key.encode("utf-8", "backslashreplace").decode("utf-8")
            text = text if len(text) <= KEY_CHARS else text[: KEY_CHARS - 1] + "…"
            out += f".{text}" if out else text
    return out or None


_KINDS = {stat.S_ISREG: "a regular file", stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO",
          stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket"}  # fmt: skip


def file_kind(mode: int) -> str:
    """What the file of stat mode `mode` is, as a refusal names it ("a directory", "a FIFO")."""
    return next((name for test, name in _KINDS.items() if test(mode)), "not a file")


def read_file(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path` (`~` expanded), at most `max_bytes`; a ValueError saying why
    not. Opened without blocking (opening a FIFO would wait for a writer) and checked before anything is read."""
    try:
        fd = os.open(Path(path).expanduser(), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot open it ({e.strerror or e})") from None
    mode, size = os.fstat(fd).st_mode, os.fstat(fd).st_size
    if not stat.S_ISREG(mode):  # (before fdopen, which refuses a directory with an OSError of its own)
        os.close(fd)
        raise ValueError(f"not a regular file ({file_kind(mode)})")
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(data) > max_bytes:  # (a file growing while it is read too)
            raise ValueError(f"larger than {max_bytes} bytes")
    return data


def load_file(path: str | Path, max_bytes: int):
    """The JSON in the regular file at `path`: read_file, loads and check's bounds; a ValueError saying why
    not."""
    data = loads(read_file(path, max_bytes))
    check(data)
    return data
