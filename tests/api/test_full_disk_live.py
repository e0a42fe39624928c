"""A real `motet serve` (tiny model) whose --data-dir is a small tmpfs that fills up: the disk is genuinely full
(ENOSPC from the kernel, SQLite's "database or disk is full"), then freed, then the server restarts.

Answers are still returned, marked not stored, with a warning; a stream ends with its terminal event; a
delete and an adapter upload are 507 with Retry-After and leave nothing half-written; once space is freed
everything works again, and after a restart every acknowledged response is there. Mounting a tmpfs needs
root (CAP_SYS_ADMIN): elsewhere this file is skipped (tests/api/test_storage_failures.py covers the same paths
with a database made full by `PRAGMA max_page_count` and a fault-injecting os.write).
"""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from tests.live_server import Server, keys_file
from tests.peft_adapters import make_adapter

KEYS = {"sk-alice": "alice"}
MODEL = "tiny"


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    where = tmp_path_factory.mktemp("small-disk")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def start(tiny_model_dir, small_disk: Path, tmp: Path) -> Server:
    return Server(
        tmp,
        "--model", str(tiny_model_dir), "--served-model-name", MODEL, "--api-keys", keys_file(tmp, KEYS),
        "--data-dir", str(small_disk / "data"), "--threads", "1", "--max-model-len", "512",
        start_timeout=120,
    )  # fmt: skip


def fill(disk: Path) -> Path:
    """Write zeros until the kernel says ENOSPC; the file stays until `free`."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        try:  # the last bytes, a page at a time
            while True:
                f.write(b"\0" * 512)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_a_disk_that_fills_up_then_frees(tiny_model_dir, small_disk, tmp_path):
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", seed=1)
    files = [("files", (f.name, f.read_bytes())) for f in sorted(adapter.iterdir()) if f.name != "README.md"]
    server = start(tiny_model_dir, small_disk, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-alice", max_retries=0, timeout=120)
        http = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sk-alice"}, timeout=120)
        kw = dict(model=MODEL, max_output_tokens=4, temperature=0)
        stored = [client.responses.create(input="My name is Ada.", **kw)]
        filler = fill(small_disk)

        raw = client.responses.with_raw_response.create(
            input="Hello", previous_response_id=stored[0].id, **kw
        )
        answer = raw.parse()
        assert raw.http_response.status_code == 200 and answer.output_text and answer.store is False
        assert "storage is full" in raw.headers["X-Motet-Warning"]
        with client.responses.stream(input="Hello", **kw) as stream:
            last = list(stream)[-1]
        assert last.type in ("response.completed", "response.incomplete") and last.response.store is False
        assert client.responses.retrieve(stored[0].id).output_text == stored[0].output_text  # reads work

        deleted = http.delete(f"/v1/responses/{stored[0].id}")
        assert deleted.status_code == 507 and deleted.headers["Retry-After"]
        assert deleted.json()["error"]["code"] == "storage_full"
        upload = http.post("/v1/adapters", data={"name": "a"}, files=files)
        assert upload.status_code == 507 and upload.json()["error"]["code"] == "storage_full", upload.text
        assert [p for p in (small_disk / "data" / "adapters").rglob("*") if p.is_file()] == []
        assert httpx.get(f"{server.url}/health").status_code == 200

        filler.unlink()  # space is freed
        stored.append(client.responses.create(input="Hello", previous_response_id=stored[0].id, **kw))
        assert stored[-1].store is True
        assert http.post("/v1/adapters", data={"name": "a"}, files=files).status_code == 200
    finally:
        server.stop()

    server = start(tiny_model_dir, small_disk, tmp_path)  # a restart: everything acknowledged is there
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-alice", max_retries=0, timeout=120)
        for r in stored:
            assert client.responses.retrieve(r.id).output_text == r.output_text
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(answer.id)  # answered, never acknowledged as stored
        assert "a" in [m.id for m in client.models.list()]
    finally:
        server.stop()
