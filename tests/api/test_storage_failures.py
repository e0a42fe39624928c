"""Bounded storage and clean failures over HTTP, in-process on a tiny random model, through the official
`openai` SDK where it parses the answers: a conversation with large reasoning items grows the real SQLite
database linearly; per-tenant quotas answer 400 naming the limit; a database made genuinely full
(`PRAGMA max_page_count`) or locked by another connection still returns the answer (marked not stored,
with a warning) and a stream still ends with its terminal event; an adapter upload that hits ENOSPC (a
fault-injecting os.write) is a 507 with Retry-After and leaves no file behind; a chat stream that fails
midway ends with an error event and [DONE].
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
from pathlib import Path

import openai
import pytest

import motet.api.completions.routes as api_openai
from motet.actors.system import ServingSystem
from motet.api.adapters.store import AdapterStore
from motet.api.auth import Authenticator
from motet.api.completions.generation import WARNING_HEADER
from motet.api.responses.store import FILENAME, ResponseStore
from motet.api.sqlite_store import StorageFailure
from motet.api.state import ServerState
from motet.api.storage_errors import RETRY_AFTER_FULL_S
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from tests.peft_adapters import make_adapter
from tests.served_app import served_app

ALICE, BOB = {"Authorization": "Bearer k-alice"}, {"Authorization": "Bearer k-bob"}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    data = tmp_path_factory.mktemp("storage")
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=512, max_num_seqs=4, max_model_len=2048,
                       max_num_batched_tokens=2048, max_lora_rank=8)  # fmt: skip
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir))
    state = ServerState(
        system,
        ["tiny"],
        auth=Authenticator({"k-alice": "alice", "k-bob": "bob"}),
        responses=ResponseStore(data),
        adapters=AdapterStore(system, data, reserved=("tiny",), max_bytes=1 << 20),
    )
    with served_app(state) as client:
        yield client, state, data


@pytest.fixture
def client(served):
    return served[0]


@pytest.fixture
def store(served, tmp_path, monkeypatch) -> ResponseStore:
    """A fresh store of this test's own, in place of the served one."""
    fresh = ResponseStore(tmp_path)
    monkeypatch.setattr(served[1], "responses", fresh)
    yield fresh
    fresh.close()


