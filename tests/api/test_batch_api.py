"""The OpenAI Batch API (/v1/files, /v1/batches) and `motet run-batch`, driven by the openai SDK against a real
`motet serve` on a tiny random model: a 200-line batch with per-line errors, cancelling, tenants kept apart, a
batch's lines run as its tenant (outside its interactive limits, through a key rotated by SIGHUP, beside
10,000 keys), a batch that survives a SIGKILL half-way, and the offline runner as a subprocess. The stores are
checked on real SQLite and disk too, and the scheduling policy with plain inputs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from motet.actors.system import Stats
from motet.api.auth import Authenticator
from motet.api.batches.lines import Line, error_line, parse_lines, response_line
from motet.api.batches.priority import LowPriority
from motet.api.batches.runner import BatchGate, tenant_has_key
from motet.api.batches.store import BatchStore
from motet.api.files.store import FileQuotaExceeded, FileStore, FileTooLarge
from tests.live_server import ROOT, Server, keys_file

MODEL = "tiny"
KEYS = {"sk-ops": {"admin": True}, "sk-alice": "alice", "sk-bob": "bob"}  # an admin key speaks for no tenant
MAX_FILE_BYTES = 400_000
TERMINAL = ("completed", "failed", "cancelled", "expired")
RPM, TPM = 3, 200  # the limited tenant's interactive limits: far below what its 12-line batch uses
SERVER_KEYS = {  # the module's server: a tenant with limits, and 10,000 keys in all
    **KEYS,
    "sk-limited": {"tenant": "limited", "limits": {"requests_per_minute": RPM, "tokens_per_minute": TPM,
                                                   "max_concurrent_requests": 1}},
    "sk-carol": "carol",
    **{f"sk-filler-{i:05d}": f"filler-{i}" for i in range(10_000)},
    "sk-dave": "dave",  # the last key
}  # fmt: skip


def start(tiny_model_dir, tmp: Path, data: str, *extra: str, keys: dict = KEYS) -> Server:
    return Server(
        tmp,
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-keys", keys_file(tmp, keys),
        "--data-dir", str(tmp / data), "--threads", "1", "--max-model-len", "1024", "--max-num-seqs", "8",
        "--files-max-bytes", str(MAX_FILE_BYTES), *extra,
        start_timeout=180,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start(tiny_model_dir, tmp_path_factory.mktemp("batches"), "data", "--batch-max-in-flight", "8",
                keys=SERVER_KEYS)  # fmt: skip
    yield srv
    srv.stop()


def sdk(server: Server, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def chat_line(custom_id: str, i: int, max_tokens: int = 8, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": max_tokens,
            "temperature": 0, **extra}  # fmt: skip
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def upload(client: openai.OpenAI, data: bytes, name: str = "in.jsonl"):
    return client.files.create(file=(name, data), purpose="batch")


def wait(client: openai.OpenAI, batch_id: str, timeout: float = 300, until=None) -> tuple[object, list[str]]:
    """Poll until the batch finishes (or `until(batch)` holds): the batch, and the statuses seen."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        if (until(batch) if until else batch.status in TERMINAL) or time.monotonic() > deadline:
            return batch, seen
        time.sleep(0.2)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


# -- files ------------------------------------------------------------------------------------------------------
def test_files_upload_list_retrieve_content_delete(server):
    alice, bob = sdk(server), sdk(server, "sk-bob")
    data = jsonl([chat_line("a", 1)]) + "Ünïcödé 🎵\n".encode()
    f = upload(alice, data, "mine.jsonl")
    assert (f.object, f.purpose, f.filename, f.bytes) == ("file", "batch", "mine.jsonl", len(data))
    assert alice.files.retrieve(f.id) == f
    assert alice.files.content(f.id).content == data
    g = upload(alice, b"{}\n", "second.jsonl")
    assert [x.id for x in alice.files.list(purpose="batch")][:2] == [g.id, f.id]  # newest first
    assert [x.id for x in alice.files.list(order="asc")][-2:] == [f.id, g.id]
    page = alice.files.list(limit=1)
    assert page.data[0].id == g.id and page.has_more
    assert [x.id for x in alice.files.list(after=g.id, limit=1)] == [f.id]

    # another tenant's file reads as missing, everywhere
    assert f.id not in [x.id for x in bob.files.list()]
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)

    deleted = alice.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(f.id)
    assert alice.files.content(g.id).content == b"{}\n"


