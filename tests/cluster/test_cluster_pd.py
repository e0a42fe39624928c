"""Prefill/decode disaggregation on a real local Ray cluster (`motet serve --prefill-replicas 1
--decode-replicas 1`, tiny random model, one thread per replica) driven by the openai SDK over loopback: greedy
outputs equal to the offline engine's (colocated, no tiers) with an uploaded adapter, the base model and a
JSON-schema grammar mixed, streaming included and usage counted once; the prompts' KV really handed over (the
decode replica's shared-tier hits, the ingress's PD counters); a killed prefill replica and then a killed decode
replica under load: every request served or ended with a clean 503, none hanging, and every KV block free again
on the replicas once they are idle.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from tests.api.test_api_adapters import two_files  # noqa: E402
from tests.cluster.test_cluster import MODEL, cmdline, http, per_replica, sdk, start_cluster, wait_for  # noqa: E402
from tests.live_server import Server  # noqa: E402

pytestmark = pytest.mark.slow  # a Ray cluster and two replicas take a minute or two to start here

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def chat(i: int, words: int = 90) -> list[dict]:
    """A prompt of well over MIN_PREFILL_BLOCKS blocks (16 tokens each), its own per i."""
    return [{"role": "user", "content": " ".join(f"w{(i * 7 + j) % 97}" for j in range(words))}]


@pytest.fixture(scope="module")
def offline(tiny_model_dir, adapter):
    """The offline engine's greedy output (colocated, no KV tiers): (text, prompt tokens)."""
    from motet.engine.llm import LLM
    from motet.engine.sampling_params import SamplingParams
    from motet.grammar.specs import JsonSchemaSpec

    llm = LLM(
        str(tiny_model_dir), dtype="auto", num_kv_blocks=512, num_threads=1
    )  # as `motet serve` by default
    llm.add_lora("a", adapter)

    # each reference computed once: both kill tests send the same prompts
    done: dict[str, tuple[str, int]] = {}

    def run(messages, max_tokens: int, adapter_name=None, schema=None, ignore_eos=False):
        key = json.dumps([messages, max_tokens, adapter_name, schema, ignore_eos])
        if key not in done:
            grammar = JsonSchemaSpec(schema) if schema else None
            params = SamplingParams(
                temperature=0, max_tokens=max_tokens, grammar=grammar, ignore_eos=ignore_eos
            )
            prompt = llm.tokenizer.encode_chat(messages)
            done[key] = llm.generate([prompt], params, adapters=[adapter_name])[0].text, len(prompt)
        return done[key]

    return run


