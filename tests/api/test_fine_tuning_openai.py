"""The fine-tuning API where code written for OpenAI's depends on it (issue 66), through the openai SDK against a
served tiny model: `jobs.list(metadata=...)` filters as OpenAI's `metadata[k]=v` / `metadata=null`; a large file is
validated after the create call answers (the job `validating_files` meanwhile, a bad line ending it `failed` with
the 400's own error); events are paged as OpenAI pages them (20 by default, newest first, `after` a cursor of the
job's own events, `limit` from 1 to 100, else a 400 naming it); a restart says whether a job starts over, and does
again a validation it cut short."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from motet.api.fine_tuning.validation import INLINE_BYTES
from tests.api.test_fine_tuning_api import FINISHED, chat, client, jsonl, upload, wait
from tests.live_server import keys_file, tiny_server

FLAGS = ("--dtype", "float32", "--fine-tuning-max-jobs-per-tenant", "2")
KEYS = {
    "k-meta": "meta",
    "k-events": "events",
    "k-other": "other",
    "k-large": "large",
    "k-restart": "restart",
}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fine-tuning-openai")
    keys_file(tmp, KEYS)
    srv = tiny_server(tiny_model_dir, tmp, *FLAGS)
    srv.data = tmp / "data"
    yield srv
    srv.stop()


def long_chat(i: int, words: int = 120) -> dict:
    """A chat of a few KB (a few hundred tokens: within the tiny server's context of 1,024)."""
    return {"messages": [{"role": "user", "content": f"repeat {i}: " + "hello " * words},
                         {"role": "assistant", "content": "HELLO " * 8}]}  # fmt: skip


def large_file(bad_last_line: str | None = None) -> bytes:
    """A training file past INLINE_BYTES (validated after the create call answers)."""
    rows = []
    while sum(len(json.dumps(r)) + 1 for r in rows) <= INLINE_BYTES:
        rows.append(long_chat(len(rows)))
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


def test_a_restart_says_a_job_starts_over_and_validates_again(tiny_model_dir, tmp_path):
    keys_file(tmp_path, KEYS)
    first = tiny_server(tiny_model_dir, tmp_path, *FLAGS)
    try:
        c = client(first, "k-restart")
        training = upload(c, jsonl(chat(i) for i in range(200)))  # one epoch of 200 steps: no checkpoint soon
        job = c.fine_tuning.jobs.create(training_file=training.id, model="tiny",
                                        hyperparameters={"n_epochs": 1, "batch_size": 1})  # fmt: skip
        wait(c, job.id, until=("running", *FINISHED))  # its worker starts: it has no checkpoint yet
        many = upload(c, jsonl(long_chat(i) for i in range(2000)))  # several MB: seconds to tokenize
        validating = c.fine_tuning.jobs.create(training_file=many.id, model="tiny")
        assert validating.status == "validating_files"
        first.proc.kill()  # SIGKILL, mid-validation
        first.proc.wait()
    finally:
        first.stop()
    second = tiny_server(tiny_model_dir, tmp_path, *FLAGS)
    try:
        c = client(second, "k-restart")
        messages = [e.message for e in c.fine_tuning.jobs.list_events(job.id)]
        assert (
            "The server restarted: the job is queued again and starts over: it had no checkpoint yet"
            in messages
        )
        c.fine_tuning.jobs.cancel(job.id)
        validated = wait(c, validating.id, until=("queued", "running", *FINISHED), timeout=600)
        assert validated.status in ("queued", "running"), validated.error
        messages = [e.message for e in c.fine_tuning.jobs.list_events(validating.id)]
        assert (
            "The server restarted while the job's files were validated: they are validated again" in messages
        )
        assert sum(m.startswith("Files validated (2000 examples") for m in messages) == 1, messages
        c.fine_tuning.jobs.cancel(validating.id)
        r = httpx.get(
            f"{second.url}/v1/fine_tuning/jobs/{job.id}", headers={"Authorization": "Bearer k-restart"}
        )
        assert r.json()["status"] == "cancelled"
    finally:
        second.stop()