def test_file_upload_limits(server):
    alice = sdk(server)
    with pytest.raises(openai.APIStatusError) as e:
        upload(alice, b"x" * (MAX_FILE_BYTES + 1))
    assert e.value.status_code == 413 and "--files-max-bytes" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        alice.files.create(file=("f.jsonl", b"{}"), purpose="assistants")  # (batch and fine-tune are served)
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.BadRequestError) as e:
        alice.files.create(file=("f.jsonl", b"{}"), purpose="batch", extra_body={"colour": "red"})
    assert e.value.body["param"] == "colour"


def test_file_store_limits_on_disk(tmp_path):
    """Real SQLite and disk: a file over the limit is refused while it is written, a tenant's total is bounded,
    and neither leaves anything behind; a server-written file is replaced when written again."""
    import io

    store = FileStore(tmp_path, max_file_bytes=100, max_bytes_per_tenant=250)
    store.upload("a", "one", "batch", io.BytesIO(b"x" * 100))
    store.upload("a", "two", "batch", io.BytesIO(b"x" * 100))
    with pytest.raises(FileQuotaExceeded, match="--files-max-bytes-per-tenant"):
        store.upload("a", "three", "batch", io.BytesIO(b"x" * 100))
    with pytest.raises(FileTooLarge, match="--files-max-bytes"):
        store.upload("b", "big", "batch", io.BytesIO(b"x" * 101))
    store.upload("b", "fits", "batch", io.BytesIO(b"x" * 100))  # b's total is b's own
    assert store.usage("a") == 200 and store.usage("b") == 100
    assert len(list((tmp_path / "files").iterdir())) == 3  # nothing half-written is left
    store.put("file-out", "a", "out.jsonl", "batch_output", [b"1\n"])
    store.put("file-out", "a", "out.jsonl", "batch_output", [b"2\n", b"3\n"])
    (out,) = [f for f in store.page("a")[0] if f.id == "file-out"]
    assert out.bytes == 4 and store.open(out).read() == b"2\n3\n"
    (tmp_path / "files" / "orphan").write_bytes(b"no row")
    store.close()
    FileStore(tmp_path).close()  # bytes without a row (a crash between the two) go when the store opens
    assert not (tmp_path / "files" / "orphan").exists()


