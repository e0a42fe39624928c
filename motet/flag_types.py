"""Argparse types for motet's flags: a value that is not in the flag's range or form is refused at start-up, in
one line naming the flag (`motet serve: error: argument --x: ...`), never accepted to fail later
(`--responses-max-age-days nan` once made every stored response unreadable; `--threads 100000` crashed the
process; an empty `--served-model-name` named no model).

- numbers: `integer`, `number`, `seconds`, `threads` (finite, within the flag's range);
- names: `model_name` (a name requests can give: bounded, printable, no spaces), `device` (one this machine has);
- web: `host_name` (`--allowed-hosts`), `web_origin` (`--allowed-origins`), each also in vLLM's one-JSON-list form;
- files: `json_file` (a regular file, bounded in size and nesting, its content checked by the flag's own check),
  `input_file` / `input_directory` (what a command reads: there, and of that kind), `output_file` /
  `output_directory` (what a command writes: of that kind where it is there, made where it is not, never under a
  file), `or_url` (any of them, or a URL);
- inline JSON: `json_text`.

Every flag of every command takes its type from here (motet/api/cli.py, motet/api/server.py,
motet/api/vllm_flags.py, motet/cluster/serve_flags.py); `OneLineErrors` is the parser class that prints a
refusal as that one line. What depends on the model or the machine's memory (`--max-model-len` past the
model's positions, a KV cache larger than the memory) is checked once the model's config is read, before
anything loads (motet/engine/worker/memory.py `check_fits`).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from motet import json_input

MAX_SECONDS = 7 * 86400.0  # a timeout or grace period longer than a week is a mistake (and near the
# event loop's limits: a deadline of 1e300 s overflows)
MAX_DAYS = 36500.0  # a retention of a century
MAX_NAME_CHARS = 256  # a served model's name (OpenAI's ids are far shorter; it is echoed in every answer)
MAX_FLAG_FILE_BYTES = 16 << 20  # a flag's JSON file (--tenant-weights)


def integer(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An integer flag in [low, high] (no upper bound when `high` is None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        _check(value, text, low, high, open_low=False)
        return value

    parse.__name__ = "integer"
    return parse


def number(low: float = 0.0, high: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """A finite real flag in [low, high], or (low, high] with `above` (no upper bound when `high` is None)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):  # float() reads "nan", "inf" and "1e999" (inf)
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        _check(value, text, low, high, open_low=above)
        return value

    parse.__name__ = "number"
    return parse


def seconds(low: float = 0.0, *, above: bool = False) -> Callable[[str], float]:
    """A duration flag: finite seconds from `low` (or above it) to MAX_SECONDS."""
    return number(low, MAX_SECONDS, above=above)


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads() -> Callable[[str], int]:
    """A thread count: 1 to the cores this process may run on (more only slows the forward down, and
    OpenMP's pools fail outright past some thousands: `--threads 100000` was a segmentation fault)."""
    cores = available_cores()
    within = integer(1, cores)

    def parse(text: str) -> int:
        try:
            return within(text)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} (this machine gives this process {cores} cores)") from None

    parse.__name__ = "integer"
    return parse


