"""The stored responses' SQLite table, read back with the sqlite3 module where it matters: tenant scope, a
conversation as a chain (each turn stores what it adds, as the model sees it), deleting or expiring an
ancestor, quotas that refuse rather than evict, a full database (PRAGMA max_page_count) rolled back cleanly,
a reopen (restart), and the first layout migrated."""

from __future__ import annotations

import itertools
import json
import sqlite3
import time

import pytest

from motet.api.responses.store import (
    FILENAME,
    MAX_TURNS,
    SCHEMA_VERSION,
    ConversationTooLong,
    QuotaExceeded,
    ResponseStore,
)
from motet.api.sqlite_store import StorageFailure


def response(rid: str, text: str = "hi", reasoning: str = "") -> dict:
    output = [{"id": f"rs_{rid}", "type": "reasoning", "summary": [], "status": "completed",
               "content": [{"type": "reasoning_text", "text": reasoning}]}] if reasoning else []  # fmt: skip
    output.append({"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})  # fmt: skip
    return {"id": rid, "object": "response", "status": "completed", "instructions": None, "output": output}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def answer(text: str) -> dict:  # an output message as the model sees it again
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def rows(tmp_path) -> list[tuple]:
    db = sqlite3.connect(tmp_path / FILENAME)
    return sorted(db.execute("SELECT tenant, id, visible FROM responses").fetchall())


def logical_bytes(tmp_path) -> int:
    """The database's size as SQLite counts it (its pages, the WAL's latest commit included)."""
    db = sqlite3.connect(tmp_path / FILENAME)
    return db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]


def chain(store: ResponseStore, tenant: str, turns: int, prefix: str = "r", **kw) -> list[str]:
    ids, previous = [], None
    for i in range(turns):
        history = store.conversation(tenant, previous).items if previous else []
        store.put(tenant, response(f"{prefix}{i}", f"a{i}", **kw), [user(f"q{i}")], previous, history)
        ids.append(previous := f"{prefix}{i}")
    return ids


def test_a_tenant_reads_only_its_own_and_a_reopened_store_still_has_them(tmp_path):
    store = ResponseStore(tmp_path)
    store.put("alice", response("resp_1"), [user("q")])
    assert store.get("bob", "resp_1") is None and not store.delete("bob", "resp_1")
    assert store.conversation("bob", "resp_1") is None
    store.close()

    again = ResponseStore(tmp_path)  # a restarted server
    assert again.get("alice", "resp_1") == response("resp_1")
    assert again.conversation("alice", "resp_1").items == [user("q"), answer("hi")]
    assert again.delete("alice", "resp_1") and again.get("alice", "resp_1") is None
    again.put("bob", response("resp_2"), [])
    assert rows(tmp_path) == [("bob", "resp_2", 1)]  # in SQLite itself, keyed by tenant


def test_a_conversation_is_a_chain_of_what_each_turn_adds(tmp_path):
    store = ResponseStore(tmp_path)
    ids = chain(store, "alice", 4)
    conversation = store.conversation("alice", ids[-1])
    assert conversation.turns == 4
    assert conversation.items == [item for i in range(4) for item in (user(f"q{i}"), answer(f"a{i}"))]
    # each row holds its own turn only: the first user message is stored once, not once per turn
    db = sqlite3.connect(tmp_path / FILENAME)
    assert [json.loads(i) for (i,) in db.execute("SELECT input FROM responses ORDER BY turn")] == [
        [user(f"q{i}")] for i in range(4)
    ]


def test_what_the_model_never_sees_is_not_stored(tmp_path):
    store = ResponseStore(tmp_path)
    blob = "E" * 100_000
    sent = [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": blob},
        {"role": "user", "content": [{"type": "input_text", "text": "q"}], "id": "m1", "status": "completed"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x",
         "annotations": [{"type": "url_citation", "url": blob}], "logprobs": [{"token": blob}]}]},
    ]  # fmt: skip
    store.put("alice", response("r1", reasoning="thinking"), sent)
    assert store.usage("alice")[1] < 2_000  # none of the blobs
    assert store.conversation("alice", "r1").items == [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
        answer("hi"),  # this response's reasoning item is not shown to the model again either
    ]
    assert store.get("alice", "r1") == response("r1", reasoning="thinking")  # but GET returns it whole


