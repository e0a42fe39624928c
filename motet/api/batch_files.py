"""`motet run-batch`'s files: -i and -o take local paths, or http(s) URLs (the input fetched with GET, the output
sent with PUT); the output is written whole (to a temporary name, then renamed). Plain I/O, which the parser's
checks read (`URL_SCHEMES`) before the API's modules are imported (motet/api/offline_batch.py runs the batch)."""

from __future__ import annotations

import os
import tempfile
import urllib.request
from pathlib import Path

URL_SCHEMES = ("http", "https")  # what -i and -o take besides local paths


def _is_url(path: str) -> bool:
    return path.startswith(tuple(f"{scheme}://" for scheme in URL_SCHEMES))


def read_input(path: str) -> list[bytes]:
    if _is_url(path):
        with urllib.request.urlopen(path) as r:  # noqa: S310 (the user's own URL)
            return r.read().splitlines(keepends=True)
    with open(path, "rb") as f:
        return f.readlines()


def write_output(path: str, lines: list[bytes]) -> None:
    if _is_url(path):
        request = urllib.request.Request(path, data=b"".join(lines), method="PUT")
        with urllib.request.urlopen(request):  # noqa: S310
            return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)  # (-o's check: nothing but directories on its way)
    with tempfile.NamedTemporaryFile("wb", dir=target.parent or ".", delete=False, suffix=".partial") as f:
        f.writelines(lines)
    os.replace(f.name, target)
