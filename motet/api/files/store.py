"""Tenants' files (`/v1/files`: batch inputs, and the output and error files of batches), on disk.

Each file's bytes are one file under `<data dir>/files/`, named by its id (random, never chosen by a client);
what it is (tenant, name, purpose, size, time) is a row of `files.sqlite3`. Bytes are written whole to a
temporary name and renamed into place before the row is committed, so a row always has its bytes; bytes
with no row (a crash between the two) are removed when the store opens. Every read and write is scoped
to the tenant: another tenant's file reads as missing.

Limits: a file may hold at most `max_file_bytes` (a larger upload is refused while it is read), and a
tenant's files together `max_bytes_per_tenant` (an upload past it is refused). A running batch's answers,
error lines included, count toward its tenant's total as they are recorded (`reserved`; an answer past the
limit is not recorded and the batch stops: motet/api/batches/store.py), so the output and error files written
at its end, never refused (the batch's results must not be lost), stay within it.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from motet.api.sqlite_store import SQLiteStore, storage_failures

FILENAME = "files.sqlite3"
DEFAULT_MAX_FILE_BYTES = 200 << 20  # OpenAI's limit for a batch input file
DEFAULT_MAX_BYTES_PER_TENANT = 10 << 30
MAX_FILENAME_CHARS = 256
_CHUNK = 1 << 20

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS files (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- listing order
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        filename TEXT NOT NULL,
        purpose TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        created_at INTEGER NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, seq)",
)
_COLUMNS = ("id", "tenant", "filename", "purpose", "bytes", "created_at")  # a StoredFile's fields, in order


class FileTooLarge(Exception):
    """An upload over `max_file_bytes`."""


class FileQuotaExceeded(Exception):
    """An upload past the tenant's total (the message says by how much)."""


@dataclass
class StoredFile:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def object(self) -> dict:
        """The OpenAI File object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


def _stored_file(row: tuple) -> StoredFile:
    return StoredFile(*row)


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class FileStore(SQLiteStore):
    def __init__(
        self,
        data_dir: str | Path,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_bytes_per_tenant: int = DEFAULT_MAX_BYTES_PER_TENANT,
    ):
        if max_file_bytes < 1 or max_bytes_per_tenant < 1:
            raise ValueError("--files-max-bytes and --files-max-bytes-per-tenant must be at least 1")
        self.max_file_bytes, self.max_bytes_per_tenant = max_file_bytes, max_bytes_per_tenant
        # bytes a tenant holds outside this store that count as its files (its running batches' answers)
        self.reserved: Callable[[str], int] = lambda tenant: 0
        self.dir = Path(data_dir) / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        super().__init__(Path(data_dir) / FILENAME, _SCHEMA)
        self._remove_orphans()

    # -- writing ---------------------------------------------------------------------------------------------
    def upload(self, tenant: str, filename: str, purpose: str, source: BinaryIO) -> StoredFile:
        """Store a client's file, refused (FileTooLarge, FileQuotaExceeded) before anything is kept."""
        file_id = new_file_id()
        with storage_failures():
            size = self._write_bytes(file_id, _chunks(source), self.max_file_bytes)
            try:
                with self._write():
                    used = self._used(tenant) + self.reserved(tenant)
                    if used + size > self.max_bytes_per_tenant:
                        raise FileQuotaExceeded(
                            f"this tenant's files hold {used} bytes and this one has {size}, over the server's "
                            f"limit of {self.max_bytes_per_tenant} bytes per tenant (--files-max-bytes-per-tenant): "
                            "delete some (DELETE /v1/files/{id})"
                        )
                    return self._insert(file_id, tenant, filename, purpose, size)
            except BaseException:
                self._path(file_id).unlink(missing_ok=True)
                raise

    def put(
        self, file_id: str, tenant: str, filename: str, purpose: str, lines: Iterable[bytes]
    ) -> StoredFile:
        """Store a file the server made (a batch's output), under an id the caller chose so that writing it
        again (a batch finalized twice across a crash) replaces it."""
        with storage_failures():
            size = self._write_bytes(file_id, lines, None)
            with self._write():
                self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
                return self._insert(file_id, tenant, filename, purpose, size)

    def delete(self, tenant: str, file_id: str) -> bool:
        with self._write():
            gone = self._db.execute(
                "DELETE FROM files WHERE tenant = ? AND id = ?", (tenant, file_id)
            ).rowcount
            if gone:
                self._path(file_id).unlink(missing_ok=True)
        return bool(gone)

    # -- reading ---------------------------------------------------------------------------------------------
    def get(self, tenant: str, file_id: str) -> StoredFile | None:
        with self._read():
            row = self._db.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM files WHERE tenant = ? AND id = ?",
                (tenant, file_id),
            ).fetchone()
        return None if row is None else _stored_file(row)

    def page(
        self, tenant: str, after: str | None = None, limit: int = 10_000, order: str = "desc", purpose=None
    ) -> tuple[list[StoredFile], bool] | None:
        """A page of the tenant's files (newest first, or oldest with order "asc") after the file `after`, and
        whether more follow; None: `after` names no file of theirs."""
        filters = {} if purpose is None else {"only": "purpose = ?", "only_args": (purpose,)}
        newest_first = order == "desc"
        return self._keyset_page(
            "files", _COLUMNS, _stored_file, tenant, after, limit, newest_first=newest_first, **filters
        )

    def open(self, stored: StoredFile) -> BinaryIO:
        with storage_failures():
            return open(self._path(stored.id), "rb")  # noqa: SIM115 (the caller closes it)

    def usage(self, tenant: str) -> int:
        """The bytes of the tenant's files (not counting `reserved`)."""
        with self._read():
            return self._used(tenant)

    # -- under the hood --------------------------------------------------------------------------------------
    def _path(self, file_id: str) -> Path:
        return self.dir / file_id

    def _write_bytes(self, file_id: str, chunks: Iterable[bytes], limit: int | None) -> int:
        """The bytes, written whole under the file's name (or not at all); their size."""
        tmp = self.dir / f".{file_id}.partial"
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    size += len(chunk)
                    if limit is not None and size > limit:
                        raise FileTooLarge(
                            f"the file is larger than the server's limit of {limit} bytes per file "
                            "(--files-max-bytes)"
                        )
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(file_id))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return size

    def _insert(self, file_id, tenant, filename, purpose, size) -> StoredFile:
        stored = StoredFile(file_id, tenant, filename[:MAX_FILENAME_CHARS], purpose, size, int(time.time()))
        self._db.execute(
            "INSERT INTO files (id, tenant, filename, purpose, bytes, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            (stored.id, tenant, stored.filename, purpose, size, stored.created_at),
        )
        return stored

    def _used(self, tenant: str) -> int:
        return self._db.execute(
            "SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ?", (tenant,)
        ).fetchone()[0]

    def _remove_orphans(self) -> None:
        known = {row[0] for row in self._db.execute("SELECT id FROM files")}
        for path in self.dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)


def _chunks(source: BinaryIO) -> Iterator[bytes]:
    while chunk := source.read(_CHUNK):
        yield chunk
