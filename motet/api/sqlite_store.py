"""The base of the server's SQLite stores: one file's connection, its transactions and keyset pages.

A store (responses, files, batches, usage) gives it a file and a schema and keeps only its own queries.
One connection, shared by the worker threads behind a lock, in autocommit mode so that transactions are
only the ones `_write` opens. Every query runs inside `_read()` or `_write()`: under the lock, with the
file's failures (full, I/O error, locked by another process) raised as `StorageFailure`, which the routes answer
with 507 or 503 (motet/api/storage_errors.py).

What counts as the server's own storage failing, for these stores and for the files beside them: SQLite's and the
OS's errors become one `StorageFailure` (`storage_failures()` maps them where a store touches its files) that says
the real cause in words a tenant may read (never a server path), and whether the disk is full.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

BUSY_TIMEOUT_MS = 5000  # how long another connection's write lock (an operator's shell) is waited for
_BEFORE_ALL = {True: 1 << 62, False: -1}  # a seq before every row, listed newest first (True) or oldest first

T = TypeVar("T")

_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})  # no space, or over a disk quota


class StorageFailure(Exception):
    def __init__(self, cause: str, full: bool):
        super().__init__(cause)
        self.cause, self.full = cause, full

    @classmethod
    def from_os(cls, e: OSError) -> StorageFailure:
        cause = os.strerror(e.errno) if e.errno else type(e).__name__  # str(e) would name the server's paths
        return cls(cause, e.errno in _FULL_ERRNOS)

    @classmethod
    def from_sqlite(cls, e: sqlite3.Error) -> StorageFailure:
        full = getattr(e, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL  # extended code -> primary
        return cls(str(e), full)


def is_storage_failure(e: BaseException) -> bool:
    """SQLite errors that come from the file under it (full, I/O, locked, corrupt), not from a wrong query."""
    return isinstance(e, sqlite3.OperationalError) or type(e) is sqlite3.DatabaseError


@contextlib.contextmanager
def storage_failures() -> Iterator[None]:
    """Raise the storage's failures inside as `StorageFailure`; a wrong query's error stays what it is."""
    try:
        yield
    except sqlite3.Error as e:
        if is_storage_failure(e):
            raise StorageFailure.from_sqlite(e) from e
        raise
    except OSError as e:
        raise StorageFailure.from_os(e) from e


class SQLiteStore:
    def __init__(self, path: Path, schema: Iterable[str] = ()):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        # WAL: a reader elsewhere (a backup, an operator's shell) never blocks the server's writes
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        for statement in schema:
            self._db.execute(statement)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _read(self) -> Iterator[None]:
        with self._lock, storage_failures():
            yield

    @contextlib.contextmanager
    def _write(self) -> Iterator[None]:
        """One transaction: committed whole, or rolled back whole (SQLite may have rolled it back itself,
        e.g. on a full disk: then there is nothing left to roll back, and the first error is the one raised).
        IMMEDIATE takes the write lock at once, so a transaction that reads first never fails upgrading."""
        with self._lock, storage_failures():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise

    def _keyset_page(
        self,
        table: str,
        columns: Sequence[str],
        of_row: Callable[[tuple], T],
        tenant: str,
        after: str | None,
        limit: int,
        *,
        newest_first: bool = True,
        where: str = "",
        args: Sequence = (),
        only: str = "",
        only_args: Sequence = (),
    ) -> tuple[list[T], bool] | None:
        """Up to `limit` of the tenant's rows of `table` in `seq` order (each row's `columns`, made into a
        `T` by `of_row`) after the row whose id is `after`, and whether more follow; None: `after` names no
        row of the tenant's within `where`. `where`, with `args`: the rows listed (a job's events: the cursor
        must be one of them); `only`, with `only_args`: a filter of the rows answered (not of the cursor, which
        may be a row the filter leaves out). By key rather than OFFSET, so a page deep in a long list costs
        only its own rows, and rows added or deleted meanwhile do not shift the pages."""
        scope = f" AND {where}" if where else ""
        with self._read():
            start = _BEFORE_ALL[newest_first]
            if after is not None:
                row = self._db.execute(
                    f"SELECT seq FROM {table} WHERE tenant = ? AND id = ?{scope}", (tenant, after, *args)
                ).fetchone()
                if row is None:
                    return None
                start = row[0]
            rows = self._db.execute(
                f"SELECT {', '.join(columns)} FROM {table}"
                f" WHERE tenant = ? AND seq {'<' if newest_first else '>'} ?{scope}{f' AND {only}' if only else ''}"
                f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?",
                (tenant, start, *args, *only_args, limit + 1),
            ).fetchall()
        return [of_row(r) for r in rows[:limit]], len(rows) > limit