def test_a_long_chain_grows_the_database_linearly(tmp_path):
    store = ResponseStore(tmp_path)
    sizes, previous = [logical_bytes(tmp_path)], None
    for i in range(12):  # each turn: a 20 kB answer the model sees, a 200 kB reasoning it never sees again
        history = store.conversation("alice", previous).items if previous else []
        sent = [{"type": "reasoning", "id": f"rs{i}", "summary": [], "encrypted_content": "E" * 200_000},
                user(f"q{i}")]  # fmt: skip
        store.put("alice", response(f"r{i}", "A" * 20_000), sent, previous, history)
        previous = f"r{i}"
        sizes.append(logical_bytes(tmp_path))
    growth = [b - a for a, b in itertools.pairwise(sizes)]
    # what each turn adds (whole pages: 16-24 kB), not the history nor the reasoning
    assert max(growth) <= 32_768 and 12 * 20_000 <= sum(growth) <= 12 * 26_000, growth
    assert store.conversation("alice", previous).items[-1] == answer("A" * 20_000)


def test_deleting_or_expiring_an_ancestor_keeps_the_later_turns_whole(tmp_path, monkeypatch):
    store = ResponseStore(tmp_path, max_age_s=60)
    a, b, c = chain(store, "alice", 3)
    whole = store.conversation("alice", c).items
    assert store.delete("alice", b)
    assert store.get("alice", b) is None and store.conversation("alice", b) is None  # as if gone
    assert not store.delete("alice", b)
    assert store.get("alice", c) == response(c, "a2") and store.conversation("alice", c).items == whole
    assert rows(tmp_path) == [("alice", a, 1), ("alice", b, 0), ("alice", c, 1)]  # b kept, hidden, for c

    store.put("alice", response("d", "a3"), [user("q3")], c, whole)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 61)  # a, c and d expire: d holds the chain
    store.put("alice", response("e"), [])  # the next write purges: d, then the hidden turns only d needed
    assert rows(tmp_path) == [("alice", "e", 1)]
    monkeypatch.undo()

    x, y = chain(store, "bob", 2, prefix="x")
    assert store.delete("bob", y) and store.delete("bob", x)  # no later turn: nothing hidden is kept
    assert [r for r in rows(tmp_path) if r[0] == "bob"] == []
    p, q = chain(store, "bob", 2, prefix="p")
    assert store.delete("bob", p) and rows(tmp_path)[-2:] == [("bob", p, 0), ("bob", q, 1)]
    assert store.delete("bob", q) and [r for r in rows(tmp_path) if r[0] == "bob"] == []  # p went with q


def test_continuing_a_response_deleted_meanwhile_stores_its_conversation_whole(tmp_path):
    store = ResponseStore(tmp_path)
    (a,) = chain(store, "alice", 1)
    history = store.conversation("alice", a).items
    store.delete("alice", a)  # between reading the conversation and storing the next turn
    store.put("alice", response("b", "a1"), [user("q1")], a, history)
    assert store.conversation("alice", "b").items == [user("q0"), answer("a0"), user("q1"), answer("a1")]


