"""OpenAI's fine-tuning API on a real `motet serve` of a tiny model, through the openai SDK over loopback: the round
trip (upload, create, follow, serve the `ft:` model and its checkpoints; the served model answers as transformers +
PEFT on its stored adapter, token for token), a job paused and resumed or cut by a server restart ending with the
adapter of an uninterrupted PEFT/TRL run of the same seed, bad input refused with a 400 in OpenAI's shape before
anything is queued, quotas, and tenants that never see each other's jobs, files or
models. And where code written for OpenAI's API depends on it (issue 66): `jobs.list(metadata=...)` filters as
OpenAI's `metadata[k]=v` / `metadata=null`; a large file is validated after the create call answers (the job
`validating_files` meanwhile, a bad line ending it `failed` with the 400's own error); events are paged as OpenAI pages
them (20 by default, newest first, `after` a cursor of the job's own events, `limit` from 1 to 100, else a 400
naming it); a restart says whether a job starts over, and does again a validation it cut short."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.fine_tuning_quality import GREEDY, MAX_TOKENS, lines
from motet.api.fine_tuning.validation import INLINE_BYTES
from motet.engine.tokenizer import load_tokenizer
from motet.engine.weights.model_config import load_model_config
from motet.grammar.tool_formats import tool_format
from motet.training.chat_encoding import ChatEncoder
from motet.training.data_format import read_examples
from motet.training.run_setup import RunFiles, prepare_files, set_up
from motet.training.trainer import train
from motet.training.worker import NAME
from tests.live_server import keys_file, tiny_server

KEYS = {"ka": "alice", "kb": "bob", "kc": "carol", "kd": "dave", "ke": "erin", "kadmin": {"admin": True},
        "k-meta": "meta", "k-other": "other", "k-events": "events", "k-large": "large", "k-restart": "restart",
        "k-peft": "team"}  # fmt: skip
LIMITS = ("--dtype", "float32", "--fine-tuning-max-jobs-per-tenant", "2")
FLAGS = (*LIMITS, "--fine-tuning-max-tokens-per-day", "100000")
FINISHED = ("succeeded", "failed", "cancelled")


def chat(i: int) -> dict:
    return {
        "messages": [{"role": "user", "content": f"say hi {i}"}, {"role": "assistant", "content": f"HI {i}"}]
    }


def jsonl(rows) -> bytes:
    return "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows).encode()


TRAIN = jsonl(chat(i) for i in range(4))
PAIRS = jsonl([{"input": {"messages": [{"role": "user", "content": "hi"}]},
                "preferred_output": [{"role": "assistant", "content": "HI"}],
                "non_preferred_output": [{"role": "assistant", "content": "hi"}]}])  # fmt: skip
HUGE = 10**400  # a JSON integer past any float


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fine-tuning")
    keys_file(tmp, KEYS)
    srv = tiny_server(tiny_model_dir, tmp, *FLAGS)
    srv.data = tmp / "data"
    yield srv
    srv.stop()


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def upload(c: openai.OpenAI, data: bytes = TRAIN, purpose: str = "fine-tune"):
    return c.files.create(file=("train.jsonl", data), purpose=purpose)


def wait(c: openai.OpenAI, job_id: str, until=FINISHED, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while (job := c.fine_tuning.jobs.retrieve(job_id)).status not in until:
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    return job


def wait_for_checkpoint(c: openai.OpenAI, job_id: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not c.fine_tuning.jobs.checkpoints.list(job_id).data:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def served_adapter(data: Path, tenant: str, model: str) -> dict[str, torch.Tensor]:
    return load_file(data / "adapters" / tenant / model / "adapter_model.safetensors")


def reference_adapter(
    model_dir: Path, tmp: Path, data: bytes, job, dtype="float32"
) -> dict[str, torch.Tensor]:
    """The same examples, hyperparameters and seed trained in one uninterrupted run (motet/training/ is TRL's
    SFTTrainer on PEFT LoRA: tests/training/test_trainer.py holds it to the same run written by hand)."""
    tok, config = load_tokenizer(model_dir), load_model_config(model_dir)
    files = RunFiles(model_dir, config, tok, tool_format(config.declaration.tool_format, tok.hf.chat_template),
                     1024, 64)  # fmt: skip
    prepared, _ = prepare_files(files, "supervised", io.BytesIO(data), None, tmp)
    hyper = job.method.supervised.hyperparameters.model_dump()
    run = set_up(
        files, "supervised", prepared, hyper, seed=job.seed, run_dir=tmp, dtype=dtype, base_name="tiny"
    )
    assert train(run) == "succeeded"
    return load_file(run.adapter / "adapter_model.safetensors")


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=k)


def test_sdk_round_trip(server):
    c = client(server, "ka")
    f = upload(c)
    valid = upload(c, jsonl(chat(i) for i in range(10, 12)))
    job = c.fine_tuning.jobs.create(
        training_file=f.id, validation_file=valid.id, model="tiny", suffix="hi", seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 2}}},
        metadata={"team": "a"},
    )  # fmt: skip
    assert job.status == "queued" and job.training_file == f.id and job.hyperparameters.n_epochs == 2
    assert job.id in [j.id for j in c.fine_tuning.jobs.list()]
    job = wait(c, job.id)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model == f"ft:tiny:alice:hi:{job.id}" and job.trained_tokens > 0
    assert job.metadata == {"team": "a"} and job.finished_at >= job.created_at
    events = list(c.fine_tuning.jobs.list_events(job.id, limit=100))
    messages = [e.message for e in events]
    assert messages[0] == "The job has successfully completed" and "Fine-tuning job started" in messages
    steps = [e for e in events if e.type == "metrics" and "train_loss" in e.data]
    assert sorted(e.data["step"] for e in steps) == [1, 2, 3, 4]
    assert any("valid_loss" in e.data for e in events)
    checkpoints = c.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [ck.step_number for ck in checkpoints] == [4, 2]
    assert checkpoints[0].fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-4"
    assert checkpoints[0].metrics.valid_loss is not None
    # the result file: OpenAI's CSV, a row a step
    rows = list(csv.DictReader(io.StringIO(c.files.content(job.result_files[0]).text)))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4] and all(float(r["train_loss"]) > 0 for r in rows)
    # the model and each checkpoint are served to the tenant, listed among its models and adapters
    models = [m.id for m in c.models.list()]
    for name in (job.fine_tuned_model, checkpoints[1].fine_tuned_model_checkpoint):
        assert name in models
        answer = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "say hi 1"}],
                                           max_tokens=4)  # fmt: skip
        assert answer.model == name and answer.choices[0].finish_reason in ("stop", "length")
    adapters = httpx.get(f"{server.url}/v1/adapters", headers={"Authorization": "Bearer ka"}).json()["data"]
    assert job.fine_tuned_model in [a["id"] for a in adapters]
    # training tokens in the usage records (an admin's read)
    usage = httpx.get(f"{server.url}/v1/usage", params={"start_time": job.created_at - 60, "group_by": "model",
                      "tenant": "alice"}, headers={"Authorization": "Bearer kadmin"}).json()  # fmt: skip
    trained = sum(
        r["training_tokens"]
        for b in usage["data"]
        for r in b["results"]
        if r["model"] == job.fine_tuned_model
    )
    assert trained == job.trained_tokens
    # another tenant sees none of it
    b = client(server, "kb")
    with pytest.raises(openai.NotFoundError):
        b.fine_tuning.jobs.retrieve(job.id)
    for call in (b.fine_tuning.jobs.cancel, b.fine_tuning.jobs.pause, b.fine_tuning.jobs.resume,
                 b.fine_tuning.jobs.list_events, b.fine_tuning.jobs.checkpoints.list):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call(job.id)
    assert job.id not in [j.id for j in b.fine_tuning.jobs.list()]
    assert job.fine_tuned_model not in [m.id for m in b.models.list()]
    with pytest.raises(openai.NotFoundError):
        b.chat.completions.create(model=job.fine_tuned_model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as e:  # alice's file, named by bob
        b.fine_tuning.jobs.create(training_file=f.id, model="tiny")
    assert e.value.body["param"] == "training_file"
    # deleted like any adapter (OpenAI's models.delete; bob cannot)
    with pytest.raises(openai.NotFoundError):
        b.models.delete(job.fine_tuned_model)
    assert c.models.delete(job.fine_tuned_model).deleted
    assert job.fine_tuned_model not in [m.id for m in c.models.list()]
    # a checkpoint whose model is deleted is no longer listed (issue 68: it still was), as OpenAI's
    newest, old = (ck.fine_tuned_model_checkpoint for ck in checkpoints)
    assert c.models.delete(newest).deleted
    listed = c.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [ck.fine_tuned_model_checkpoint for ck in listed] == [old]
    r = httpx.delete(f"{server.url}/v1/adapters/{old}", headers={"Authorization": "Bearer ka"})
    assert r.status_code == 200 and old not in [m.id for m in c.models.list()]
    assert c.fine_tuning.jobs.checkpoints.list(job.id).data == []


def test_a_paused_and_resumed_job_ends_as_an_uninterrupted_run(server, tiny_model_dir, tmp_path):
    c = client(server, "kc")
    data = jsonl(chat(i) for i in range(4))
    hyper = {"n_epochs": 24, "batch_size": 2, "lora_dropout": 0.1}  # long enough to catch it running
    job = c.fine_tuning.jobs.create(training_file=upload(c, data).id, model="tiny", seed=11,
                                    method={"type": "supervised", "supervised": {"hyperparameters": hyper}})  # fmt: skip
    wait_for_checkpoint(c, job.id)
    assert c.fine_tuning.jobs.pause(job.id).status == "paused"
    deadline = time.monotonic() + 60
    while "The job is paused: it goes on from here when resumed" not in [
        e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=5)
    ]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert c.fine_tuning.jobs.retrieve(job.id).status == "paused"
    assert c.fine_tuning.jobs.resume(job.id).status == "queued"
    job = wait(c, job.id)
    assert job.status == "succeeded", job.error
    messages = [e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert any(m.startswith("Going on from the checkpoint of step") for m in messages)
    assert_same(served_adapter(server.data, "carol", job.fine_tuned_model),
                reference_adapter(tiny_model_dir, tmp_path, data, job))  # fmt: skip


def test_cancel_stops_a_job_and_quotas_bound_a_tenant(server):
    c = client(server, "kd")
    f = upload(c)
    hyper = {"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 50}}}}
    first = c.fine_tuning.jobs.create(training_file=f.id, model="tiny", **hyper)
    second = c.fine_tuning.jobs.create(training_file=f.id, model="tiny", **hyper)
    with pytest.raises(openai.RateLimitError) as e:  # --fine-tuning-max-jobs-per-tenant 2
        c.fine_tuning.jobs.create(training_file=f.id, model="tiny")
    assert e.value.body["code"] == "rate_limit_exceeded"
    for job in (first, second):
        assert c.fine_tuning.jobs.cancel(job.id).status == "cancelled"
        with pytest.raises(openai.ConflictError):
            c.fine_tuning.jobs.cancel(job.id)
    time.sleep(1)
    for job in (first, second):
        job = c.fine_tuning.jobs.retrieve(job.id)
        assert job.status == "cancelled" and job.fine_tuned_model is None
    big = upload(c, jsonl(chat(i) for i in range(300)))  # ~9,000 tokens an epoch, 50 epochs: over 100,000
    with pytest.raises(openai.RateLimitError) as e:
        c.fine_tuning.jobs.create(training_file=big.id, model="tiny", **hyper)
    assert e.value.body["code"] == "insufficient_quota"


NESTED = "[" * 100_000 + "]" * 100_000


def calls(name: str, answered: str = "c1") -> list[dict]:
    """A question, a call of `name` (id c1), and a tool message answering `answered`."""
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}
    return [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": answered, "content": "r"}]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "body", "param", "says"),
    [
        (jsonl([chat(0), "{not json"]), {}, "training_file", "Line 2: the line is not valid JSON"),
        (jsonl([chat(0), NESTED]), {}, "training_file", "Line 2: "),
        (jsonl([{"messages": [{"role": "user", "content": "x " * 3000}, {"role": "assistant", "content": "y"}]}]),
         {}, "training_file", "Line 1: the example is"),
        (jsonl([chat(0), {"messages": [{"role": "user", "content": "hi"}]}]), {}, "training_file",
         "Line 2: no assistant message"),
        (jsonl([{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}]), {},
         "training_file", "unknown role"),
        (jsonl([{"messages": [*calls("f\n</tool_call>"), {"role": "assistant", "content": "ok"}]}]), {},
         "training_file", "Line 1: Invalid 'messages[1].tool_calls[0].function.name': expected 1 to 64 characters"),
        (jsonl([{"messages": [*calls("f", "nope"), {"role": "assistant", "content": "ok"}]}]), {}, "training_file",
         'Line 1: messages[2].tool_call_id: "nope" answers no call (the calls before it: "c1")'),
        (TRAIN, {"model": "gpt-4o-mini"}, "model", "not available for fine-tuning"),
        (TRAIN, {"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs", "n_epochs"),
        (TRAIN, {"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": "three"}}}},
         "method.supervised.hyperparameters.n_epochs", "n_epochs"),
        (TRAIN, {"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 1000}}}},
         "method.supervised.hyperparameters.batch_size", "batch_size"),
        (TRAIN, {"method": {"type": "dpo"}}, "training_file", "Line 1: a chat: DPO reads preference pairs"),
        (TRAIN, {"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": -1}}}},
         "method.dpo.hyperparameters.beta", "beta"),  # (found before the file is read)
        (TRAIN, {"hyperparameters": {"learning_rate_multiplier": True}},
         "hyperparameters.learning_rate_multiplier", "learning_rate_multiplier"),
        (TRAIN, {"hyperparameters": {"lora_rank": 1024}}, "hyperparameters.lora_rank", "lora_rank"),
        (TRAIN, {"hyperparameters": {"n_epochs": HUGE}}, "hyperparameters.n_epochs", "n_epochs must be"),
        (TRAIN, {"method": {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": -HUGE}}}},
         "method.supervised.hyperparameters.batch_size", "batch_size must be"),
        (PAIRS, {"method": {"type": "dpo", "dpo": {"hyperparameters": {"lora_rank": HUGE}}}},
         "method.dpo.hyperparameters.lora_rank", "lora_rank must be"),
        (PAIRS, {"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": HUGE}}}},
         "method.dpo.hyperparameters.beta", "beta must be"),
        (TRAIN, {"suffix": "a/b"}, "suffix", ""),
        (TRAIN, {"seed": -1}, "seed", ""),
        (TRAIN, {"integrations": [{"type": "wandb", "wandb": {"project": "x"}}]}, "integrations", ""),
        (TRAIN, {"method": {"type": "reinforcement"}}, "method.type", ""),
        (TRAIN, {"validation_file": "file-nope"}, "validation_file", "no file"),
        (TRAIN, {"extra_body": {"eval_file": "file-nope"}}, "eval_file", "no file"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_is_queued(server, data, body, param, says):
    c = client(server, "kb")
    f = upload(c, data)
    before = len(c.fine_tuning.jobs.list(limit=100).data)
    run_dirs = set((server.data / "fine_tuning").glob("*"))  # (the other tests' jobs')
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(**{"training_file": f.id, "model": "tiny", **body})
    error = e.value.body
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and says in error["message"], error
    assert len(c.fine_tuning.jobs.list(limit=100).data) == before
    assert not set((server.data / "fine_tuning").glob("*")) - run_dirs  # nothing is left of a refused job


LONE = "\ud800"  # a lone surrogate: json.dumps writes it as the escape "\\ud800", valid JSON but not valid Unicode


def lone_chat(where: str) -> dict:
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]
    if where == "user":
        messages[0]["content"] = LONE
    elif where == "assistant":
        messages[1]["content"] = LONE
    else:  # in a call's arguments, JSON in a string
        call = {
            "id": "c1",
            "type": "function",
            "function": {"name": "f", "arguments": json.dumps({"a": LONE})},
        }
        messages[1:] = [{"role": "assistant", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c1", "content": "r"}, messages[1]]  # fmt: skip
    return {"messages": messages}


@pytest.mark.parametrize(
    ("which", "method", "line", "field"),
    [
        ("training_file", "supervised", lone_chat("user"), "at messages[0].content"),
        ("training_file", "supervised", lone_chat("arguments"), "messages[1].tool_calls[0].function.arguments"),
        ("validation_file", "supervised", lone_chat("assistant"), "at messages[1].content"),
        ("eval_file", "supervised", lone_chat("user"), "at messages[0].content"),
        ("training_file", "dpo", {**json.loads(PAIRS), "non_preferred_output": [{"role": "assistant",
         "content": LONE}]}, "at non_preferred_output[0].content"),
    ],
)  # fmt: skip
def test_text_that_is_not_valid_unicode_is_refused_in_any_file(server, which, method, line, field):
    """A lone surrogate escape in any of a job's files is refused as serving refuses it in a request body: a 400
    naming the file, the line and the field (before: a 500 out of the tokenizer, or, in an eval file, a job whose
    eval requests all failed once it had trained)."""
    c = client(server, "kb")
    files = {
        "training_file": upload(c, PAIRS if method == "dpo" else TRAIN).id,
        which: upload(c, jsonl([line])).id,
    }
    extra = {"eval_file": files.pop("eval_file")} if "eval_file" in files else {}
    before = len(c.fine_tuning.jobs.list(limit=100).data)
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(**files, model="tiny", method={"type": method}, extra_body=extra)
    error = e.value.body
    assert error["param"] == which and error["code"] == f"invalid_{which}", error
    assert "Line 1: " in error["message"] and field in error["message"], error
    assert "holds invalid Unicode (a lone surrogate escape)" in error["message"], error
    assert len(c.fine_tuning.jobs.list(limit=100).data) == before


def test_an_eval_file_is_answered_by_the_tuned_model_and_its_base(server):
    """The job's eval file is answered after training: its counts are what the served models answer the SDK."""
    c = client(server, "ke")
    rows = [chat(i) for i in range(3)] + [chat(40)]
    bad = upload(
        c, jsonl([chat(0), {"messages": [*chat(1)["messages"], {"role": "user", "content": "and?"}]}])
    )
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(training_file=upload(c).id, model="tiny", extra_body={"eval_file": bad.id})
    assert e.value.body["param"] == "eval_file" and "Line 2: " in e.value.body["message"], e.value.body
    job = c.fine_tuning.jobs.create(training_file=upload(c).id, model="tiny", seed=3,
                                    hyperparameters={"n_epochs": 8, "batch_size": 2},
                                    extra_body={"eval_file": upload(c, jsonl(rows)).id})  # fmt: skip
    job = wait(c, job.id)
    assert job.status == "succeeded", job.error
    events = c.fine_tuning.jobs.list_events(job.id, limit=100)
    (result,) = [e.data for e in events if e.data and "fine_tuned_matched" in e.data]

    def matched(model: str) -> int:
        answers = [c.chat.completions.create(model=model, messages=r["messages"][:1], temperature=0, max_tokens=32)
                   for r in rows]  # fmt: skip
        return sum(
            a.choices[0].message.content.strip() == r["messages"][1]["content"]
            for a, r in zip(answers, rows, strict=True)
        )

    assert (
        result["examples"] == 4
        and result["fine_tuned_failed_requests"] == result["base_failed_requests"] == 0
    )
    assert (result["fine_tuned_matched"], result["base_matched"]) == (
        matched(job.fine_tuned_model),
        matched("tiny"),
    )