def device(text: str) -> str:
    """`--device`: auto, cpu, cuda or cuda:N, where this machine and its torch build have it (the engine's own
    check, motet/engine/config.py `checked_device`: an unknown name, CUDA not in this torch build, no such index;
    `device_type`: auto and cpu without importing torch where its build has no GPU)."""
    from motet.engine.config import device_type

    try:
        device_type(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _check(value, text: str, low, high, open_low: bool) -> None:
    too_low = value <= low if open_low else value < low
    if too_low or (high is not None and value > high):
        lower = f"> {low:g}" if open_low else f">= {low:g}"
        wanted = f"{lower} and <= {high:g}" if high is not None else lower
        raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")


def _quoted(text: str, limit: int = 60) -> str:
    """A refused value as a message quotes it: its repr, at most `limit` characters."""
    text = repr(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def model_name(text: str) -> str:
    """A name requests give as `model`: 1 to MAX_NAME_CHARS printable characters, none of them a space."""
    if not text or len(text) > MAX_NAME_CHARS:
        raise argparse.ArgumentTypeError(f"a name of 1 to {MAX_NAME_CHARS} characters is expected, got "
                                         f"{len(text)}: {_quoted(text)}")  # fmt: skip
    if not text.isprintable() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"a name has no spaces or control characters, got {_quoted(text)}")
    return text


_HOST_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")  # (underscores: container and compose host names)


def _check_host(name: str) -> None:
    """`name` is a host as a Host header names it (`*`, a DNS name or an IP literal, with or without a port)."""
    if name == "*":
        return
    host = name.strip().lower()
    if host.startswith("["):  # [v6] or [v6]:port
        host, _, port = host[1:].partition("]")
        port = port.removeprefix(":") if port else ""
    elif host.count(":") == 1:
        host, port = host.split(":")
    else:
        port = ""
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        raise argparse.ArgumentTypeError(f"{_quoted(name)}: the port must be 1 to 65535")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise argparse.ArgumentTypeError(
            f"{_quoted(name)} is not a host name (letters, digits, '-' and '.', such as api.example.com), an "
            "IP address or '*'"
        )


def _check_origin(value: str) -> None:
    """`value` is a web origin: `*`, or `scheme://host[:port]` (nothing after it but a slash)."""
    if value == "*":
        return
    parts = urlsplit(value.strip())
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", parts.scheme or "") or not parts.netloc or parts.path not in ("", "/") \
            or parts.query or parts.fragment or "@" in parts.netloc:  # fmt: skip
        raise argparse.ArgumentTypeError(
            f"{_quoted(value)} is not a web origin: scheme://host[:port], such as https://app.example.com, or '*'"
        )
    _check_host(parts.netloc)


def _listed(check: Callable[[str], None], name: str) -> Callable[[str], str]:
    """A type whose value is one item for `check`, or vLLM's form: one JSON list of them (`'["*"]'`)."""

    def parse(text: str) -> str:
        items = [text]
        if text.strip().startswith("["):
            try:
                items = json_input.loads(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(f"{_quoted(text)}: not a JSON list ({e})") from None
            if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
                raise argparse.ArgumentTypeError(f"{_quoted(text)}: a JSON list of strings is expected")
        for item in items:
            check(item)
        return text

    parse.__name__ = name
    return parse


host_name = _listed(_check_host, "host_name")
web_origin = _listed(_check_origin, "web_origin")


def json_text(check: Callable[[object], object] = lambda value: value) -> Callable[[str], object]:
    """An inline JSON flag (`--override-generation-config '{...}'`): parsed with motet/json_input.py's bounds,
    then `check(value)` (its ValueError is the refusal) gives the flag's value."""

    def parse(text: str):
        try:
            value = json_input.loads(text)
            json_input.check(value)
            return check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "json_text"
    return parse


def json_file(
    check: Callable[[object], object], max_bytes: int = MAX_FLAG_FILE_BYTES
) -> Callable[[str], object]:
    """A flag naming a JSON file (`--tenant-weights FILE`): read now, once, as motet/json_input.py reads files
    (a regular file of at most `max_bytes`, bounded nesting), then `check(value)` (its ValueError is the
    refusal) gives the flag's value."""

    def parse(path: str):
        try:
            return check(json_input.load_file(path, max_bytes))
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{path}: {e}") from None

    parse.__name__ = "json_file"
    return parse


def _stat(text: str) -> tuple[Path, int | None]:
    """The path `text` names (`~` expanded) and its stat mode, None where nothing is there yet; refused where
    nothing can be (a file on the way, `/etc/passwd/x`: ENOTDIR) or it cannot be looked at (EACCES)."""
    path = Path(text).expanduser()
    try:
        return path, os.stat(path).st_mode
    except FileNotFoundError:
        return path, None
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text}: {e.strerror or e}") from None


def _refuse_unless(text: str, mode: int | None, is_kind: Callable[[int], bool], kind: str) -> None:
    if mode is not None and not is_kind(mode):
        raise argparse.ArgumentTypeError(f"{text}: not {kind} ({json_input.file_kind(mode)})")


def input_file(text: str) -> Path:
    """A file a command reads (`motet fine-tune FILE`, `motet eval --data`): one that exists and is a regular file
    (a directory is refused now, not once the model has loaded; a FIFO too, whose reader would wait for a
    writer)."""
    path, mode = _stat(text)
    if mode is None:
        raise argparse.ArgumentTypeError(f"{text}: No such file or directory")
    _refuse_unless(text, mode, stat.S_ISREG, "a regular file")
    return path


def input_directory(text: str) -> Path:
    """A directory a command reads (`motet eval lora --adapters-dir`): one that exists."""
    path, mode = _stat(text)
    if mode is None:
        raise argparse.ArgumentTypeError(f"{text}: No such file or directory")
    _refuse_unless(text, mode, stat.S_ISDIR, "a directory")
    return path


def output_file(text: str) -> Path:
    """A file a command writes whole (`motet run-batch -o`), its directory made if missing: a path that is
    something else (a directory, a device), or lies under something that is no directory, is refused now, not
    once the work it would hold is done."""
    path, mode = _stat(text)
    _refuse_unless(text, mode, stat.S_ISREG, "a regular file")
    return path


def output_directory(text: str) -> Path:
    """A directory a command writes into, made if it is missing (`motet fine-tune --out DIR`, `motet serve
    --data-dir`): a path that is something else (a file), or lies under something that is no directory
    (`/etc/passwd/x`), is refused now."""
    path, mode = _stat(text)  # (a missing parent is made too)
    _refuse_unless(text, mode, stat.S_ISDIR, "a directory")
    return path


def or_url(kind: Callable[[str], Path], schemes: tuple[str, ...] = ()) -> Callable[[str], str]:
    """A flag that takes a local path of `kind` or a URL (`motet run-batch -i https://...`): a URL (of
    `schemes`; any `scheme://...` when none are named) passes as it is given, a path is `kind`'s. The value is
    the text."""

    def parse(text: str) -> str:
        scheme, sep, _ = text.partition("://")
        if sep and (scheme in schemes if schemes else scheme.isalnum()):
            return text
        kind(text)
        return text

    parse.__name__ = kind.__name__
    return parse


def path_setting(kind: Callable[[str], Path], text: str, name: str) -> Path:
    """`kind`'s check of a path that comes from elsewhere than a flag (`$MOTET_DATA_DIR`): a ValueError naming
    `name`, which the command prints as its one line."""
    try:
        return kind(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{name} {e}") from None


class OneLineErrors(argparse.ArgumentParser):
    """A parser whose refusals are one line (argparse's default prints the whole usage first, which for
    `motet serve` is a screenful that hides the error)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)