# -- batches ----------------------------------------------------------------------------------------------------
def test_batch_of_200_lines_answers_each_line_once(server):
    alice = sdk(server)
    lines: list = [chat_line(f"req-{i}", i) for i in range(190)]
    refused = {  # custom_id -> (status code or error code, param)
        "bad-field": (chat_line("bad-field", 0, colour="red"), (400, "colour")),
        "bad-temperature": (chat_line("bad-temperature", 0, temperature=-1.0), (400, "temperature")),
        "bad-model": ({**chat_line("bad-model", 0), "body": {**chat_line("x", 0)["body"], "model": "nope"}},
                      (404, "model")),
        "streamed": (chat_line("streamed", 0, stream=True), (400, "stream")),
        "wrong-url": ({**chat_line("wrong-url", 0), "url": "/v1/completions"}, ("invalid_url", None)),
        "wrong-method": ({**chat_line("wrong-method", 0), "method": "GET"}, ("invalid_method", None)),
        "bad-body": ({**chat_line("bad-body", 0), "body": [1, 2]}, ("invalid_body", None)),
    }  # fmt: skip
    lines += [line for line, _ in refused.values()]
    lines.insert(50, chat_line("req-5", 5))  # a custom_id used before
    lines.insert(100, "{not json")
    lines.insert(150, {"method": "POST", "url": "/v1/chat/completions", "body": {}})  # no custom_id
    lines.insert(120, "")  # blank lines are no requests
    assert len([line for line in lines if line != ""]) == 200

    batch = alice.batches.create(input_file_id=upload(alice, jsonl(lines)).id, endpoint="/v1/chat/completions",
                                 completion_window="24h", metadata={"run": "200"})  # fmt: skip
    assert batch.status == "validating" and batch.metadata == {"run": "200"}
    live = [alice.chat.completions.create(**chat_line("x", i)["body"]) for i in range(3)]  # beside the batch
    batch, seen = wait(alice, batch.id)
    assert batch.status == "completed", batch
    assert seen[-1] == "completed" and set(seen) <= {"validating", "in_progress", "finalizing", "completed"}
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        200,
        190,
        10,
    )
    assert batch.model == MODEL and batch.in_progress_at and batch.completed_at

    output, errors = read_lines(alice, batch.output_file_id), read_lines(alice, batch.error_file_id)
    assert len(output) + len(errors) == 200  # every line answered once
    assert sorted(o["custom_id"] for o in output) == sorted(f"req-{i}" for i in range(190))
    assert len({o["id"] for o in output + errors}) == 200
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200
        ChatCompletion.model_validate(o["response"]["body"])  # the SDK's own type
    by_id = {o["custom_id"]: o["response"]["body"] for o in output}
    for i, answer in enumerate(live):  # greedy: the batch answered as the live route does
        assert by_id[f"req-{i}"]["choices"][0]["message"]["content"] == answer.choices[0].message.content
    usage = [o["response"]["body"]["usage"] for o in output]
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in usage)
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in usage)

    assert Counter(e["custom_id"] for e in errors) == Counter([*refused, "req-5", None, None])
    errs = {e["custom_id"]: e for e in errors if e["custom_id"] is not None}
    for custom_id, (_, (expected, param)) in refused.items():
        e = errs[custom_id]
        if isinstance(expected, int):  # refused by the route: its status and OpenAI error body
            assert e["error"] is None and e["response"]["status_code"] == expected, e
            assert e["response"]["body"]["error"]["param"] == param
        else:  # never sent
            assert e["response"] is None and e["error"]["code"] == expected, e
    assert errs["req-5"]["error"]["code"] == "duplicate_custom_id"
    assert {e["error"]["code"] for e in errors if e["custom_id"] is None} == {
        "invalid_json_line",
        "invalid_custom_id",
    }

    files = {f.id: f for f in alice.files.list()}
    for file_id in (batch.output_file_id, batch.error_file_id):
        assert files[file_id].purpose == "batch_output"
        assert files[file_id].bytes == len(alice.files.content(file_id).content)


def test_batches_are_the_tenants_own(server):
    alice, bob = sdk(server), sdk(server, "sk-bob")
    f = upload(alice, jsonl([chat_line("one", 1)]))
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.cancel(batch.id)
    assert batch.id not in [b.id for b in bob.batches.list()]
    with pytest.raises(openai.BadRequestError) as e:  # alice's file, from bob
        bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.body["param"] == "input_file_id"
    done, _ = wait(alice, batch.id)
    assert done.status == "completed"
    out = read_lines(alice, done.output_file_id)
    assert [o["custom_id"] for o in out] == ["one"]
    with pytest.raises(openai.NotFoundError):  # its output file is alice's too
        bob.files.content(done.output_file_id)