def test_quotas_refuse_and_never_evict(tmp_path):
    store = ResponseStore(tmp_path, max_per_tenant=3)
    for i in range(3):
        store.put("alice", response(f"a{i}"), [])
    with pytest.raises(QuotaExceeded, match="limit of 3 per tenant"):
        store.admit("alice", [user("q")])
    with pytest.raises(QuotaExceeded, match="limit of 3 per tenant"):
        store.put("alice", response("a3"), [])
    assert [store.get("alice", f"a{i}") is not None for i in range(4)] == [True, True, True, False]
    store.put("bob", response("b0"), [])  # bob's rows are not alice's quota
    store.delete("alice", "a0")
    store.put("alice", response("a3"), [])  # room again

    small = ResponseStore(tmp_path / "small", max_bytes_per_tenant=4_000)
    small.admit("alice", [user("x" * 1_000)])
    small.put("alice", response("r0"), [user("x" * 1_000)])
    with pytest.raises(QuotaExceeded, match="limit of 4000 bytes per tenant"):
        small.admit("alice", [user("x" * 3_000)])
    with pytest.raises(QuotaExceeded, match="limit of 4000 bytes per tenant"):
        small.put("alice", response("r1"), [user("x" * 3_000)])
    assert small.usage("alice") == (1, small.usage("alice")[1]) and small.usage("alice")[1] < 1_500


def test_a_conversation_has_a_bounded_length(tmp_path):
    store = ResponseStore(tmp_path)
    store.admit("alice", [], turns=MAX_TURNS - 1)
    with pytest.raises(ConversationTooLong):
        store.admit("alice", [], turns=MAX_TURNS)


def test_a_full_database_fails_cleanly_and_the_store_goes_on(tmp_path):
    store = ResponseStore(tmp_path)
    a, b = chain(store, "alice", 2)
    db = store._db  # the store's own connection: max_page_count is per connection
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(StorageFailure) as e:
        for i in range(50):
            store.put("alice", response(f"big{i}", "B" * 8_000), [user("q")], b, [])
    assert e.value.full and "full" in e.value.cause  # SQLite's own words, not a failed ROLLBACK's
    assert not db.in_transaction
    assert store.conversation("alice", b).turns == 2  # reads still work
    written = [i for i in range(50) if store.get("alice", f"big{i}")]
    assert written == list(range(len(written)))  # every write is whole or absent
    db.execute("PRAGMA max_page_count = 1073741823")  # space is freed
    store.put("alice", response("after"), [user("q")], b, [])
    store.close()
    assert ResponseStore(tmp_path).conversation("alice", "after").items[-2:] == [user("q"), answer("hi")]


LEGACY_SCHEMA = """
CREATE TABLE responses (tenant TEXT NOT NULL, id TEXT NOT NULL, created_at REAL NOT NULL, response TEXT NOT NULL,
                        context TEXT NOT NULL, PRIMARY KEY (tenant, id));
CREATE INDEX responses_by_age ON responses (tenant, created_at);
"""


def test_the_first_layout_is_migrated_and_stays_readable(tmp_path):
    legacy = sqlite3.connect(tmp_path / FILENAME)
    legacy.executescript(LEGACY_SCHEMA)
    context = [{"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": "E" * 50_000}, user("q0"),
               answer("a0"), user("q1")]  # fmt: skip
    legacy.execute("INSERT INTO responses VALUES ('alice', 'old', ?, ?, ?)",
                   (time.time(), json.dumps(response("old", "a1")), json.dumps(context)))  # fmt: skip
    legacy.commit()
    legacy.close()

    store = ResponseStore(tmp_path)
    db = sqlite3.connect(tmp_path / FILENAME)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert store.get("alice", "old") == response("old", "a1")
    assert store.conversation("alice", "old").items == [user("q0"), answer("a0"), user("q1"), answer("a1")]
    assert store.usage("alice")[1] < 2_000  # the reasoning blob is not kept
    store.put("alice", response("new", "a2"), [user("q2")], "old", [])
    store.close()
    assert ResponseStore(tmp_path).conversation("alice", "new").turns == 2  # opened again: no migration


def test_limits_must_be_positive(tmp_path):
    for bad in (dict(max_age_s=0), dict(max_age_s=float("nan")), dict(max_per_tenant=0),
                dict(max_bytes_per_tenant=0)):  # fmt: skip
        with pytest.raises(ValueError):
            ResponseStore(tmp_path, **bad)
