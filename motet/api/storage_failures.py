"""What counts as the server's own storage failing: SQLite's and the OS's errors become one `StorageFailure`
(`storage_failures()` maps them where a store touches its files) that says the real cause in words a tenant may
read (never a server path), and whether the disk is full. The answer the routes make of it:
motet/api/storage_errors.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
from collections.abc import Iterator

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
