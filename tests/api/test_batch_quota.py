"""Every byte a tenant's batch writes counts against its files quota, its error lines included: a line asking
for more logprob entries than a batch line may is refused when the batch is created (400 naming the line and
the limit), a file whose refused lines' answers would pass the quota fails whole before anything runs, a batch
whose next answer would pass it stops there (failed, `quota_exceeded`, its answers so far in its files), and
a cancelled batch's unrun lines are answered only as far as the quota lets; so the tenant's files never
exceed it and another tenant's files and batches still work. A real `motet serve` (tiny model), driven by the
openai SDK; the store on real SQLite."""

from __future__ import annotations

import json

import openai
import pytest

from motet.api.batches.lines import (
    CANCELLED,
    MAX_CUSTOM_ID_CHARS,
    MAX_LINE_LOGPROB_ENTRIES,
    Line,
    compact,
    error_line,
    parse_lines,
    response_line,
)
from motet.api.batches.store import BatchStore
from tests.api.test_batch_api import MODEL, chat_line, jsonl, start, upload, wait
from tests.live_server import Server

QUOTA = 60_000  # bytes of files per tenant


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start(
        tiny_model_dir, tmp_path_factory.mktemp("quota"), "data", "--files-max-bytes-per-tenant", str(QUOTA),
        "--batch-max-in-flight", "4",
    )  # fmt: skip
    yield srv
    srv.stop()


def sdk(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def files_bytes(client: openai.OpenAI) -> int:
    return sum(f.bytes for f in client.files.list())


def clear(client: openai.OpenAI) -> None:
    """Delete the tenant's files (a test before may have left it at its quota)."""
    for f in client.files.list():
        client.files.delete(f.id)


def test_a_line_asking_for_too_many_logprobs_is_refused_at_create(server):
    alice = sdk(server, "sk-alice")
    lines = [chat_line("ok", 0), chat_line("big", 1, max_tokens=128, n=4, logprobs=True, top_logprobs=20)]
    source = upload(alice, jsonl(lines))
    with pytest.raises(openai.BadRequestError) as e:
        alice.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    err = e.value.body
    assert err["code"] == "line_too_large" and err["param"] == "input_file_id"
    assert "line 2" in err["message"] and str(MAX_LINE_LOGPROB_ENTRIES) in err["message"]
    assert "10752" in err["message"]  # 4 x 128 x (1 + 20)
    assert not [b for b in alice.batches.list()]  # nothing was created
    alice.files.delete(source.id)


def test_a_batch_stops_where_its_answers_reach_the_quota_and_other_tenants_are_unaffected(server):
    alice, bob = sdk(server, "sk-alice"), sdk(server, "sk-bob")
    clear(alice)
    # each answer with 16 tokens and 3 top logprobs is a few KB: 100 of them are far over the 60 KB quota
    lines = [
        chat_line(f"r{i}", i, max_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=3)
        for i in range(100)
    ]
    source = upload(alice, jsonl(lines))
    batch = alice.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch, _ = wait(alice, batch.id)
    assert batch.status == "failed"
    (error,) = batch.errors.data
    assert error.code == "quota_exceeded" and "--files-max-bytes-per-tenant" in error.message
    assert error.line is not None and f"line {error.line}" in error.message
    counts = batch.request_counts
    assert counts.total == 100 and counts.completed > 0 and counts.failed == 0
    assert files_bytes(alice) <= QUOTA  # the output file included
    assert batch.error_file_id is None  # the lines not run are in neither file
    outputs = [json.loads(x) for x in alice.files.content(batch.output_file_id).text.splitlines()]
    assert len(outputs) == counts.completed and all(o["response"]["status_code"] == 200 for o in outputs)
    assert error.line not in {int(o["custom_id"][1:]) + 1 for o in outputs}
    # alice is at her quota: her next upload is refused; bob's files and batches work as before
    with pytest.raises(openai.BadRequestError):
        upload(alice, b"x" * (QUOTA - files_bytes(alice) + 1))
    bob_source = upload(bob, jsonl([chat_line("b0", 0), chat_line("b1", 1)]))
    bob_batch = bob.batches.create(
        input_file_id=bob_source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    bob_batch, _ = wait(bob, bob_batch.id)
    assert bob_batch.status == "completed" and bob_batch.request_counts.completed == 2
    reply = bob.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].message is not None


def test_quotas_and_the_kv_disk_tier_fit_the_free_space(tmp_path, monkeypatch, caplog):
    import shutil
    from types import SimpleNamespace

    from motet.api import server as server_module

    free = 8 << 30
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=free, used=0, free=free))
    args = SimpleNamespace(files_max_bytes_per_tenant=100 << 30, responses_max_bytes_per_tenant=1 << 20,
                           adapters_max_bytes_per_tenant=server_module.ADAPTERS_PER_TENANT)  # fmt: skip
    config = SimpleNamespace(kv_disk_gb=50.0)
    with caplog.at_level("INFO", logger="motet.server"):
        server_module.fit_to_disk(args, config, tmp_path / "not-yet" / "data")  # measured where it will be
    assert args.files_max_bytes_per_tenant == free // 4  # a quarter of the free space
    assert args.responses_max_bytes_per_tenant == 1 << 20  # under it: as set
    assert args.adapters_max_bytes_per_tenant == free // 4  # the default, over it: lowered
    assert config.kv_disk_gb == 2.0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("--files-max-bytes-per-tenant" in m for m in warned) and any(
        "--kv-disk-gb" in m for m in warned
    )


