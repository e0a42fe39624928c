"""`motet serve --replicas 2` on a real local Ray cluster (tiny random model, one thread per replica), driven
by the openai SDK over loopback: chat, streaming and a Responses request equal to the offline engine's greedy
output, vLLM's series summed over the replicas (the Grafana dashboard's, against what the clients were told); an
adapter upload served by both replicas (read from an fsspec store) and equal to the offline engine with it; tenant
isolation; a delete reaching every replica; a replica killed with requests in flight (those it had not started are
served by the other replica, a started one ends with a clean error, nothing hangs); a tenant's limits from the keys
file held at the front door, one limit over both replicas; and no Ray process left once the server stops.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from tests.api.test_api_adapters import two_files  # noqa: E402
from tests.live_server import Server, keys_file  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster and two replicas take a minute or two to start here

KEYS = {
    "sk-alice": "alice",
    "sk-bob": "bob",
    "sk-carol": {"tenant": "carol", "limits": {"requests_per_minute": 4, "max_concurrent_requests": 2}},
    "sk-dan": "dan",
    "sk-admin": {"admin": True},
}
MODEL = "tiny"
CHAT = [{"role": "user", "content": "The quick brown fox"}]
GREEDY = dict(temperature=0, max_tokens=12)
LONG = dict(temperature=0, max_tokens=300, extra_body={"ignore_eos": True})  # ~1 s each on the tiny model
DRAIN = dict(temperature=0, max_tokens=1200, extra_body={"ignore_eos": True})  # in flight over a SIGTERM


@pytest.fixture(scope="module")
def offline(tiny_model_dir, adapter):
    """The offline engine's greedy text for a chat, with or without the adapter."""
    from motet.engine.llm import LLM
    from motet.engine.sampling_params import SamplingParams

    llm = LLM(
        str(tiny_model_dir), dtype="auto", num_kv_blocks=512, num_threads=1
    )  # as `motet serve` by default
    llm.add_lora("a", adapter)

    def text(messages, max_tokens: int, adapter_name: str | None = None, ignore_eos: bool = False) -> str:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        prompt = llm.tokenizer.encode_chat(messages)
        return llm.generate([prompt], params, adapters=[adapter_name])[0].text

    return text


def start_cluster(model_dir, tmp, *replicas: str) -> Server:
    """`motet serve` over Ray replicas (`replicas`: the flags saying how many, of which kind), the tenants' keys
    and an adapter store the replicas share."""
    return Server(
        tmp,
        "--model", str(model_dir), "--served-model-name", MODEL, *replicas, "--threads", "1",
        "--max-ongoing-requests", "4", "--max-lora-rank", "8",
        "--api-keys", keys_file(tmp, KEYS), "--data-dir", str(tmp / "data"),
        "--adapter-store", f"file://{tmp / 'store'}",
        start_timeout=900,  # minutes when the machine is busy: every process imports torch
        admin_key="sk-admin",
    )  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    server = start_cluster(
        tiny_model_dir, tmp_path_factory.mktemp("cluster"), "--replicas", "2", "--max-num-seqs", "1",
        "--fine-tuning-ray-resource", "trainer",
        "--tenant-wait-timeout", "0",  # no line: a request over the concurrency limit is refused at once
        # the drain outlasts the SIGTERM test's 1,200-token answer on a loaded machine (3 test workers on 2 cores: it
        # ran past the default 30 s and was ended)
        "--drain-timeout", "300",
    )  # fmt: skip
    yield server
    server.stop()


def _key(tenant: str) -> str:
    return next(
        k for k, t in KEYS.items() if t == tenant or isinstance(t, dict) and t.get("tenant") == tenant
    )


def sdk(server: Server, tenant: str) -> openai.OpenAI:
    key = _key(tenant)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def http(server: Server, tenant: str) -> httpx.Client:
    key = _key(tenant)
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def per_replica(server: Server, name: str) -> dict[str, float]:
    """A per-replica metric by replica id."""
    out = {}
    for key, value in server.metrics().items():
        if key.startswith(name + "{"):
            out[key.split('replica="')[1].split('"')[0]] = value
    return out