def test_batch_create_refuses_what_it_cannot_run(server):
    alice = sdk(server)
    f = upload(alice, jsonl([chat_line("one", 1)]))
    cases = [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input_file_id": "file-nope"}, "input_file_id"),
        ({"extra_body": {"colour": "red"}}, "colour"),
        (
            {"extra_body": {"output_expires_after": {"anchor": "created_at", "seconds": 3600}}},
            "output_expires_after",
        ),
    ]
    for change, param in cases:
        kwargs = {
            "input_file_id": f.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **change,
        }
        with pytest.raises(openai.BadRequestError) as e:
            alice.batches.create(**kwargs)
        assert e.value.body["param"] == param, (change, e.value.body)

    empty = alice.batches.create(input_file_id=upload(alice, b"\n\n").id, endpoint="/v1/chat/completions",
                                 completion_window="24h")  # fmt: skip
    failed, _ = wait(alice, empty.id)
    assert failed.status == "failed" and failed.errors.data[0].code == "invalid_file"
    done, _ = wait(alice, alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:  # a batch's output file is no input
        alice.batches.create(input_file_id=done.output_file_id, endpoint="/v1/chat/completions",
                             completion_window="24h")  # fmt: skip
    assert e.value.body["param"] == "input_file_id"


def nested_line(custom_id: str, depth: int) -> bytes:
    """A chat line whose body holds a value nested `depth` levels below the body (the body itself is level 1)."""
    value = "[" * (depth - 1) + "]" * (depth - 1)
    head = json.dumps(chat_line(custom_id, 0))[:-1]  # the line without its closing brace
    return f'{head[: head.rindex("}")]}, "extra": {value}}}}}'.encode()


def test_a_deeply_nested_line_is_answered_in_the_error_file_not_a_500(server):
    """A 2 KB input whose line nests 1,000 levels (past what Python's parser recurses) is a line error, as a
    request body nested past 64 levels is a 400: the batch is created and every other line runs."""
    alice = sdk(server)
    deep = nested_line("deep", 1000)
    assert len(deep) < 2300  # about 2 KB
    data = jsonl([chat_line("first", 1)]) + deep + b"\n" + nested_line("over", 66) + b"\n"
    batch = alice.batches.create(input_file_id=upload(alice, data).id, endpoint="/v1/chat/completions",
                                 completion_window="24h")  # fmt: skip
    done, _ = wait(alice, batch.id)
    assert done.status == "completed", done
    assert [o["custom_id"] for o in read_lines(alice, done.output_file_id)] == ["first"]
    errors = {e["error"]["message"].split(":")[0]: e for e in read_lines(alice, done.error_file_id)}
    assert set(errors) == {"line 2", "line 3"}
    assert errors["line 2"]["error"]["code"] == "invalid_json_line"
    assert errors["line 3"]["error"]["code"] == "invalid_body" and errors["line 3"]["custom_id"] == "over"
    for e in errors.values():
        assert "nested more than 64 levels deep" in e["error"]["message"], e
    assert "Traceback" not in server.log_path.read_text()


def test_batch_lines_are_bounded_as_request_bodies_are():
    """parse_lines applies the request body's guard (64 levels below the body, valid Unicode) and never
    raises, however deep a line nests."""
    for depth in (1000, 100_000):
        (line,) = parse_lines([nested_line("deep", depth)])
        assert line.error[0] == "invalid_json_line" and line.error[1].startswith("line 1: "), line.error
        assert "nested more than 64 levels deep" in line.error[1]
    (ok,) = parse_lines([nested_line("ok", 64)])
    assert ok.error is None and ok.custom_id == "ok"
    (over,) = parse_lines([nested_line("over", 65)])
    assert over.error[0] == "invalid_body" and "nested more than 64 levels deep" in over.error[1]
    assert "body.extra" in over.error[1]  # where
    surrogate = {**chat_line("x", 0), "custom_id": "\ud800"}  # parses, but no answer line could hold it
    (line,) = parse_lines([json.dumps(surrogate).encode()])
    assert line.error[0] == "invalid_custom_id"
    (line,) = parse_lines([json.dumps(chat_line("x", 0, user="\ud800")).encode()])
    assert line.error[0] == "invalid_body" and "invalid Unicode" in line.error[1]


def test_cancel_answers_every_line_once(server):
    alice = sdk(server)
    lines = [chat_line(f"c-{i}", i, max_tokens=64, ignore_eos=True) for i in range(120)]
    batch = alice.batches.create(input_file_id=upload(alice, jsonl(lines)).id, endpoint="/v1/chat/completions",
                                 completion_window="24h")  # fmt: skip
    wait(alice, batch.id, until=lambda b: b.request_counts.completed >= 5)
    cancelling = alice.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done, _ = wait(alice, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 120 and counts.completed + counts.failed == 120 and 5 <= counts.completed < 120
    output, errors = read_lines(alice, done.output_file_id), read_lines(alice, done.error_file_id)
    assert sorted(o["custom_id"] for o in output + errors) == sorted(line["custom_id"] for line in lines)
    assert len(output) == counts.completed and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert alice.batches.cancel(batch.id).status == "cancelled"  # again: nothing changes
    finished = alice.batches.create(input_file_id=upload(alice, jsonl(lines[:1])).id,
                                    endpoint="/v1/chat/completions", completion_window="24h")  # fmt: skip
    wait(alice, finished.id)
    with pytest.raises(openai.ConflictError):  # a finished batch cannot be cancelled
        alice.batches.cancel(finished.id)


def test_batches_list_pages_newest_first(server):
    bob = sdk(server, "sk-bob")
    f = upload(bob, jsonl([chat_line("one", 1)]))
    made = [bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
            for _ in range(3)]  # fmt: skip
    listed = [b.id for b in bob.batches.list(limit=1)]  # the SDK follows `after`
    assert listed[:3] == made[::-1]
    page = bob.batches.list(limit=2)
    assert [b.id for b in page.data] == made[:0:-1] and page.has_more


def test_other_endpoints_in_batches(server):
    alice = sdk(server)
    for endpoint, body, kind in (
        ("/v1/completions", {"model": MODEL, "prompt": "The quick", "max_tokens": 4}, Completion),
        (
            "/v1/responses",
            {"model": MODEL, "input": "hello", "max_output_tokens": 4, "store": False},
            Response,
        ),
    ):
        line = {"custom_id": "x", "method": "POST", "url": endpoint, "body": body}
        batch = alice.batches.create(input_file_id=upload(alice, jsonl([line])).id, endpoint=endpoint,
                                     completion_window="24h")  # fmt: skip
        done, _ = wait(alice, batch.id)
        (out,) = read_lines(alice, done.output_file_id)
        kind.model_validate(out["response"]["body"])
        assert done.usage.output_tokens == 4


# -- a batch's tenant ---------------------------------------------------------------------------------------------
def create(client: openai.OpenAI, lines: list) -> object:
    return client.batches.create(
        input_file_id=upload(client, jsonl(lines)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )


def test_batch_lines_run_outside_the_tenants_interactive_limits(server):
    """docs/api/batches.md and docs/tenants.md: Batch API lines are not counted against the tenant's
    requests, tokens or concurrency per minute. Before, 12 lines against 3 requests a minute waited on 429s
    for minutes, and took the tenant's interactive allowance."""
    limited = sdk(server, "sk-limited")
    batch, _ = wait(limited, create(limited, [chat_line(f"r{i}", i) for i in range(12)]).id, timeout=60)
    assert batch.status == "completed" and batch.request_counts.completed == 12
    # the tenant's interactive allowance is whole: the batch took none of its requests or tokens
    raw = limited.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.http_response.status_code == 200
    assert raw.headers["x-ratelimit-remaining-requests"] == str(RPM - 1)
    # ... and of its tokens, only this answer's own (a collected answer's headers carry its final charge)
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(TPM - raw.parse().usage.total_tokens)


def test_a_key_rotated_by_sighup_mid_batch_leaves_every_line_answered(server):
    """The operator replaces carol's key in the keys file and sends SIGHUP while her batch runs: every line
    is still answered as hers (before, the lines sent after the reload were answered 401)."""
    carol = sdk(server, "sk-carol")
    batch = create(carol, [chat_line(f"r{i}", i, max_tokens=48, ignore_eos=True) for i in range(24)])
    running, _ = wait(carol, batch.id, until=lambda b: b.request_counts.completed >= 1)
    assert running.status == "in_progress" and running.request_counts.completed < 24  # mid-batch
    rotated = {k: v for k, v in SERVER_KEYS.items() if k != "sk-carol"} | {"sk-carol-2": "carol"}
    (server.log_path.parent / "keys.json").write_text(json.dumps(rotated))
    server.proc.send_signal(signal.SIGHUP)
    carol = sdk(server, "sk-carol-2")  # the batch is the tenant's: read with its new key
    deadline = time.monotonic() + 30
    while True:  # the reload is done when the new key is known
        try:
            carol.batches.retrieve(batch.id)
            break
        except openai.AuthenticationError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with pytest.raises(openai.AuthenticationError):
        sdk(server, "sk-carol").batches.retrieve(batch.id)  # the old key is gone
    batch, _ = wait(carol, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (24, 0)
    outputs = read_lines(carol, batch.output_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"r{i}" for i in range(24))
    assert all(o["response"]["status_code"] == 200 for o in outputs)


def test_health_stays_fast_while_a_batch_runs_beside_10000_keys(server):
    """Before, the runner found a key of the batch's tenant by authenticating each key in turn (each a pass
    over all keys): for the last of 10,000 keys, 10^8 comparisons on the event loop, /health stalled ~25 s."""
    dave = sdk(server, "sk-dave")
    batch = create(dave, [chat_line("one", 1)])
    worst = 0.0
    with httpx.Client(timeout=120) as http:
        while True:
            started = time.perf_counter()
            assert http.get(f"{server.url}/health").status_code == 200
            worst = max(worst, time.perf_counter() - started)
            batch = dave.batches.retrieve(batch.id)
            if batch.status in TERMINAL:
                break
            time.sleep(0.02)
    assert batch.status == "completed" and batch.request_counts.completed == 1
    assert worst < 10.0, (
        f"/health took {worst:.1f} s while the batch ran"
    )  # a stall, not a speed: 25-79 s before


def test_a_tenant_whose_keys_were_all_removed_gets_no_more_lines_run():
    """A rotation keeps the tenant; removing every key of it does not (its lines are answered 401)."""
    auth = Authenticator({"sk-a": "alice", "sk-ops": {"admin": True}})
    assert tenant_has_key(auth, "alice") and not tenant_has_key(auth, "bob")
    assert tenant_has_key(Authenticator({"sk-a2": "alice"}), "alice")
    assert not tenant_has_key(Authenticator({"sk-b": "bob"}), "alice")
    assert tenant_has_key(Authenticator(), "default")  # auth off


def test_live_requests_go_before_batch_lines(tiny_model_dir, tmp_path):
    """One sequence at a time and 8 batch lines allowed in flight: a batch line is sent only while nothing
    waits, so a live request of the same tenant waits behind at most the line running and one waiting, not
    behind 8 (without the policy, the engine's FIFO would put it behind every line already sent). Counted from
    before the live request is sent, so one more line may end on the way (seen under load: 3)."""
    srv = start(tiny_model_dir, tmp_path, "data", "--max-num-seqs", "1", "--batch-max-in-flight", "8")
    try:
        alice = sdk(srv)
        lines = [chat_line(f"l-{i}", i, max_tokens=64, ignore_eos=True) for i in range(40)]
        batch = alice.batches.create(input_file_id=upload(alice, jsonl(lines)).id,
                                     endpoint="/v1/chat/completions", completion_window="24h")  # fmt: skip
        wait(alice, batch.id, until=lambda b: b.request_counts.completed >= 1)
        for i in range(3):
            before = alice.batches.retrieve(batch.id).request_counts.completed
            alice.chat.completions.create(**chat_line("live", i, max_tokens=8)["body"])
            passed = alice.batches.retrieve(batch.id).request_counts.completed - before
            assert passed <= 3, f"the live request waited for {passed} batch lines"
        alice.batches.cancel(batch.id)
        assert wait(alice, batch.id)[0].status == "cancelled"
    finally:
        srv.stop()


@pytest.mark.slow
def test_batch_survives_sigkill_half_way(tiny_model_dir, tmp_path):
    """Killed with SIGKILL mid-batch and started again on the same --data-dir, the batch resumes where it
    stopped (the lines answered before keep their answer and count) and answers every line exactly once."""
    srv = start(tiny_model_dir, tmp_path, "data", "--batch-max-in-flight", "2")
    alice = sdk(srv)
    # 80 lines of 48 tokens, ~10 a second here (200 took 20 s of decode): killed a quarter of the way, 60 lines ahead
    lines = [chat_line(f"k-{i}", i, max_tokens=48, ignore_eos=True) for i in range(80)]
    batch = alice.batches.create(input_file_id=upload(alice, jsonl(lines)).id, endpoint="/v1/chat/completions",
                                 completion_window="24h")  # fmt: skip
    before, _ = wait(alice, batch.id, until=lambda b: b.request_counts.completed >= 20)
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait()
    srv.log.close()
    assert before.status == "in_progress" and before.request_counts.completed < 80

    srv = start(tiny_model_dir, tmp_path, "data", "--batch-max-in-flight", "2")
    try:
        alice = sdk(srv)
        resumed = alice.batches.retrieve(batch.id)
        assert resumed.request_counts.completed >= before.request_counts.completed  # recorded before counted
        done, _ = wait(alice, batch.id)
        output, errors = read_lines(alice, done.output_file_id), read_lines(alice, done.error_file_id)
    finally:
        srv.stop()
    assert (
        done.status == "completed" and done.request_counts.completed == 80 and done.request_counts.failed == 0
    )
    assert errors == []
    assert sorted(o["custom_id"] for o in output) == sorted(line["custom_id"] for line in lines)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 48 for o in output)


# -- the offline runner -----------------------------------------------------------------------------------------
def test_run_batch_cli(tiny_model_dir, tmp_path):
    lines: list = []
    for i in range(12):
        lines.append(chat_line(f"chat-{i}", i))
        lines.append({"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"model": MODEL, "prompt": f"The quick {i}", "max_tokens": 5, "temperature": 0}})  # fmt: skip
        lines.append({"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses",
                      "body": {"model": MODEL, "input": f"hello {i}", "max_output_tokens": 5}})  # fmt: skip
    lines += [chat_line("chat-0", 0), "{oops", chat_line("refused", 0, temperature=-1.0)]
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines))
    cmd = [sys.executable, "-m", "motet.api.cli", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
           str(tmp_path / "out.jsonl"), "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--threads", "1",
           "--max-model-len", "1024", "--max-num-seqs", "8"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr
    assert "Running batch" in done.stderr and "39/39" in done.stderr  # the progress bar
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [
        line["custom_id"] if isinstance(line, dict) else None for line in lines
    ]
    types = {"chat": ChatCompletion, "cmpl": Completion, "resp": Response}
    for o in out[:36]:
        assert o["response"]["status_code"] == 200 and o["error"] is None, o
        types[o["custom_id"].split("-")[0]].model_validate(o["response"]["body"])
    duplicate, malformed, refused = out[36:]
    assert duplicate["error"]["code"] == "duplicate_custom_id"
    assert malformed["error"]["code"] == "invalid_json_line"
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "temperature"

    missing = subprocess.run([*cmd[:5], str(tmp_path / "none.jsonl"), *cmd[6:]], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert missing.returncode != 0 and "none.jsonl" in missing.stderr


# -- the pieces on their own ------------------------------------------------------------------------------------
def stats(queued: int = 0, waiting: int = 0, running: int = 0) -> Stats:
    return Stats(queued=queued, num_waiting=waiting, num_running=running)


def test_low_priority_takes_only_what_live_traffic_leaves():
    policy = LowPriority(max_in_flight=2)
    assert policy.admits(stats(), 0) and policy.admits(stats(running=1), 1)
    assert not policy.admits(stats(running=2), 2)  # its own bound
    assert not policy.admits(stats(), 1)  # the line sent is not seen running yet: on its way
    assert not policy.admits(stats(queued=1), 0)  # a request waits in a queue
    assert not policy.admits(stats(waiting=1), 0)  # or admitted, not yet running
    with pytest.raises(ValueError, match="--batch-max-in-flight"):
        LowPriority(0)


def test_gate_gives_batches_turns():
    """Two batches asking at once get slots in turn, each only when the policy admits one more."""
    load = {"queued": 1}
    gate = BatchGate(LowPriority(1), lambda: stats(**load), lambda: True)
    order: list[str] = []

    async def batch(name: str):
        for _ in range(3):
            await gate.acquire()
            order.append(name)
            await anyio.sleep(0.05)
            gate.release()

    async def main():
        async with anyio.create_task_group() as tg:
            tg.start_soon(batch, "a")
            tg.start_soon(batch, "b")
            await anyio.sleep(0.2)
            assert order == []  # live work waits: nothing goes
            load["queued"] = 0

    anyio.run(main)
    assert order == ["a", "b", "a", "b", "a", "b"]


def test_store_answers_a_line_once(tmp_path):
    store = BatchStore(tmp_path)
    batch = store.create("t", "/v1/chat/completions", "file-x", "24h", None)
    lines = [Line(1, "a", "/v1/chat/completions", {"model": "m"}), Line(2, "b", "/v1/chat/completions", {}),
             Line(3, None, error=("invalid_json_line", "line 3: no"))]  # fmt: skip
    assert store.load(batch["id"], lines, max_lines=10) is None
    assert [p.custom_id for p in store.pending(batch["id"], 0)] == ["a", "b"]
    ok = response_line("a", 200, {"usage": {"prompt_tokens": 3, "completion_tokens": 2}})
    assert store.record(batch["id"], 1, ok)
    assert not store.record(batch["id"], 1, error_line("a", "x", "again"))  # a second answer changes nothing
    store.close()
    store = BatchStore(tmp_path)  # what was recorded survives
    got = store.get("t", batch["id"])
    assert got["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    assert got["usage"]["input_tokens"] == 3 and got["usage"]["output_tokens"] == 2
    assert [p.custom_id for p in store.pending(batch["id"], 0)] == ["b"]
    assert store.get("other", batch["id"]) is None
    assert store.load(batch["id"], lines, max_lines=2) is not None  # over the limit: refused whole