def test_a_file_of_another_purpose_is_refused(server):
    c = client(server, "kb")
    f = upload(
        c, jsonl([{"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}]), "batch"
    )
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(training_file=f.id, model="tiny")
    assert e.value.body["param"] == "training_file" and "purpose" in e.value.body["message"]


def long_chat(i: int, text: str = "hello ", times: int = 120) -> dict:
    """A chat of about a KB (a few hundred tokens: within the tiny server's context of 1,024)."""
    return {"messages": [{"role": "user", "content": f"repeat {i}: " + text * times},
                         {"role": "assistant", "content": "HELLO " * 8}]}  # fmt: skip


def large_file(bad_last_line: str | None = None) -> bytes:
    """A training file past INLINE_BYTES (validated after the create call answers), of the sentence the tiny
    tokenizer was trained on (about 4 bytes a token: some 75,000 tokens, within the server's 100,000 a day)."""
    rows = []
    while sum(len(json.dumps(r)) + 1 for r in rows) <= INLINE_BYTES:
        rows.append(long_chat(len(rows), "The quick brown fox jumps over the lazy dog. ", 20))
    return jsonl([*rows, *([bad_last_line] if bad_last_line else [])])


def test_jobs_list_filters_by_metadata_as_openai_does(server):
    c = client(server, "k-meta")
    f = upload(c)
    made = {}
    for name, metadata in (("a", {"team": "a"}), ("b", {"team": "b", "note": ""}), ("none", None)):
        job = c.fine_tuning.jobs.create(training_file=f.id, model="tiny", metadata=metadata,
                                        hyperparameters={"n_epochs": 1})  # fmt: skip
        c.fine_tuning.jobs.cancel(job.id)  # (the tenant may have two at once)
        made[name] = job.id

    def listed(**kw) -> list[str]:
        return [j.id for j in c.fine_tuning.jobs.list(**kw)]

    assert listed() == [made["none"], made["b"], made["a"]]
    assert listed(metadata={"team": "a"}) == [made["a"]]
    assert listed(metadata={"team": "b", "note": ""}) == [made["b"]]  # an empty value: the key, empty
    assert listed(metadata={"note": "x"}) == [] and listed(metadata={}) == listed()
    assert listed(extra_query={"metadata": "null"}) == [
        made["none"]
    ]  # OpenAI's literal query for no metadata
    page = c.fine_tuning.jobs.list(
        metadata={"team": "b"}, after=made["none"], limit=1
    )  # a cursor the filter skips
    assert [j.id for j in page.data] == [made["b"]] and not page.has_more
    other = client(server, "k-other")
    assert [
        j.id for j in other.fine_tuning.jobs.list(metadata={"team": "a"})
    ] == []  # a tenant's own jobs only
    for query, param in (({"metadata": "team"}, "metadata"),
                         ({"metadata": "null", "metadata[team]": "a"}, "metadata")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            c.fine_tuning.jobs.list(extra_query=query)
        assert e.value.body["param"] == param, e.value.body


def test_events_are_paged_as_openai_pages_them(server):
    c = client(server, "k-events")
    f = upload(c)
    running = c.fine_tuning.jobs.create(training_file=f.id, model="tiny", hyperparameters={"n_epochs": 50})
    wait(c, running.id, until=("running", *FINISHED))  # it holds the one training slot: the next job waits
    job = c.fine_tuning.jobs.create(training_file=f.id, model="tiny")
    for _ in range(12):  # two events a round
        assert c.fine_tuning.jobs.pause(job.id).status == "paused"  # (queued: paused at once)
        assert c.fine_tuning.jobs.resume(job.id).status == "queued"
    c.fine_tuning.jobs.cancel(job.id)
    everything = c.fine_tuning.jobs.list_events(job.id, limit=100)  # the most a page holds
    assert len(everything.data) == 27 and not everything.has_more
    assert everything.data[0].message == "The job was cancelled"  # newest first
    assert everything.data[-1].message.startswith("Validating training file")
    first = c.fine_tuning.jobs.list_events(job.id)  # OpenAI's default page: 20
    assert [e.id for e in first.data] == [e.id for e in everything.data[:20]] and first.has_more
    walked = [e.id for e in c.fine_tuning.jobs.list_events(job.id, limit=7)]  # the SDK follows `after`
    assert walked == [e.id for e in everything.data]
    after = c.fine_tuning.jobs.list_events(job.id, after=everything.data[4].id, limit=3)
    assert [e.id for e in after.data] == [e.id for e in everything.data[5:8]]
    bad = (({"after": everything.data[0].id, "fine_tuning_job_id": running.id}, "after"),  # another job's event
           ({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": 5000}, "limit"))  # fmt: skip
    for query, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            c.fine_tuning.jobs.list_events(**{"fine_tuning_job_id": job.id, **query})
        assert e.value.status_code == 400 and e.value.body["param"] == param, (query, e.value.body)
    c.fine_tuning.jobs.cancel(running.id)


def test_a_large_file_is_validated_after_the_create_call_answers(server):
    c = client(server, "k-large")
    bad_line = json.dumps({"messages": [{"role": "user", "content": "hi"}]})  # no assistant message
    with pytest.raises(openai.BadRequestError) as small:  # a small file: refused at once
        c.fine_tuning.jobs.create(training_file=upload(c, jsonl([chat(0), bad_line])).id, model="tiny")
    f = upload(c, large_file(bad_line))
    job = c.fine_tuning.jobs.create(training_file=f.id, model="tiny")
    assert job.status == "validating_files", job
    assert c.fine_tuning.jobs.list_events(job.id).data[-1].message == f"Validating training file: {f.id}"
    job = wait(c, job.id)
    assert job.status == "failed" and job.error is not None, job
    lines = len(large_file().splitlines())
    expected = small.value.body["message"].replace(small.value.body["message"].split(":")[0], "")
    assert job.error.code == small.value.body["code"] == "invalid_training_file"
    assert job.error.param == small.value.body["param"] == "training_file"
    assert job.error.message == f"invalid training_file {f.id}" + expected.replace(
        "Line 2", f"Line {lines + 1}"
    )
    assert job.fine_tuned_model is None and not (server.data / "fine_tuning" / job.id).exists()
    good = c.fine_tuning.jobs.create(training_file=upload(c, large_file()).id, model="tiny",
                                     hyperparameters={"n_epochs": 1})  # fmt: skip
    assert good.status == "validating_files"
    good = wait(c, good.id, until=("queued", "running", *FINISHED))
    assert good.status in ("queued", "running"), good.error
    messages = [e.message for e in c.fine_tuning.jobs.list_events(good.id)]
    assert messages[0].startswith(f"Files validated ({lines} examples"), messages
    assert c.fine_tuning.jobs.cancel(good.id).status == "cancelled"
    huge = c.fine_tuning.jobs.create(training_file=upload(c, b'{"messages": "' + b"x" * (10 << 20) + b'"}').id,
                                     model="tiny")  # a 10 MB line: refused unparsed, once its turn comes  # fmt: skip
    huge = wait(c, huge.id)
    assert huge.status == "failed" and huge.error.message.startswith(
        f"invalid training_file {huge.training_file}: Line 1: the line is longer than"
    ), huge.error


# (2,000 were: ~5 s of one core's CPU a validation, done once cut short and once whole, beside the resumed job;
# 500 take ~1.4 s, still far longer than the kill takes to follow the create call)
RESTART_VALIDATED = 500


def test_a_server_restart_mid_job_resumes_it_to_the_same_adapter(tiny_model_dir, tmp_path):
    """A job cut by a restart (SIGKILL) goes on from its checkpoint to the adapter of an uninterrupted run; beside
    it, the restart says a running job with no checkpoint yet starts over, and a job whose files were being
    validated is validated again (once)."""
    import psutil

    keys_file(tmp_path, KEYS)
    flags = (*LIMITS, "--fine-tuning-max-running", "2")  # the restarted jobs run side by side
    first = tiny_server(tiny_model_dir, tmp_path, *flags)
    data = jsonl(chat(i) for i in range(4))
    try:
        r = client(first, "k-restart")
        training = upload(r, jsonl(chat(i) for i in range(200)))  # one epoch of 200 steps: no checkpoint soon
        over = r.fine_tuning.jobs.create(training_file=training.id, model="tiny",
                                         hyperparameters={"n_epochs": 1, "batch_size": 1})  # fmt: skip
        # ~430 KB, past INLINE_BYTES: validated after the create call answers, for longer than the kill takes
        many = upload(r, jsonl(long_chat(i) for i in range(RESTART_VALIDATED)))
        c = client(first, "ka")
        job = c.fine_tuning.jobs.create(training_file=upload(c, data).id, model="tiny", seed=5,
                                        hyperparameters={"n_epochs": 24, "batch_size": 2})  # fmt: skip
        wait_for_checkpoint(c, job.id)
        wait(r, over.id, until=("running", *FINISHED))  # it runs beside alice's: no checkpoint yet
        validating = r.fine_tuning.jobs.create(training_file=many.id, model="tiny")
        assert validating.status == "validating_files"
        # (this process's descendants: the server's jobs are forked from the tests' zygote, tests/server_zygote.py)
        workers = [p for p in psutil.Process().children(recursive=True) if p.name() == NAME.decode()]
        assert workers
        first.proc.kill()  # SIGKILL, mid-validation: nothing of the server runs on
        first.proc.wait()
        psutil.wait_procs(workers, timeout=30)  # the workers die with the server
        assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
    finally:
        first.stop()
    second = tiny_server(tiny_model_dir, tmp_path, *flags)
    try:
        r = client(second, "k-restart")
        messages = [e.message for e in r.fine_tuning.jobs.list_events(over.id)]
        assert (
            "The server restarted: the job is queued again and starts over: it had no checkpoint yet"
            in messages
        )
        r.fine_tuning.jobs.cancel(over.id)
        validated = wait(r, validating.id, until=("queued", "running", *FINISHED), timeout=600)
        assert validated.status in ("queued", "running"), validated.error
        messages = [e.message for e in r.fine_tuning.jobs.list_events(validating.id)]
        assert (
            "The server restarted while the job's files were validated: they are validated again" in messages
        )
        assert sum(m.startswith(f"Files validated ({RESTART_VALIDATED} examples") for m in messages) == 1, (
            messages
        )
        r.fine_tuning.jobs.cancel(validating.id)
        got = httpx.get(
            f"{second.url}/v1/fine_tuning/jobs/{over.id}", headers={"Authorization": "Bearer k-restart"}
        )
        assert got.json()["status"] == "cancelled"
        c = client(second, "ka")
        job = wait(c, job.id)
        assert job.status == "succeeded", job.error
        messages = [e.message for e in c.fine_tuning.jobs.list_events(job.id, limit=100)]
        resumed = [m for m in messages if m.startswith("Going on from the checkpoint of step")]
        assert len(resumed) == 1, messages  # the worker's: the checkpoint the restart's event must name
        step = resumed[0].rsplit(" ", 1)[1]
        assert (
            f"The server restarted: the job is queued again and goes on from its checkpoint of step {step}"
            in (messages)
        )
        steps = [ck.step_number for ck in c.fine_tuning.jobs.checkpoints.list(job.id, limit=100)]
        assert steps == list(range(48, 0, -2)), messages
    finally:
        second.stop()
    assert_same(served_adapter(tmp_path / "data", "alice", job.fine_tuned_model),
                reference_adapter(tiny_model_dir, tmp_path / "reference", data, job))  # fmt: skip


def test_no_upload_takes_a_fine_tuned_models_name(server):
    files = {"files": ("adapter_config.json", b"{}"), "name": (None, "ft:tiny:bob::ftjob-0")}
    r = httpx.post(f"{server.url}/v1/adapters", files=files, headers={"Authorization": "Bearer kb"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text


def test_a_store_written_before_checkpoints_could_be_deleted_opens_and_lists_them(tmp_path):
    """The `deleted` mark (issue 68) is a column an older fine_tuning.sqlite3 lacks: opening it adds the column,
    its checkpoints are listed, and one whose model is deleted is no longer."""
    import sqlite3

    from motet.api.fine_tuning.store import FILENAME, FineTuningStore

    old = sqlite3.connect(tmp_path / FILENAME)
    old.execute(
        "CREATE TABLE checkpoints (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, tenant TEXT NOT "
        "NULL, job TEXT NOT NULL, created_at INTEGER NOT NULL, step INTEGER NOT NULL, model TEXT NOT NULL, metrics "
        "TEXT NOT NULL, UNIQUE (job, step))"
    )
    for step in (2, 4):
        old.execute("INSERT INTO checkpoints (id, tenant, job, created_at, step, model, metrics) VALUES "
                    "(?, 'alice', 'ftjob-1', 0, ?, ?, '{}')", (f"ftckpt-{step}", step, f"ft:m:ckpt-step-{step}"))  # fmt: skip
    old.commit()
    old.close()
    store = FineTuningStore(tmp_path)
    assert [c["step_number"] for c in store.checkpoints("alice", "ftjob-1", None, 10)[0]] == [4, 2]
    store.model_deleted("bob", "ft:m:ckpt-step-4")  # another tenant's name: nothing of alice's
    store.model_deleted("alice", "ft:m:ckpt-step-4")
    assert [c["step_number"] for c in store.checkpoints("alice", "ftjob-1", None, 10)[0]] == [2]
    assert store.has_checkpoint("ftjob-1", 4)  # its row stays: a restarted job does not store it again


def test_the_served_ft_model_answers_as_peft_on_its_stored_adapter(server, tiny_model_dir):
    """The served `ft:` model is the adapter its job stored, as transformers + PEFT compute it (issue 66): a short
    job (4 steps), then 8 prompts (4 trained, 4 not) answered greedily by the server and by PEFT on the stored
    adapter from the served prompt's token ids, token for token; and the served prompt is the one the job trained
    on (motet/training/chat_encoding.py renders a training example's prompt as serving renders a request).
    benchmarks/fine_tuning_quality.py checks the same on the real default model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    behaviour, facts = lines("behaviour.jsonl"), lines("facts.jsonl")
    trained = 8  # examples: 4 steps at batch 2
    c = client(server, "k-peft")
    job = c.fine_tuning.jobs.create(
        training_file=upload(c, jsonl(behaviour[:trained])).id, model="tiny", seed=1,
        hyperparameters={"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 4},
    )  # fmt: skip
    job = wait(c, job.id)
    assert job.status == "succeeded", job.error
    prompts = [ex["messages"][:-1] for ex in behaviour[:4]]
    prompts += [[{"role": "user", "content": f["question"]}] for f in facts[:4]]
    served = []
    for messages in prompts:
        r = c.chat.completions.with_raw_response.create(
            model=job.fine_tuned_model, messages=messages, max_tokens=MAX_TOKENS,
            extra_body={"return_token_ids": True}, **GREEDY,
        )  # fmt: skip
        body = json.loads(r.text)
        served.append((body["prompt_token_ids"], body["choices"][0]["token_ids"]))
    tok, config = load_tokenizer(tiny_model_dir), load_model_config(tiny_model_dir)
    # (1,024: tiny_server's --max-model-len)
    encoder = ChatEncoder(tok, tool_format(config.declaration.tool_format, tok.hf.chat_template), 1024)
    examples = list(read_examples(io.BytesIO(jsonl(behaviour[:trained])), "supervised", 1 << 20, 100))
    # the training render's prompt, as served
    for example, (prompt, _) in zip(examples[:4], served[:4], strict=True):
        tokens = encoder.supervised(example)
        assert tokens.input_ids[: tokens.assistant_masks.index(1)] == prompt
    adapter = server.data / "adapters" / "team" / job.fine_tuned_model
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, str(adapter)).eval()
    eos = base.generation_config.eos_token_id  # (the tiny model's: a list of one)
    pad = eos[0] if isinstance(eos, list) else eos
    for messages, (prompt, answer) in zip(prompts, served, strict=True):
        with torch.no_grad():
            out = peft.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                eos_token_id=eos, pad_token_id=pad)  # fmt: skip
        assert answer == out[0, len(prompt) :].tolist(), messages
