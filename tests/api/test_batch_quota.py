"""Every byte a tenant's batch writes counts against its files quota: a line asking for more logprob entries
than a batch line may is refused when the batch is created (400 naming the line and the limit), and a batch
whose answers would pass the tenant's quota records the rest as `quota_exceeded` errors, so the tenant's
files never exceed it and another tenant's files and batches still work. A real `motet serve` (tiny model),
driven by the openai SDK."""

from __future__ import annotations

import json

import openai
import pytest

from motet.api.batches.lines import MAX_LINE_LOGPROB_ENTRIES
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


def test_answers_past_the_quota_become_errors_and_other_tenants_are_unaffected(server):
    alice, bob = sdk(server, "sk-alice"), sdk(server, "sk-bob")
    # each answer with 64 tokens and 5 top logprobs is several KB: 40 of them are far over the 60 KB quota
    lines = [
        chat_line(f"r{i}", i, max_tokens=64, ignore_eos=True, logprobs=True, top_logprobs=5)
        for i in range(40)
    ]
    source = upload(alice, jsonl(lines))
    batch = alice.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch, _ = wait(alice, batch.id)
    assert batch.status == "completed"
    counts = batch.request_counts
    assert counts.total == 40 and counts.completed > 0 and counts.failed > 0
    assert files_bytes(alice) <= QUOTA  # the output and error files included
    errors = [json.loads(x) for x in alice.files.content(batch.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"quota_exceeded"}
    assert "--files-max-bytes-per-tenant" in errors[0]["error"]["message"]
    outputs = [json.loads(x) for x in alice.files.content(batch.output_file_id).text.splitlines()]
    assert len(outputs) == counts.completed and all(o["response"]["status_code"] == 200 for o in outputs)
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
    args = SimpleNamespace(files_max_bytes_per_tenant=100 << 30, responses_max_bytes_per_tenant=1 << 20)
    config = SimpleNamespace(kv_disk_gb=50.0)
    with caplog.at_level("INFO", logger="motet.server"):
        server_module.fit_to_disk(args, config, tmp_path / "not-yet" / "data")  # measured where it will be
    assert args.files_max_bytes_per_tenant == free // 4  # a quarter of the free space
    assert args.responses_max_bytes_per_tenant == 1 << 20  # under it: as set
    assert config.kv_disk_gb == 2.0
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("--files-max-bytes-per-tenant" in m for m in warned) and any(
        "--kv-disk-gb" in m for m in warned
    )