@pytest.fixture(scope="module")
def pd(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pd")
    server = start_cluster(
        tiny_model_dir, tmp, "--prefill-replicas", "1", "--decode-replicas", "1", "--max-num-seqs", "2",
        "--kv-shared-dir", str(tmp / "kv-shared"),
    )  # fmt: skip
    yield server
    server.stop()


def metric(server: Server, name: str) -> float:
    return server.metrics().get(name, 0.0)


def shared_hits(server: Server) -> float:
    """Prompt tokens the replicas loaded from the shared KV tier, summed."""
    series = server.metrics().items()
    return sum(v for k, v in series if k.startswith("motet_kv_tier_hit_tokens_total") and '"shared"' in k)


def test_outputs_equal_colocated_with_adapters_and_a_grammar(pd, offline, adapter):
    alice = http(pd, "alice")
    r = alice.post(
        "/v1/adapters", data={"name": "a"}, files=[("files", f) for f in two_files(adapter).items()]
    )
    assert r.status_code == 200, r.text
    client = sdk(pd, "alice")
    cases = [(chat(i), "a" if i % 3 == 0 else None, SCHEMA if i % 3 == 2 else None) for i in range(6)]

    def run(case):
        messages, adapter_name, schema = case
        extra = {}
        if schema:
            extra["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        r = client.chat.completions.create(
            model=adapter_name or MODEL, messages=messages, temperature=0, max_tokens=24, **extra
        )
        return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.completion_tokens

    hits_before = shared_hits(pd)
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(run, cases))
    for (messages, adapter_name, schema), (text, prompt_tokens, completion_tokens) in zip(
        cases, got, strict=True
    ):
        expected, n_prompt = offline(messages, 24, adapter_name, schema)
        assert text == expected, (adapter_name, schema)
        assert prompt_tokens == n_prompt  # usage counted once: the prefill replica's prompt is not added
        assert completion_tokens <= 24
    assert any(schema for _, _, schema in cases)
    assert metric(pd, "motet_pd_prefills_total") >= 6
    assert metric(pd, "motet_pd_handed_blocks_total") >= 6 * 4
    wait_for(lambda: shared_hits(pd) > hits_before, what="the decode replica's shared-tier hits reported")

    # streaming, with usage in the last chunk, once
    messages = chat(40)
    stream = client.chat.completions.create(
        model="a",
        messages=messages,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected, n_prompt = offline(messages, 16, "a")
    assert text == expected
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1 and usages[0].prompt_tokens == n_prompt


def replicas_of(server: Server, kind: str) -> list:
    """The replica processes of one pool: "PrefillReplica" or "EngineReplica" (the decode pool)."""
    procs = psutil.Process(server.proc.pid).children(recursive=True)
    return [p for p in procs if "ServeReplica" in cmdline(p) and kind in cmdline(p)]


@pytest.mark.parametrize("victim", ["PrefillReplica", "EngineReplica"])
def test_a_killed_replica_loses_no_request_and_leaks_no_block(pd, offline, victim):
    client = sdk(pd, "alice")
    max_tokens = 64  # long enough that a killed replica has requests started and others still to come
    cases = [chat(100 + i, words=700) for i in range(8)]
    before = {k: metric(pd, f"motet_pd_{k}_total") for k in ("prefills", "prefill_fallbacks")}
    results: list = [None] * len(cases)

    def run(i: int) -> None:
        try:
            if i % 2:
                stream = client.chat.completions.create(
                    model=MODEL, messages=cases[i], stream=True, temperature=0, max_tokens=max_tokens,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            else:
                r = client.chat.completions.create(
                    model=MODEL, messages=cases[i], temperature=0, max_tokens=max_tokens,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
                results[i] = r.choices[0].message.content
        except openai.APIError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    (proc,) = replicas_of(pd, victim)
    if victim == "PrefillReplica":
        wait_for(lambda: metric(pd, "motet_pd_prefills_total") >= 1, what="a prefill done")
    else:
        wait_for(
            lambda: sum(per_replica(pd, "motet_replica_requests_running").values()) >= 1,
            what="a request running",
        )
    os.kill(proc.pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a client hung"
    failed = [r for r in results if isinstance(r, openai.APIError)]
    for e in failed:
        assert "replica" in str(e)
        assert getattr(e, "status_code", 503) == 503  # a clean "try again", never a 500
    counted = {k: metric(pd, f"motet_pd_{k}_total") - before[k] for k in before}
    print(f"{victim} killed: {counted}, {len(failed)} failed")
    # every request was prefilled or, its prefill lost or refused, computed by the decode replica
    assert counted["prefills"] + counted["prefill_fallbacks"] == len(cases), counted
    if victim == "PrefillReplica":
        assert not failed  # a lost prefill only costs time: the decode replica computes the prompt
    else:
        assert len(failed) <= 2, failed  # at most those running on it (--max-num-seqs 2)
    for messages, r in zip(cases, results, strict=True):
        if not isinstance(r, openai.APIError):
            assert r == offline(messages, max_tokens, ignore_eos=True)[0]
    # Serve starts a replica in the dead one's place; the server goes on, PD included.
    wait_for(lambda: len(replicas_of(pd, victim)) == 1, timeout=600, what="the replica replaced")
    r = client.chat.completions.create(model=MODEL, messages=chat(3), temperature=0, max_tokens=8)
    assert r.choices[0].message.content == offline(chat(3), 8)[0]

    def idle_and_whole() -> bool:  # no block held by anything: a leak would keep some used forever
        used = per_replica(pd, "motet_replica_kv_blocks_used")
        return len(used) == 2 and not any(used.values())

    wait_for(idle_and_whole, timeout=120, what="every KV block free on both idle replicas")
