"""A tenant's adapters together are bounded (--adapters-max-bytes-per-tenant): an upload past the room left is a 400
in OpenAI's shape with nothing written, other tenants keep theirs, deleting makes room; a fine-tuning job whose
checkpoints and model would not fit is refused before it queues."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from motet.evals.lora_reference import write_random_adapter
from motet.lora.registry import FILES
from motet.models.config import ModelConfig
from tests.live_server import ThreadServer, keys_file

KEYS = {"ka": "alice", "kb": "bob", "kc": "carol", "kd": "dave"}
TRAIN = "\n".join(
    json.dumps(
        {
            "messages": [
                {"role": "user", "content": f"say hi {i}"},
                {"role": "assistant", "content": f"HI {i}"},
            ]
        }
    )
    for i in range(4)
).encode()


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    """A rank-8 adapter of all seven modules, as a fine-tuning job's default LoRA makes them: its files."""
    path = write_random_adapter(
        tmp_path_factory.mktemp("adapter"), ModelConfig.from_dir(tiny_model_dir), 8, 0
    )
    return [("files", (f, (path / f).read_bytes())) for f in FILES]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, adapter):
    tmp = tmp_path_factory.mktemp("adapter-quota")
    size = sum(len(data) for _, (_, data) in adapter)
    srv = ThreadServer("--model", str(tiny_model_dir), "--data-dir", str(tmp / "data"), "--threads", "1",
                       "--num-kv-blocks", "64", "--api-keys", keys_file(tmp, KEYS),
                       "--adapters-max-bytes-per-tenant", str(size * 5 // 2))  # fmt: skip
    srv.data = tmp / "data"
    yield srv
    srv.stop()


def upload(server, key: str, name: str, files) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(
        f"{server.url}/v1/adapters", data={"name": name}, files=files, headers=headers, timeout=60
    )


def models(server, key: str) -> set[str]:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    return {m.id for m in c.models.list().data}


def test_an_upload_past_the_tenants_room_is_refused_and_deleting_makes_room(server, adapter):
    assert upload(server, "ka", "a1", adapter).status_code == 200
    assert upload(server, "ka", "a2", adapter).status_code == 200
    refused = upload(server, "ka", "a3", adapter)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "storage_quota_exceeded" and "--adapters-max-bytes-per-tenant" in error["message"]
    assert "a3" not in models(server, "ka")
    assert not [p for p in (server.data / "adapters" / "alice").iterdir() if p.name not in ("a1", "a2")]
    assert upload(server, "ka", "a1", adapter).status_code == 200  # the same files again: stored already
    assert upload(server, "kb", "b1", adapter).status_code == 200  # bob's room is his own
    r = httpx.delete(f"{server.url}/v1/adapters/a1", headers={"Authorization": "Bearer ka"})
    assert r.status_code == 200, r.text
    assert upload(server, "ka", "a3", adapter).status_code == 200
    assert {"a2", "a3"} <= models(server, "ka") and "a1" not in models(server, "ka")


def test_a_fine_tuning_job_whose_adapters_would_not_fit_is_refused_before_it_queues(server, adapter):
    """Carol's two adapters leave room for half of one: a one-epoch job stores two (its checkpoint, its model)."""
    assert upload(server, "kc", "c1", adapter).status_code == 200
    assert upload(server, "kc", "c2", adapter).status_code == 200
    carol = openai.OpenAI(base_url=f"{server.url}/v1", api_key="kc", max_retries=0)
    base, hyper = server.state.model_name, {"n_epochs": 1, "lora_rank": 8}
    training_file = carol.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune").id
    with pytest.raises(openai.BadRequestError) as refused:
        carol.fine_tuning.jobs.create(training_file=training_file, model=base, hyperparameters=hyper)
    error = refused.value.body
    assert error["code"] == "storage_quota_exceeded" and error["param"] == "hyperparameters.n_epochs", error
    assert not carol.fine_tuning.jobs.list().data
    # dave has room for two and a half: the same job fits (its estimate is no larger than the adapters it makes)
    dave = openai.OpenAI(base_url=f"{server.url}/v1", api_key="kd", max_retries=0)
    training_file = dave.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune").id
    job = dave.fine_tuning.jobs.create(training_file=training_file, model=base, hyperparameters=hyper)
    dave.fine_tuning.jobs.cancel(job.id)
