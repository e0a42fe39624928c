"""The stored responses' SQLite table: tenant scope, retention by age and by count, a reopen (restart)."""

from __future__ import annotations

import sqlite3
import time

import pytest

from motet.api.response_store import FILENAME, ResponseStore


def response(rid: str, text: str = "hi") -> dict:
    return {"id": rid, "object": "response", "output": [{"type": "message", "content": [{"text": text}]}]}


def test_a_tenant_reads_only_its_own_and_a_reopened_store_still_has_them(tmp_path):
    store = ResponseStore(tmp_path)
    store.put("alice", response("resp_1"), [{"type": "message", "role": "user", "content": "q"}])
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")
    store.close()

    again = ResponseStore(tmp_path)  # a restarted server
    got = again.get("alice", "resp_1")
    assert got.response == response("resp_1")
    assert got.conversation() == [
        {"type": "message", "role": "user", "content": "q"},
        *response("resp_1")["output"],
    ]
    assert again.delete("alice", "resp_1") and again.get("alice", "resp_1") is None
    # the rows are in SQLite itself, keyed by tenant (read here with the sqlite3 module, not the store)
    again.put("bob", response("resp_2"), [])
    rows = sqlite3.connect(tmp_path / FILENAME).execute("SELECT tenant, id FROM responses").fetchall()
    assert rows == [("bob", "resp_2")]


def test_each_tenant_keeps_its_newest(tmp_path):
    store = ResponseStore(tmp_path, max_per_tenant=3)
    for i in range(5):
        store.put("alice", response(f"a{i}"), [])
        time.sleep(0.002)
    store.put("bob", response("b0"), [])
    assert [store.get("alice", f"a{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert store.count("alice") == 3 and store.get("bob", "b0") is not None  # bob's row is not alice's quota


def test_old_responses_expire(tmp_path, monkeypatch):
    store = ResponseStore(tmp_path, max_age_s=60)
    store.put("alice", response("old"), [])
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 61)
    assert store.get("alice", "old") is None  # not read once expired
    store.put("alice", response("new"), [])  # and deleted by the next write
    assert store.count("alice") == 1


def test_retention_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        ResponseStore(tmp_path, max_age_s=0)
    with pytest.raises(ValueError):
        ResponseStore(tmp_path, max_per_tenant=0)