def wait_for(predicate, timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_chat_and_stream(cluster, offline):
    client = sdk(cluster, "alice")
    expected = offline(CHAT, GREEDY["max_tokens"])
    r = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert r.choices[0].message.content == expected
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert len(per_replica(cluster, "motet_replica_kv_blocks_free")) == 2  # both replicas report


def test_responses_and_vllm_series(cluster, offline):
    """The Responses API and vLLM's series behind the ingress: a response runs the chat path on a replica (the
    chat's text), is stored at the ingress for its tenant only, and the vLLM series sum the replicas' reports."""
    from prometheus_client.parser import text_string_to_metric_families

    alice = sdk(cluster, "alice")
    expected = offline(CHAT, GREEDY["max_tokens"])
    r = alice.responses.create(
        model=MODEL, input=CHAT[0]["content"], temperature=0, max_output_tokens=GREEDY["max_tokens"]
    )
    assert r.output_text == expected
    assert alice.responses.retrieve(r.id).output_text == expected
    with pytest.raises(openai.NotFoundError):
        sdk(cluster, "bob").responses.retrieve(r.id)

    def series() -> dict:
        return {
            s.name: s.value
            for family in text_string_to_metric_families(cluster.metrics_text())
            for s in family.samples
            if s.name.startswith("vllm:") and not s.name.endswith("_bucket")
        }

    wait_for(lambda: series().get("vllm:num_requests_running") == 0, what="the replicas to report idle")
    idle = series()
    assert idle["vllm:num_requests_waiting"] == 0 and 0 <= idle["vllm:kv_cache_usage_perc"] <= 1
    assert idle["vllm:e2e_request_latency_seconds_count"] >= 1 and "vllm:lora_requests_info" in idle


def test_the_dashboards_series_sum_the_replicas(cluster):
    """tests/api/test_metrics_dashboard.py's checks behind the replicas: every series the Grafana dashboard queries
    is on the ingress's /metrics, the replicas' reports summed, and agrees with what the clients were told. (One
    sequence at a time per replica here: nothing is preempted; the single server's check counts a preemption.)"""
    from tests.api.test_metrics_dashboard import MODEL as DASHBOARDS_MODEL
    from tests.api.test_metrics_dashboard import check_dashboard

    assert DASHBOARDS_MODEL == MODEL  # (its queries select the served model by name)
    check_dashboard(cluster, api_key=_key("alice"), preempts=False)


def test_adapter_upload_served_by_both_replicas(cluster, offline, adapter):
    alice = http(cluster, "alice")
    r = alice.post(
        "/v1/adapters", data={"name": "a"}, files=[("files", f) for f in two_files(adapter).items()]
    )
    assert r.status_code == 200, r.text
    expected = offline(CHAT, GREEDY["max_tokens"], "a")
    assert expected != offline(CHAT, GREEDY["max_tokens"])
    client = sdk(cluster, "alice")
    # 8 at once: a replica takes 4 (--max-ongoing-requests), so both serve them
    with ThreadPoolExecutor(8) as pool:
        texts = list(
            pool.map(
                lambda _: (
                    client.chat.completions.create(model="a", messages=CHAT, **GREEDY)
                    .choices[0]
                    .message.content
                ),
                range(8),
            )
        )
    assert texts == [expected] * 8
    wait_for(
        lambda: sorted(per_replica(cluster, "motet_replica_adapters_loaded").values()) == [1, 1],
        what="the adapter loaded on both replicas",
    )


def test_tenant_isolation(cluster):
    bob = sdk(cluster, "bob")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        bob.chat.completions.create(model="a", messages=CHAT, **GREEDY)
    assert http(cluster, "bob").get("/v1/adapters/a").status_code == 404
    assert [m.id for m in bob.models.list()] == [MODEL]
    assert "a" in [m.id for m in sdk(cluster, "alice").models.list()]


def test_limits_hold_over_both_replicas(cluster):
    """Six long requests at once from a tenant allowed two at a time: two run (a replica each, or one queued),
    four are refused although the replicas could queue them (the two, streamed, are held open until the six know
    their outcome, then closed: a place is held for as long as its request, not for 1,200 tokens); then the
    requests per minute count the requests of both replicas. One limit, not one per replica."""
    carol = sdk(cluster, "carol")
    go = threading.Barrier(6, timeout=60)
    answered = threading.Barrier(6, timeout=300)  # the two admitted streams are held open until all six know
    ended = 'motet_requests_total{endpoint="/v1/chat/completions",status="200"}'
    ended_before = cluster.metrics().get(ended, 0)

    def one(i: int) -> str:
        go.wait()
        messages = [{"role": "user", "content": f"{i} brown foxes"}]
        try:
            stream = carol.chat.completions.create(model=MODEL, messages=messages, stream=True, **DRAIN)
        except openai.RateLimitError as e:
            assert e.response.headers["retry-after"]
            answered.wait()
            return e.body["message"]
        with stream:  # admitted: it holds its place until the others were answered, then leaves (closed)
            answered.wait()
        return "ok"

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(one, range(6)))
    assert outcomes.count("ok") == 2, outcomes
    assert all("concurrent requests (2)" in o for o in outcomes if o != "ok")
    # the two closed streams counted once they ended, and so out of the tenant's two places (RateLimits wraps the
    # request counter: it frees the place in the same step)
    wait_for(lambda: cluster.metrics().get(ended, 0) >= ended_before + 2, what="the closed streams ended")
    # 2 of the 4 requests this minute were used, less what the bucket gave back meanwhile (one every 15 s): each
    # request of either replica counts, until refused
    left = []
    with pytest.raises(openai.RateLimitError) as e:
        for _ in range(5):
            raw = carol.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, **GREEDY)
            assert raw.headers["x-ratelimit-limit-requests"] == "4"
            left.append(int(raw.headers["x-ratelimit-remaining-requests"]))
    assert left and left[-1] == 0 and left == list(range(left[0], -1, -1)) and left[0] <= 3, left
    assert "requests per minute (4)" in e.value.body["message"]
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 15  # a request back every 15 s
    r = sdk(cluster, "bob").chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, **GREEDY)
    assert r.http_response.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers


def test_delete_reaches_every_replica(cluster):
    assert http(cluster, "alice").delete("/v1/adapters/a").status_code == 200
    with pytest.raises(openai.NotFoundError):
        sdk(cluster, "alice").chat.completions.create(model="a", messages=CHAT, **GREEDY)
    wait_for(
        lambda: sorted(per_replica(cluster, "motet_replica_adapters_loaded").values()) == [0, 0],
        what="both replicas dropping the deleted adapter",
    )


def cmdline(p) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # gone meanwhile
        return ""


def replica_processes(server: Server) -> list:
    return [
        p for p in psutil.Process(server.proc.pid).children(recursive=True) if "ServeReplica" in cmdline(p)
    ]


def test_a_fine_tuning_job_trains_as_a_ray_train_run(cluster, tiny_model_dir, tmp_path):
    """Behind the cluster a job trains on the node holding --fine-tuning-ray-resource (the local Ray's one unit), as
    a Ray Train run, to the adapter of the same run in one process; its model is served by the replicas. A job
    cancelled once its worker runs frees the unit (the next one trains)."""
    from motet.engine.config import auto_dtype
    from tests.api.test_fine_tuning_api import TRAIN, assert_same, reference_adapter, served_adapter, wait

    dan = sdk(cluster, "dan")
    training_file = dan.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune").id
    long = dan.fine_tuning.jobs.create(
        training_file=training_file, model=MODEL, hyperparameters={"n_epochs": 50}
    )
    wait_for(lambda: any(e.message.startswith("Training on") for e in dan.fine_tuning.jobs.list_events(long.id)),
             timeout=300, what="the long job's Ray Train worker")  # fmt: skip
    dan.fine_tuning.jobs.cancel(long.id)
    job = dan.fine_tuning.jobs.create(training_file=training_file, model=MODEL, seed=5,
                                      hyperparameters={"n_epochs": 2, "batch_size": 2})  # fmt: skip
    job = wait(dan, job.id)
    assert job.status == "succeeded", job.error
    messages = [e.message for e in dan.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert any(m.startswith("Training on a Ray Train worker") for m in messages), messages
    dtype = auto_dtype(torch.device("cpu"))[0]
    expected = reference_adapter(tiny_model_dir, tmp_path, TRAIN, job, dtype=dtype)
    assert_same(served_adapter(cluster.log_path.parent / "data", "dan", job.fine_tuned_model), expected)
    answer = dan.chat.completions.create(model=job.fine_tuned_model, messages=CHAT, **GREEDY)
    assert answer.choices[0].message.content is not None


def test_replica_killed_under_load(cluster, offline):
    client = sdk(cluster, "alice")
    expected = offline(CHAT, LONG["max_tokens"], ignore_eos=True)
    results: list = [None] * 8

    def run(i: int) -> None:
        try:
            if i % 2:
                stream = client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **LONG)
                results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            else:
                r = client.chat.completions.create(model=MODEL, messages=CHAT, **LONG)
                results[i] = r.choices[0].message.content
        except openai.APIError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()

    def both_busy() -> bool:
        queued = per_replica(cluster, "motet_replica_requests_queued")
        waiting = per_replica(cluster, "motet_replica_requests_waiting")
        return len(queued) == 2 and all(queued[r] + waiting.get(r, 0) >= 1 for r in queued)

    wait_for(both_busy, what="requests queued on both replicas")
    victim = replica_processes(cluster)[0]
    os.kill(victim.pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a client hung"
    failed = [r for r in results if isinstance(r, openai.APIError)]
    # Each replica runs one request at a time (--max-num-seqs 1): the killed one had started at most one;
    # the others it held were queued and are served by the other replica.
    assert len(failed) <= 1, failed
    assert all(r == expected for r in results if not isinstance(r, openai.APIError))
    for e in failed:
        assert "replica" in str(e)
        assert getattr(e, "status_code", 503) == 503  # a non-streamed one: 503 (try again), never a 500
    # The server goes on (Serve starts a replica in the dead one's place).
    r = client.chat.completions.create(model=MODEL, messages=CHAT, **GREEDY)
    assert r.choices[0].message.content == offline(CHAT, GREEDY["max_tokens"])


def ray_session(processes) -> str:
    """The Ray session's name (session_DATE_TIME_PID), from its processes' command lines."""
    for p in processes:
        m = re.search(r"session_\d{4}-\d\d-\d\d_[\d-]+_\d+_\d+", cmdline(p))
        if m:
            return m.group(0)
    raise AssertionError("no process of the server names its Ray session")


def test_sigterm_drains_exits_0_and_leaves_no_ray_process(cluster):
    """SIGTERM with a request in flight: the request finishes (the drain), the server exits with 0 (Ray's
    abseil handler used to abort it 3 s after a SIGTERM: -6), and no process of its Ray session is left."""
    ray_procs = psutil.Process(cluster.proc.pid).children(recursive=True)
    assert any("raylet" in cmdline(p) for p in ray_procs), [cmdline(p)[:80] for p in ray_procs]
    session = ray_session(ray_procs)
    stream = sdk(cluster, "alice").chat.completions.create(
        model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}, **DRAIN
    )
    text, signalled, finish, usage = "", False, None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
        if text and not signalled:  # the first token is out: the request runs on a replica
            cluster.proc.send_signal(signal.SIGTERM)
            signalled = True
    # the request in flight finished: all its tokens (their text is the offline engine's: test_replica_killed_under_load)
    assert finish == "length" and usage.completion_tokens == DRAIN["max_tokens"], (finish, usage)
    assert cluster.proc.wait(300) == 0
    cluster.stop()
    _, alive = psutil.wait_procs(ray_procs, timeout=60)
    assert not alive, [cmdline(p)[:80] for p in alive]
    left = [cmdline(p)[:80] for p in psutil.process_iter() if session in cmdline(p)]
    assert not left, left
