"""The fine-tuning service's quotas and work bounds (issue 68, findings 8, 10 and 11), on a real `motet serve` of a
tiny model in this process (so that a job's validation or its eval can be held at a point), driven by the openai SDK:

- a job admitted holds the room of its adapters in the tenant's adapter quota until it ends, so a second job (or an
  upload) that would not fit beside it is refused at once, and that room is what the job stores: the size of the
  adapters the trainer writes (a reference run's), to the byte; the reservation is rows of SQLite, kept across a
  restart of the store;
- a file is refused for its count, its hyperparameters or its adapters' room before any example is read; a
  tenant's validations run one at a time while another tenant's run beside them, each counted in /metrics;
- a job's eval file is answered outside the training slot (the next job trains meanwhile), and cancelling the job
  stops its eval there and then.
"""

from __future__ import annotations

import io
import json
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
import httpx
import openai
import pytest

from motet.api.fine_tuning import runner, validation
from motet.api.fine_tuning.store import FineTuningStore
from motet.engine.tokenizer import load_tokenizer
from motet.engine.weights.model_config import load_model_config
from motet.evals.lora_reference import write_random_adapter
from motet.grammar.tool_formats import tool_format
from motet.lora.registry import FILES
from motet.training.dataset import MAX_EXAMPLES
from motet.training.eval_file import MAX_EXAMPLES as EVAL_MAX_EXAMPLES
from motet.training.hyperparameters import Hyperparameters
from motet.training.run_setup import RunFiles, prepare_files, set_up
from motet.training.trainer import train
from tests.live_server import ThreadServer, keys_file

MODEL = "tiny"
TENANTS = ("alice", "bob", "carol", "dave", "erin", "frank", "gina", "hank")
KEYS = {**{f"k-{t}": t for t in TENANTS}, "k-admin": {"admin": True}}
ONE_EPOCH = {"n_epochs": 1, "lora_rank": 8}  # stores two adapters: its checkpoint, then its model
FINISHED = ("succeeded", "failed", "cancelled")


def chat(text: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"say {text}"},
            {"role": "assistant", "content": text.upper()},
        ]
    }


def jsonl(rows) -> bytes:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode()


def training_file(tenant: str, n: int = 4) -> bytes:
    return jsonl(chat(f"{tenant} {i}") for i in range(n))


@pytest.fixture(scope="module")
def adapter_size(tiny_model_dir, tmp_path_factory) -> int:
    """The bytes of a default adapter (rank 8 on every projection) of the tiny model as a fine-tuning job stores it:
    the two files the trainer writes for a one-epoch run, PEFT's own save."""
    tmp = tmp_path_factory.mktemp("reference")
    tok, config = load_tokenizer(tiny_model_dir), load_model_config(tiny_model_dir)
    files = RunFiles(tiny_model_dir, config, tok, tool_format(config.declaration.tool_format, tok.hf.chat_template),
                     1024, 64)  # fmt: skip
    prepared, _ = prepare_files(files, "supervised", io.BytesIO(training_file("x")), None, tmp)
    run = set_up(
        files, "supervised", prepared, ONE_EPOCH, seed=0, run_dir=tmp, dtype="float32", base_name=MODEL
    )
    assert train(run) == "succeeded"
    return sum((run.adapter / f).stat().st_size for f in FILES)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, adapter_size):
    """Room for three default adapters a tenant: one one-epoch job's two, and one more."""
    tmp = tmp_path_factory.mktemp("fine-tuning-bounds")
    srv = ThreadServer("--model", str(tiny_model_dir), "--served-model-name", MODEL, "--data-dir", str(tmp / "data"),
                       "--threads", "1", "--num-kv-blocks", "64", "--max-model-len", "1024", "--dtype", "float32",
                       "--api-keys", keys_file(tmp, KEYS), "--adapters-max-bytes-per-tenant", str(3 * adapter_size))  # fmt: skip
    srv.data = tmp / "data"
    yield srv
    srv.stop()


def client(server, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=f"k-{tenant}", max_retries=0, timeout=300)


def upload(c: openai.OpenAI, data: bytes) -> str:
    return c.files.create(file=("train.jsonl", data), purpose="fine-tune").id


