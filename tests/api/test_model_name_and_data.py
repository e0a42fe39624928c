"""A new team's first hour against `motet serve --model DIR`: the model is listed by its name (not the operator's
path), each model has its own data directory unless the operator shares one, an adapter stored for another base
model in a shared one is a clear 400 (not a 500 whose reason only the log knows), and an upload script can run
twice. One ThreadServer on the tiny model, driven by the openai SDK and httpx."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import openai
import pytest

from motet.api.auth import DEFAULT_TENANT
from motet.api.server import DEFAULT_DATA_DIR, data_dir, warn_of_shared_data
from motet.engine.weights.model_store import DEFAULT_MODEL_ALIASES
from motet.evals.lora_reference import write_random_adapter
from motet.lora.registry import FILES, AdapterRegistry
from motet.models.config import ModelConfig
from tests.live_server import ThreadServer

FOREIGN = "made-for-another-base"  # an adapter stored by a server of another base model, in a shared data dir


@pytest.fixture(scope="module")
def shared_data(tiny_model_dir, tmp_path_factory) -> Path:
    """A data directory another model's server already stored an adapter in (its MLP is twice as wide)."""
    data = tmp_path_factory.mktemp("shared-data")
    own = ModelConfig.from_dir(tiny_model_dir)
    other = dataclasses.replace(own, intermediate_size=2 * own.intermediate_size)
    files = write_random_adapter(tmp_path_factory.mktemp("foreign") / "a", other, rank=2, seed=3)
    AdapterRegistry(data, other).save(DEFAULT_TENANT, FOREIGN, {f: (files / f).read_bytes() for f in FILES})
    return data


@pytest.fixture(scope="module")
def server(tiny_model_dir, shared_data):
    srv = ThreadServer("--model", str(tiny_model_dir), "--data-dir", str(shared_data), "--threads", "1",
                       "--num-kv-blocks", "64")  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, model: str):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )


def test_a_checkpoint_dir_is_served_by_its_name_not_its_path(server, client, tiny_model_dir):
    """vLLM lists the path given to --model; motet's tenants must not see the operator's file system: the
    directory's name is the id (as with --served-model-name), and the path still works as an alias."""
    listing = httpx.get(f"{server.url}/v1/models", timeout=30)
    assert str(tiny_model_dir) not in listing.text
    assert client.models.list().data[0].id == tiny_model_dir.name
    assert chat(client, tiny_model_dir.name).model == tiny_model_dir.name
    assert chat(client, str(tiny_model_dir)).choices  # clients that send the path still work


def test_an_adapter_stored_for_another_base_model_is_a_400_naming_the_mismatch(server, client, shared_data):
    assert FOREIGN in [m.id for m in client.models.list().data]  # a data dir the operator shares: listed
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, FOREIGN)
    error = refused.value.body
    assert error["code"] == "adapter_mismatch" and error["param"] == "model"
    assert FOREIGN in error["message"] and "base model" in error["message"]
    assert str(shared_data) not in error["message"]  # the reason, without where the server keeps the files
    assert chat(client, server.state.model_name).choices  # the server itself is fine


def test_the_same_upload_twice_is_fine_other_files_under_the_name_are_409(server, tiny_model_dir, tmp_path):
    """The README's upload, run a second time, answers as the first (the files are stored already); other files
    under a taken name are a 409 that says what to do."""
    base = ModelConfig.from_dir(tiny_model_dir)

    def upload(seed: int) -> httpx.Response:
        path = write_random_adapter(tmp_path / f"a{seed}", base, rank=2, seed=seed)
        files = [("files", (f, (path / f).read_bytes())) for f in FILES]
        return httpx.post(f"{server.url}/v1/adapters", data={"name": "twice"}, files=files, timeout=60)

    first, second = upload(1), upload(1)
    assert first.status_code == second.status_code == 200, second.text
    assert second.json() == first.json()
    other = upload(2)
    assert other.status_code == 409 and "DELETE /v1/adapters/twice" in other.json()["error"]["message"]


def test_each_model_has_its_own_data_directory_unless_one_is_given(
    tmp_path, monkeypatch, tiny_model_dir, caplog
):
    monkeypatch.delenv("MOTET_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    root = Path(DEFAULT_DATA_DIR).expanduser()
    twin = tmp_path / "elsewhere" / tiny_model_dir.name  # another checkpoint of the same name
    twin.mkdir(parents=True)
    dirs = {data_dir(None, m) for m in (str(tiny_model_dir), str(twin), DEFAULT_MODEL_ALIASES[0])}
    assert len(dirs) == 3 and all(d.parent == root for d in dirs)
    assert {data_dir(None, a) for a in DEFAULT_MODEL_ALIASES} == {data_dir(None, DEFAULT_MODEL_ALIASES[0])}
    assert data_dir(None, str(tiny_model_dir)) == data_dir(None, str(tiny_model_dir) + "/")  # one checkpoint
    shared = str(tmp_path / "shared")
    assert {data_dir(shared, m) for m in (str(tiny_model_dir), str(twin))} == {Path(shared)}  # given: shared
    monkeypatch.setenv("MOTET_DATA_DIR", shared)
    assert data_dir(None, str(twin)) == Path(shared)

    monkeypatch.delenv("MOTET_DATA_DIR")  # data an earlier motet kept in the shared default: said, not lost
    (root / "adapters" / "default").mkdir(parents=True)
    with caplog.at_level("WARNING", logger="motet.server"):
        warn_of_shared_data(None, data_dir(None, str(twin)))
    assert f"--data-dir {root}" in caplog.text