def test_a_file_of_bad_lines_cannot_write_past_the_quota(server):
    """30 KB of lines that are not JSON answer ~2.8 MB of error lines: before, each batch of the file wrote
    them all (three put the tenant at 150x its quota). Now the batch fails whole, before anything runs."""
    alice = sdk(server, "sk-alice")
    clear(alice)
    source = upload(alice, b"x\n" * 15_000)
    for _ in range(3):
        batch = alice.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch, _ = wait(alice, batch.id)
        assert batch.status == "failed" and batch.output_file_id is None and batch.error_file_id is None
        (error,) = batch.errors.data
        assert error.code == "quota_exceeded" and "--files-max-bytes-per-tenant" in error.message
        assert "line 1: not valid JSON" in error.message  # what to fix
    assert files_bytes(alice) == source.bytes  # the input alone
    alice.files.delete(source.id)


def test_lines_that_never_ran_are_answered_within_the_quota(tmp_path):
    """A cancelled (or expired) batch's unrun lines are answered `batch_cancelled` in its error file as far as
    the tenant's quota lets: before, 50,000 of them wrote ~10 MB whatever the quota."""
    store = BatchStore(tmp_path)
    batch = store.create("t", "/v1/chat/completions", "file-x", "24h", None)
    lines = [Line(i, f"c{i}", "/v1/chat/completions", {"model": MODEL}) for i in range(1, 101)]
    assert store.load(batch["id"], lines, max_lines=1000) is None
    room = 5_000
    left = store.answer_rest(batch["id"], *CANCELLED, room)
    written = b"".join(store.results(batch["id"], ok=False))
    assert 0 < left < 100 and len(written.splitlines()) == 100 - left
    assert len(written) <= store.pending_bytes("t") <= room  # the answers, and the copies of the rest
    assert store.answer_rest(batch["id"], *CANCELLED, room) == left  # nothing more fits
    store.close()


def test_a_batch_keeps_its_copy_of_the_requests_within_the_quota(tmp_path):
    """A batch keeps a copy of its requests until they are answered: before, any number of batches of one
    input file could each copy it into the store, whatever the quota."""
    store = BatchStore(tmp_path)
    lines = [
        Line(i, f"c{i}", "/v1/chat/completions", {"model": MODEL, "pad": "x" * 100}) for i in range(1, 11)
    ]
    copy = sum(len(json.dumps(line.body)) for line in lines)
    room = copy * 2 + copy // 2
    loaded = [store.create("t", "/v1/chat/completions", "file-x", "24h", None)["id"] for _ in range(3)]
    assert [store.load(b, lines, max_lines=100, room=room) for b in loaded[:2]] == [None, None]
    assert store.pending_bytes("t") == 2 * copy
    code, message = store.load(loaded[2], lines, max_lines=100, room=room)
    assert code == "quota_exceeded" and "--files-max-bytes-per-tenant" in message
    assert store.pending_bytes("t") == 2 * copy  # the refused batch keeps nothing
    store.record(loaded[0], 1, response_line("c1", 200, {}), room)  # an answer takes its request's place
    assert store.pending_bytes("t") == 2 * copy - len(json.dumps(lines[0].body)) + len(compact(
        response_line("c1", 200, {}))) + 1  # fmt: skip
    store.close()


def test_an_error_line_is_small_whatever_its_line_held():
    """An error line echoes its custom_id (the format's) and at most a short quote of what was wrong."""
    cid, huge = "c" * MAX_CUSTOM_ID_CHARS, "x" * 100_000
    body = {"model": MODEL}
    raw = [
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body},
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body},  # a duplicate
        {"custom_id": "u", "method": "POST", "url": huge, "body": body},
        {"custom_id": "m", "method": huge, "url": "/v1/chat/completions", "body": body},
        {"custom_id": "f", "method": "POST", "url": "/v1/chat/completions", "body": body, huge: 1},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": huge},
        "{" + huge,
    ]
    refused = [line for line in parse_lines(json.dumps(r).encode() if isinstance(r, dict) else r.encode()
                                            for r in raw) if line.error]  # fmt: skip
    assert len(refused) == 6
    for line in refused:
        size = len(compact(error_line(line.custom_id, *line.error)).encode())
        assert size <= len(line.custom_id or "") + 400, (line.error[0], size)