def wait(c: openai.OpenAI, job_id: str, until=FINISHED, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while (job := c.fine_tuning.jobs.retrieve(job_id)).status not in until:
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    return job


def until(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def upload_adapter(server, tiny_model_dir, tmp_path, tenant: str, name: str, size: int) -> httpx.Response:
    """A rank-8 adapter of the tiny model whose two files are `size` bytes together (its config padded with
    spaces), uploaded as the tenant's `name`."""
    path = write_random_adapter(tmp_path / name, load_model_config(tiny_model_dir), 8, 0)
    have = sum((path / f).stat().st_size for f in FILES)
    assert have <= size
    config = path / FILES[0]
    config.write_bytes(config.read_bytes() + b" " * (size - have))
    files = [("files", (f, (path / f).read_bytes())) for f in FILES]
    return httpx.post(f"{server.url}/v1/adapters", data={"name": name}, files=files,
                      headers={"Authorization": f"Bearer k-{tenant}"}, timeout=60)  # fmt: skip


def stored_adapters(server, tenant: str) -> dict[str, int]:
    root = server.data / "adapters" / tenant
    return {
        p.name: sum((p / f).stat().st_size for f in FILES)
        for p in root.iterdir()
        if not p.name.startswith(".")
    }


def refused_for_room(e: pytest.ExceptionInfo, adapter_size: int) -> None:
    error = e.value.body
    assert e.value.status_code == 400 and error["code"] == "storage_quota_exceeded", error
    assert (
        error["param"] == "hyperparameters.n_epochs" and "--adapters-max-bytes-per-tenant" in error["message"]
    )
    assert f"of {adapter_size} bytes" in error["message"], error


# -- finding 8: the adapters' room --------------------------------------------------------------------------------
def test_an_admitted_job_holds_its_adapters_room_until_it_ends(
    server, tiny_model_dir, tmp_path, adapter_size
):
    alice = client(server, "alice")
    first = alice.fine_tuning.jobs.create(training_file=upload(alice, training_file("alice")), model=MODEL,
                                          hyperparameters=ONE_EPOCH)  # fmt: skip
    alice.fine_tuning.jobs.pause(first.id)  # it stores nothing while paused, and keeps its room
    with pytest.raises(openai.BadRequestError) as refused:  # room for 3 adapters, 2 of them the first job's
        alice.fine_tuning.jobs.create(training_file=upload(alice, training_file("alice")), model=MODEL,
                                      hyperparameters=ONE_EPOCH)  # fmt: skip
    refused_for_room(refused, adapter_size)
    r = upload_adapter(server, tiny_model_dir, tmp_path, "alice", "up", adapter_size + 1)  # nor may an upload
    assert r.status_code == 400 and r.json()["error"]["code"] == "storage_quota_exceeded", r.text
    alice.fine_tuning.jobs.cancel(first.id)  # its room is free again
    job = alice.fine_tuning.jobs.create(training_file=upload(alice, training_file("alice")), model=MODEL,
                                        hyperparameters=ONE_EPOCH)  # fmt: skip
    job = wait(alice, job.id)
    assert job.status == "succeeded", job.error
    stored = stored_adapters(server, "alice")  # (and the first job's checkpoint, had it made one)
    assert {job.fine_tuned_model, f"{job.fine_tuned_model}:ckpt-step-4"} <= set(stored)
    assert set(stored.values()) == {adapter_size}


def test_the_room_a_job_takes_is_what_it_stores_to_the_byte(server, tiny_model_dir, tmp_path, adapter_size):
    """Bob's upload leaves a byte less than a one-epoch job's two adapters: refused at create (the file's bad line
    is never read); carol's leaves exactly them: it trains, and fills her quota exactly."""
    assert (
        upload_adapter(server, tiny_model_dir, tmp_path, "bob", "mine", adapter_size + 1).status_code == 200
    )
    bob = client(server, "bob")
    with pytest.raises(openai.BadRequestError) as refused:
        bob.fine_tuning.jobs.create(training_file=upload(bob, training_file("bob")), model=MODEL,
                                    hyperparameters=ONE_EPOCH)  # fmt: skip
    refused_for_room(refused, adapter_size)
    bad = jsonl([chat("bob"), "{not json"])
    with pytest.raises(openai.BadRequestError) as refused:  # its room is found before any example is read
        bob.fine_tuning.jobs.create(training_file=upload(bob, bad), model=MODEL, hyperparameters=ONE_EPOCH)
    refused_for_room(refused, adapter_size)
    assert not bob.fine_tuning.jobs.list().data
    assert upload_adapter(server, tiny_model_dir, tmp_path, "carol", "mine", adapter_size).status_code == 200
    carol = client(server, "carol")
    job = carol.fine_tuning.jobs.create(training_file=upload(carol, training_file("carol")), model=MODEL,
                                        hyperparameters=ONE_EPOCH)  # fmt: skip
    job = wait(carol, job.id)
    assert job.status == "succeeded", job.error
    assert sum(stored_adapters(server, "carol").values()) == 3 * adapter_size


def test_the_reservations_are_rows_that_outlive_the_store(tmp_path):
    h = Hyperparameters(n_epochs=2, batch_size=1, learning_rate_multiplier=1.0, lora_rank=8, lora_alpha=16.0,
                        lora_dropout=0.0, lora_target_modules=("q_proj",))  # fmt: skip
    store = FineTuningStore(tmp_path)
    for job_id, tenant in (("ftjob-a", "alice"), ("ftjob-b", "alice"), ("ftjob-c", "bob")):
        store.create(job_id, tenant, model=MODEL, model_name=f"ft:{job_id}", training_file="file-x",
                     validation_file=None, suffix=None, seed=0, method="supervised", hyperparameters=h, metadata=None,
                     examples=4, tokens_per_epoch=10, events=[], adapter_bytes=100)  # fmt: skip
    assert store.reserved_bytes("alice") == 600 and store.reserved_bytes("alice", "ftjob-a") == 300
    store.close()
    store = FineTuningStore(tmp_path)  # a restart
    assert store.reserved_bytes("alice") == 600 and store.reserved_bytes("bob") == 300
    store.add_checkpoint("ftjob-a", 4, "ft:ftjob-a:ckpt-step-4", {})
    store.add_checkpoint(
        "ftjob-a", 4, "ft:ftjob-a:ckpt-step-4", {}
    )  # said again after a restart: stored once
    assert store.reserved_bytes("alice") == 500
    store.model_stored("ftjob-a")
    assert store.reserved_bytes("alice") == 400
    store.fail("ftjob-a", "training_failed", "x")
    store.change("alice", "ftjob-b", "cancelled", ("queued",), "The job was cancelled")
    assert store.reserved_bytes("alice") == 0 and store.reserved_bytes("bob") == 300
    store.close()
    old = tmp_path / "old"  # a store written before jobs reserved their room: its queued job reserves nothing
    old.mkdir()
    db = sqlite3.connect(old / "fine_tuning.sqlite3")
    db.execute("CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant TEXT NOT"
               " NULL, status TEXT NOT NULL)")  # fmt: skip
    db.execute("INSERT INTO jobs (id, tenant, status) VALUES ('ftjob-old', 'bob', 'queued')")
    db.commit()
    db.close()
    assert FineTuningStore(old).reserved_bytes("bob") == 0


# -- finding 10: what a validation costs ----------------------------------------------------------------------------
def test_what_costs_nothing_to_check_is_refused_before_any_example_is_read(server):
    dave = client(server, "dave")
    many = upload(
        dave, jsonl([chat("dave"), "{not json", *(chat(f"d {i}") for i in range(MAX_EXAMPLES - 1))])
    )
    with pytest.raises(openai.BadRequestError) as refused:
        dave.fine_tuning.jobs.create(training_file=many, model=MODEL)
    error = refused.value.body
    assert error["param"] == "training_file" and f"more than {MAX_EXAMPLES} examples" in error["message"], (
        error
    )
    bad = upload(dave, jsonl([chat("dave"), "{not json"]))
    with pytest.raises(openai.BadRequestError) as refused:
        dave.fine_tuning.jobs.create(training_file=bad, model=MODEL, hyperparameters={"n_epochs": 0})
    assert refused.value.body["param"] == "hyperparameters.n_epochs", refused.value.body
    evals = upload(dave, jsonl(chat(f"e {i}") for i in range(EVAL_MAX_EXAMPLES + 1)))
    with pytest.raises(openai.BadRequestError) as refused:  # every file is counted before one is read
        dave.fine_tuning.jobs.create(training_file=bad, model=MODEL, extra_body={"eval_file": evals})
    error = refused.value.body
    assert error["param"] == "eval_file" and f"more than {EVAL_MAX_EXAMPLES} examples" in error["message"], (
        error
    )
    assert not dave.fine_tuning.jobs.list().data


def test_a_tenants_validations_take_turns_beside_another_tenants_and_are_counted(server, monkeypatch):
    entered: list[str] = []
    gate = threading.Event()
    prepare = validation.prepare_files

    def held(model, method, train, valid, run_dir):  # the tokenizing step, held until the gate opens
        entered.append(json.loads(train.readline())["messages"][0]["content"].split()[1])
        train.seek(0)
        assert gate.wait(120)
        return prepare(model, method, train, valid, run_dir)

    monkeypatch.setattr(validation, "prepare_files", held)
    erin, frank = client(server, "erin"), client(server, "frank")
    files = {"erin": upload(erin, training_file("erin")), "frank": upload(frank, training_file("frank"))}

    def create(c: openai.OpenAI, tenant: str):
        small = {"n_epochs": 1, "lora_rank": 1}  # (two of erin's fit in her adapters' room)
        return c.fine_tuning.jobs.create(training_file=files[tenant], model=MODEL, hyperparameters=small)

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(create, erin, "erin")
        until(lambda: entered == ["erin"], "erin's first job is validated")
        second = pool.submit(create, erin, "erin")
        other = pool.submit(create, frank, "frank")
        until(lambda: "frank" in entered, "frank's job is validated beside erin's")
        assert entered == ["erin", "frank"]  # erin's second waits its turn
        gate.set()
        jobs = [f.result() for f in (first, second, other)]
    assert entered == ["erin", "frank", "erin"]
    for job, c in zip(jobs, (erin, erin, frank), strict=True):
        c.fine_tuning.jobs.cancel(job.id)
    r = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer k-admin"})
    samples = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in r.text.splitlines()
               if line.startswith("motet_fine_tuning_validation")}  # fmt: skip
    assert samples['motet_fine_tuning_validations_total{outcome="queued",tenant="erin"}'] == 2
    assert samples['motet_fine_tuning_validations_total{outcome="queued",tenant="frank"}'] == 1
    assert samples['motet_fine_tuning_validations_total{outcome="refused",tenant="dave"}'] == 3
    assert samples['motet_fine_tuning_validation_cpu_seconds_total{tenant="erin"}'] > 0


# -- finding 11: the eval file ------------------------------------------------------------------------------------
def test_an_eval_runs_outside_the_training_slot_and_stops_with_its_job(server, monkeypatch):
    calls: list[str] = []
    cancelled = threading.Event()
    gate = threading.Event()

    async def held(app, tenant, model, row):  # an eval request, held until the gate opens
        calls.append(tenant)
        try:
            while not gate.is_set():
                await anyio.sleep(0.02)
        except anyio.get_cancelled_exc_class():
            cancelled.set()
            raise
        return None

    monkeypatch.setattr(runner, "chat_answer", held)
    gina, hank = client(server, "gina"), client(server, "hank")
    evals = upload(gina, jsonl([chat("one"), chat("two")]))
    evaluated = gina.fine_tuning.jobs.create(training_file=upload(gina, training_file("gina")), model=MODEL,
                                             hyperparameters={"n_epochs": 1}, extra_body={"eval_file": evals})  # fmt: skip
    queued = hank.fine_tuning.jobs.create(training_file=upload(hank, training_file("hank")), model=MODEL,
                                          hyperparameters={"n_epochs": 1})  # fmt: skip
    until(lambda: calls, "gina's job is trained and its eval begins")
    wait(hank, queued.id, until=("running", "succeeded"))  # it trains while gina's eval is held
    assert gina.fine_tuning.jobs.retrieve(evaluated.id).status == "running" and not cancelled.is_set()
    assert gina.fine_tuning.jobs.cancel(evaluated.id).status == "cancelled"
    assert cancelled.wait(60)  # the eval's request in flight is stopped
    gate.set()
    job = wait(hank, queued.id)
    assert job.status == "succeeded", job.error
    assert calls == ["gina"]  # no request of the eval after it
    messages = [e.message for e in gina.fine_tuning.jobs.list_events(evaluated.id, limit=100)]
    assert messages[0] == "The job was cancelled" and not any(m.startswith("Eval file") for m in messages)
    assert gina.fine_tuning.jobs.retrieve(evaluated.id).fine_tuned_model is None
    assert not (server.data / "fine_tuning" / evaluated.id).exists()
