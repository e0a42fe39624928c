"""The SQLite stores' base (motet/api/sqlite_store.py) on a real SQLite file: a transaction is committed or
rolled back whole; the file's failures (made full with `PRAGMA max_page_count`, locked by a second
connection) and the OS's (a missing file) come out as `StorageFailure`, while a query's own error (a UNIQUE
violation) stays what it was; keyset pages in both orders, filtered, past their end and after an unknown id.
"""

from __future__ import annotations

import errno
import sqlite3

import pytest

from motet.api.sqlite_store import SQLiteStore, StorageFailure

_SCHEMA = (
    """CREATE TABLE notes (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        kind TEXT NOT NULL
    )""",
)


class Notes(SQLiteStore):
    def add(self, tenant: str, note_id: str, kind: str = "plain") -> None:
        with self._write():
            self._db.execute("INSERT INTO notes (id, tenant, kind) VALUES (?, ?, ?)", (note_id, tenant, kind))

    def ids(self) -> list[str]:
        with self._read():
            return [r[0] for r in self._db.execute("SELECT id FROM notes ORDER BY seq")]

    def page(self, tenant, after, limit, newest_first=True, kind=None, scope=None):
        """`kind`: a filter of the rows answered (the cursor may be any row); `scope`: the rows listed (the cursor
        must be one of them, as a job's events)."""
        filters = {} if kind is None else {"only": "kind = ?", "only_args": (kind,)}
        filters |= {} if scope is None else {"where": "kind = ?", "args": (scope,)}
        return self._keyset_page(
            "notes", ("id",), lambda row: row[0], tenant, after, limit, newest_first=newest_first, **filters
        )


@pytest.fixture
def notes(tmp_path):
    store = Notes(tmp_path / "deep" / "notes.sqlite3", _SCHEMA)
    yield store
    store.close()


def test_the_file_is_made_in_wal_mode_with_a_busy_timeout(notes, tmp_path):
    assert (tmp_path / "deep" / "notes.sqlite3").exists()
    assert notes._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert notes._db.execute("PRAGMA busy_timeout").fetchone()[0] == 5000


def test_a_write_is_committed_whole_or_rolled_back_whole(notes, tmp_path):
    notes.add("a", "n1")
    with pytest.raises(RuntimeError), notes._write():
        notes._db.execute("INSERT INTO notes (id, tenant, kind) VALUES ('n2', 'a', 'plain')")
        raise RuntimeError("the caller changed its mind")
    assert not notes._db.in_transaction
    other = sqlite3.connect(tmp_path / "deep" / "notes.sqlite3")  # what another reader sees: the commit only
    assert [r[0] for r in other.execute("SELECT id FROM notes")] == ["n1"]
    other.close()


def test_a_querys_own_error_is_not_a_storage_failure(notes):
    notes.add("a", "n1")
    with pytest.raises(sqlite3.IntegrityError):
        notes.add("a", "n1")
    assert notes.ids() == ["n1"]


def test_a_full_file_is_a_storage_failure_and_the_store_goes_on_once_space_is_freed(notes):
    db = notes._db
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(StorageFailure) as failed:
        for i in range(100_000):
            notes.add("a", f"n{i}-" + "x" * 200)
    assert failed.value.full and not db.in_transaction
    kept = notes.ids()
    db.execute("PRAGMA max_page_count = 1073741823")
    notes.add("a", "after")
    assert notes.ids() == [*kept, "after"]


def test_a_file_locked_by_another_connection_is_a_storage_failure(notes, tmp_path):
    notes._db.execute("PRAGMA busy_timeout = 50")
    other = sqlite3.connect(tmp_path / "deep" / "notes.sqlite3", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StorageFailure) as failed:
            notes.add("a", "n1")
        assert not failed.value.full and "locked" in failed.value.cause
    finally:
        other.execute("ROLLBACK")
        other.close()
    notes.add("a", "n1")


def test_the_oss_errors_are_storage_failures_that_name_no_path(notes, tmp_path):
    missing = tmp_path / "secret-server-path" / "gone"
    with pytest.raises(StorageFailure) as failed, notes._read():
        missing.open("rb")
    assert failed.value.cause == "No such file or directory" and not failed.value.full
    assert "secret-server-path" not in str(failed.value)
    with pytest.raises(StorageFailure) as failed, notes._write():
        notes._db.execute("INSERT INTO notes (id, tenant, kind) VALUES ('n1', 'a', 'plain')")
        raise OSError(errno.ENOSPC, "No space left on device")  # as a file written inside the transaction
    assert failed.value.full
    assert notes.ids() == []  # the transaction it broke is rolled back


def test_keyset_pages(notes):
    for i in range(5):
        notes.add("a", f"a{i}", kind="odd" if i % 2 else "even")
        notes.add("b", f"b{i}")
    assert notes.page("a", None, 2) == (["a4", "a3"], True)
    assert notes.page("a", "a3", 2) == (["a2", "a1"], True)
    assert notes.page("a", "a1", 2) == (["a0"], False)
    assert notes.page("a", None, 3, newest_first=False) == (["a0", "a1", "a2"], True)
    assert notes.page("a", "a2", 3, newest_first=False) == (["a3", "a4"], False)
    assert notes.page("a", None, 5, kind="even") == (["a4", "a2", "a0"], False)
    assert notes.page("a", "a4", 1, kind="odd") == (["a3"], True)
    assert notes.page("a", "a3", 1, scope="odd") == (["a1"], False)
    assert notes.page("a", "a4", 1, scope="odd") is None  # a cursor outside the rows listed
    assert notes.page("a", "b2", 2) is None  # another tenant's id reads as unknown
    assert notes.page("a", "nope", 2) is None
    notes.add("a", "a5")  # a row added meanwhile does not shift a page already begun
    assert notes.page("a", "a3", 2) == (["a2", "a1"], True)