def sdk(client, key: str = "k-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)


def logical_bytes(path: Path) -> int:
    db = sqlite3.connect(path / FILENAME)
    return db.execute("PRAGMA page_count").fetchone()[0] * db.execute("PRAGMA page_size").fetchone()[0]


def fill(store: ResponseStore) -> None:
    """The database is full: it may not grow by a page (SQLite answers SQLITE_FULL, as on a full disk),
    and its pages are filled with small rows until not even one more fits."""
    db = store._db  # max_page_count holds per connection: the store's own
    db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(StorageFailure):
        for i in range(100_000):
            store.put("filler", {"id": f"f{i}", "output": []}, [])


def events(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]


# -- bounded storage -------------------------------------------------------------------------------------------
def test_a_conversation_with_large_reasoning_items_grows_the_database_linearly(client, store, tmp_path):
    alice = sdk(client)
    sizes, previous, messages = [logical_bytes(tmp_path)], None, []
    for turn in range(12):  # each turn resends a 256 kB encrypted reasoning item, as reasoning clients do
        sent = [{"type": "reasoning", "id": f"rs_{turn}", "summary": [], "encrypted_content": "E" * (256 << 10)},
                {"role": "user", "content": f"Turn {turn}: go on."}]  # fmt: skip
        r = alice.responses.create(model="tiny", input=sent, previous_response_id=previous, max_output_tokens=4,
                                   temperature=0)  # fmt: skip
        messages += [{"role": "user", "content": f"Turn {turn}: go on."},
                     {"role": "assistant", "content": r.output_text}]  # fmt: skip
        previous = r.id
        sizes.append(logical_bytes(tmp_path))
    growth = [b - a for a, b in zip(sizes, sizes[1:], strict=False)]
    assert max(growth) <= 16 << 10, growth  # a turn's own few items: neither the blobs nor the history
    # the rebuilt conversation is what the model saw: the same prompt as the chat messages
    ref = alice.chat.completions.create(model="tiny", messages=messages[:-1], max_tokens=4, temperature=0)
    assert r.usage.input_tokens == ref.usage.prompt_tokens


def test_quotas_answer_400_naming_the_limit(client, served, tmp_path, monkeypatch):
    monkeypatch.setattr(
        served[1], "responses", ResponseStore(tmp_path, max_per_tenant=2, max_bytes_per_tenant=6_000)
    )
    alice = sdk(client)
    for _ in range(2):
        alice.responses.create(model="tiny", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        alice.responses.create(model="tiny", input="hi", max_output_tokens=2)
    body = e.value.body
    assert body["param"] == "store" and body["code"] == "storage_quota_exceeded"
    assert "limit of 2 per tenant" in body["message"]
    assert alice.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False).store is False
    bob = sdk(client, "k-bob")
    bob.responses.create(model="tiny", input="hi", max_output_tokens=2)  # alice's limit is not bob's
    with pytest.raises(openai.BadRequestError) as e:
        bob.responses.create(model="tiny", input="x" * 7_000, max_output_tokens=2)
    assert (
        e.value.body["code"] == "storage_quota_exceeded" and "limit of 6000 bytes" in e.value.body["message"]
    )


def test_a_stored_chain_survives_deleting_an_ancestor(client, store):
    alice = sdk(client)
    a = alice.responses.create(model="tiny", input="one", max_output_tokens=3, temperature=0)
    b = alice.responses.create(model="tiny", input="two", previous_response_id=a.id, max_output_tokens=3,
                               temperature=0)  # fmt: skip
    alice.responses.delete(a.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(a.id)
    assert alice.responses.retrieve(b.id).output_text == b.output_text
    c = alice.responses.create(model="tiny", input="three", previous_response_id=b.id, max_output_tokens=3,
                               temperature=0)  # fmt: skip
    ref = alice.chat.completions.create(
        model="tiny", max_tokens=3, temperature=0,
        messages=[{"role": "user", "content": "one"}, {"role": "assistant", "content": a.output_text},
                  {"role": "user", "content": "two"}, {"role": "assistant", "content": b.output_text},
                  {"role": "user", "content": "three"}],
    )  # fmt: skip
    assert c.usage.input_tokens == ref.usage.prompt_tokens


def test_an_overlong_id_is_not_echoed_whole(client, store):
    long_id = "resp_" + "x" * 100_000
    r = client.get(f"/v1/responses/{long_id[:20_000]}", headers=ALICE)
    assert r.status_code == 404 and len(r.text) < 1_000
    r = client.post(
        "/v1/responses", headers=ALICE, json={"model": "tiny", "input": "x", "previous_response_id": long_id}
    )
    assert r.status_code == 400 and len(r.text) < 1_000


# -- a full or failing database --------------------------------------------------------------------------------
def test_a_full_database_still_returns_the_answer_marked_not_stored(client, store):
    alice = sdk(client)
    first = alice.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=4, temperature=0)
    fill(store)
    raw = alice.responses.with_raw_response.create(model="tiny", input="Hello", previous_response_id=first.id,
                                                   max_output_tokens=4, temperature=0)  # fmt: skip
    r = raw.parse()
    assert raw.http_response.status_code == 200 and r.status == "incomplete" and r.output_text  # 4 tokens
    assert r.store is False and "storage is full" in raw.headers[WARNING_HEADER]
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    assert alice.responses.retrieve(first.id).id == first.id  # reads still work, the connection is fine
    store._db.execute("PRAGMA max_page_count = 1073741823")  # space is freed: storing works again
    again = alice.responses.create(model="tiny", input="Hello", previous_response_id=first.id, max_output_tokens=4,
                                   temperature=0)  # fmt: skip
    assert again.store is True and alice.responses.retrieve(again.id).output_text == r.output_text


def test_a_full_database_still_ends_a_stream_with_its_terminal_event(client, store):
    alice = sdk(client)
    fill(store)
    with alice.responses.stream(model="tiny", input="Hello", max_output_tokens=6, temperature=0) as stream:
        sent = list(stream)  # parsed by the SDK as its typed events
    deltas = "".join(e.delta for e in sent if e.type == "response.output_text.delta")
    last = sent[-1]
    assert last.type == "response.incomplete"  # the terminal event (6 tokens: cut by max_output_tokens)
    assert last.response.output_text == deltas and last.response.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(last.response.id)


def test_a_locked_database_is_a_503_with_retry_after(client, store, tmp_path):
    store._db.execute("PRAGMA busy_timeout = 50")
    alice = sdk(client)
    r = alice.responses.create(model="tiny", input="hi", max_output_tokens=2)
    other = sqlite3.connect(tmp_path / FILENAME, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another writer holds the database
    try:
        deleted = client.delete(f"/v1/responses/{r.id}", headers=ALICE)
        assert deleted.status_code == 503 and deleted.headers["Retry-After"]
        error = deleted.json()["error"]
        assert error["code"] == "storage_unavailable" and "database is locked" in error["message"]
        raw = alice.responses.with_raw_response.create(model="tiny", input="hi", max_output_tokens=2)
        assert raw.parse().store is False and "database is locked" in raw.headers[WARNING_HEADER]
    finally:
        other.execute("ROLLBACK")
    assert client.delete(f"/v1/responses/{r.id}", headers=ALICE).status_code == 200


def test_a_stream_failing_midway_ends_with_its_terminal_event(client, store, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr("motet.api.responses.routes.OutputItems.feed", broken)
    with client.stream("POST", "/v1/responses", headers=ALICE,
                       json={"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": True}) as r:  # fmt: skip
        body = "".join(r.iter_text())
    sent = events(body)
    assert (
        sent[-1]["type"] == "response.failed" and "RuntimeError" in sent[-1]["response"]["error"]["message"]
    )

    monkeypatch.setattr(api_openai, "chat_logprobs", broken)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "logprobs": True}  # fmt: skip
    with client.stream("POST", "/v1/chat/completions", headers=ALICE, json=chat) as r:
        body = r.read().decode()
    assert body.endswith("data: [DONE]\n\n")
    assert events(body.replace("data: [DONE]", ""))[-1]["error"]["type"] == "server_error"


# -- adapter uploads -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["write", "fsync"])
def test_an_adapter_upload_on_a_full_disk_is_a_507_and_leaves_nothing(
    served, tiny_model_dir, tmp_path, monkeypatch, fault
):
    client, _, data = served
    path = make_adapter(tiny_model_dir, tmp_path / "ad", seed=0)
    files = [("files", (f.name, f.read_bytes())) for f in sorted(path.iterdir()) if f.name != "README.md"]
    adapters_dir = data / "adapters"
    real = {"write": os.write, "fsync": os.fsync}

    def adapter_file(fd) -> bool:
        target = os.readlink(f"/proc/self/fd/{fd}")
        return target.startswith(str(adapters_dir)) and os.path.isfile(target)

    def write_until_full(fd, data):  # the disk fills up midway through the first adapter file
        if adapter_file(fd):
            real["write"](fd, bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real["write"](fd, data)

    def fsync_full(fd):  # as NFS and thin-provisioned disks report it: when the data is flushed
        if adapter_file(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real["fsync"](fd)

    monkeypatch.setattr(os, fault, write_until_full if fault == "write" else fsync_full)
    r = client.post("/v1/adapters", data={"name": "a"}, files=files, headers=ALICE)
    assert r.status_code == 507 and r.headers["Retry-After"] == str(RETRY_AFTER_FULL_S)
    error = r.json()["error"]
    assert error["code"] == "storage_full" and "No space left on device" in error["message"]
    assert str(data) not in r.text  # the cause, not the server's paths
    assert [p for p in adapters_dir.rglob("*") if p.is_file()] == []  # nothing half-written
    assert client.get("/v1/adapters/a", headers=ALICE).status_code == 404
    monkeypatch.undo()
    assert client.post("/v1/adapters", data={"name": "a"}, files=files, headers=ALICE).status_code == 200
    assert client.delete("/v1/adapters/a", headers=ALICE).status_code == 200
