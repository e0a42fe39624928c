"""No tenant can observe another's prompts through what is shared between requests (issue 31, findings 1 and 7).

The prefix cache: tenant B probes for tenant A's system prompt against a real `motet serve` on loopback (tiny
random model, chat and Responses), and B's `cached_tokens` must be what a server that never saw A's prompt
answers; a tenant still reuses its own prefixes, `--shared-prefix-cache` restores sharing across tenants, and
vLLM's `cache_salt` separates requests within a tenant. The router's block hashes must equal the engine's for
salted keys, in any process. The speculation history: one tenant's traffic cannot evict another's scopes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from motet.engine.speculative.history import DraftScope, OutputHistory
from tests.clock import Clock
from tests.live_server import ROOT, Server, tiny_server

MODEL = "tiny"
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
FILLER = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)


def system_prompt(pin: str, topic: str) -> str:
    """A long system prompt holding a secret early on: guesses differ at the PIN, share what comes before (and
    prompts of different topics share no block: the topic comes first)."""
    return f"{topic} assistant. Answer in one line, politely and briefly. The PIN is {pin}. {FILLER}"


# -- the live server --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenant-isolation")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    return tmp


def start(tiny_model_dir, dirs, *flags: str) -> Server:
    return tiny_server(tiny_model_dir, dirs, "--num-kv-blocks", "1024", *flags, name=MODEL)


@pytest.fixture(scope="module")
def server(tiny_model_dir, dirs):
    srv = start(tiny_model_dir, dirs)
    yield srv
    srv.stop()


def chat_cached(c: httpx.Client, system: str, **extra) -> int:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, **extra,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}  # fmt: skip
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def responses_cached(c: httpx.Client, system: str, **extra) -> int:
    body = {"model": MODEL, "max_output_tokens": 1, "temperature": 0, "store": False, **extra,
            "instructions": system, "input": "hi"}  # fmt: skip
    r = c.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["input_tokens_details"]["cached_tokens"]


def completion_cached(c: httpx.Client, prompt: str, **extra) -> int:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "prompt": prompt, **extra}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def probe(send, c: httpx.Client, topic: str) -> list[int]:
    """An attacker's probe: a warm-up (its own template prefix cached), then the right guess and a wrong one."""
    return [send(c, system_prompt(pin, topic)) for pin in ("0000", "4721", "1234")]


SENDS = {"Chatty": chat_cached, "Responsive": responses_cached}  # topic -> how the prompt is sent


@pytest.fixture(scope="module")
def fresh(tiny_model_dir, dirs):
    """What the probes answer on a server that never saw anyone else's prompt."""
    server = start(tiny_model_dir, dirs)
    try:
        return {topic: probe(send, server.client("sk-bob"), topic) for topic, send in SENDS.items()}
    finally:
        server.stop()


@pytest.mark.parametrize("topic", SENDS)
def test_another_tenants_prompt_cannot_be_probed(server, fresh, topic):
    send = SENDS[topic]
    alice, bob = server.client("sk-alice"), server.client("sk-bob")
    assert fresh[topic][0] == 0 and fresh[topic][1] == fresh[topic][2] > 0  # the prefix before the PIN
    assert send(alice, system_prompt("4721", topic)) == 0  # alice's secret prompt, now in the cache
    seen = probe(send, bob, topic)
    assert seen == fresh[topic]  # the right guess is cached no more than a wrong one, as on a fresh server
    # And alice's own prefix is reused: all of it but the tail of the last (partial) block.
    again = send(alice, system_prompt("4721", topic))
    assert again > seen[1] and again % 16 == 0


def test_cache_salt_separates_requests_within_a_tenant(server):
    alice = server.client("sk-alice")
    system = system_prompt("9999", "Salty")
    first = chat_cached(alice, system, cache_salt="user-1")
    assert first == 0
    assert chat_cached(alice, system, cache_salt="user-2") == 0  # another salt shares nothing
    assert chat_cached(alice, system) == 0  # nor does no salt
    whole = chat_cached(alice, system, cache_salt="user-1")
    assert whole > 0 and chat_cached(alice, system) == whole  # each salt reuses its own
    bob = server.client("sk-bob")
    assert chat_cached(bob, system, cache_salt="user-1") == 0  # the salt combines with the tenant
    # Completions and Responses take the field too.
    prompt = system_prompt("8888", "Completing")
    assert completion_cached(alice, prompt, cache_salt="a") == 0
    assert completion_cached(alice, prompt, cache_salt="b") == 0
    assert completion_cached(alice, prompt, cache_salt="a") > 0
    system = system_prompt("7777", "Responding")
    assert responses_cached(alice, system, cache_salt="a") == 0
    assert responses_cached(alice, system, cache_salt="b") == 0
    assert responses_cached(alice, system, cache_salt="a") > 0


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ],
)
def test_cache_salt_must_be_a_non_empty_string(server, path, body):
    alice = server.client("sk-alice")
    for bad in ("", 5, ["x"], "x" * 257):
        r = alice.post(path, json={"model": MODEL, **body, "cache_salt": bad})
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert err["param"] == "cache_salt" and err["type"] == "invalid_request_error", err
    assert alice.post(path, json={"model": MODEL, **body, "cache_salt": "x" * 256}).status_code == 200


def test_shared_prefix_cache_shares_across_tenants(tiny_model_dir, dirs):
    server = start(tiny_model_dir, dirs, "--shared-prefix-cache")
    try:
        alice, bob = server.client("sk-alice"), server.client("sk-bob")
        system = system_prompt("4721", "Sharing")
        assert chat_cached(alice, system) == 0
        right, wrong = chat_cached(bob, system), chat_cached(bob, system_prompt("1234", "Sharing"))
        assert right > wrong > 0  # bob reads alice's blocks: the operator's choice
        assert chat_cached(bob, system_prompt("4721", "Seasoned"), cache_salt="s") == 0
        assert chat_cached(alice, system_prompt("4721", "Seasoned"), cache_salt="s") > 0  # salt shared
    finally:
        server.stop()


# -- the engine and the router agree on salted keys ------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine

    def engine(shared: bool):
        cfg = EngineConfig(
            model=str(tiny_model_dir),
            num_kv_blocks=256,
            num_threads=1,
            block_size=4,
            shared_prefix_cache=shared,
        )
        return LLMEngine(cfg)

    return {False: engine(False), True: engine(True)}


def run(engine, prompt, tenant, cache_salt=None):
    from motet.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, cache_salt=cache_salt)
    rid = engine.add_request(prompt, params, tenant=tenant)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.num_cached_tokens
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("shared", [False, True])
def test_route_hashes_equal_the_engines_salted_keys(engines, shared):
    from motet.actors.messages import GenerateSpec
    from motet.cluster.prompt_blocks import route_hashes
    from motet.engine.sampling_params import SamplingParams

    engine = engines[shared]
    bs = engine.config.block_size
    messages = [
        {"role": "system", "content": f"You are terse ({shared})."},
        {"role": "user", "content": "A fox?"},
    ]
    prompt = engine.tokenizer.encode_chat(messages)

    def hashes(tenant, salt):
        spec = GenerateSpec(["r"], [SamplingParams(cache_salt=salt)], tenant=tenant, messages=messages)
        return route_hashes(engine.tokenizer, spec, bs, shared)

    alice, alice_salted, bob = hashes("alice", None), hashes("alice", "s"), hashes("bob", None)
    assert len(alice) == (len(prompt) - 1) // bs > 2
    assert not set(alice) & set(alice_salted)  # a salt is a cache of its own
    assert (alice == bob) is shared and (not set(alice) & set(bob)) is not shared
    assert run(engine, prompt, "alice", "s") == 0
    assert set(alice_salted) <= set(engine.block_manager.cached)  # exactly what the router asked about
    assert not set(alice) & set(engine.block_manager.cached)
    assert run(engine, prompt, "alice") == 0
    assert set(alice) <= set(engine.block_manager.cached)
    assert run(engine, prompt, "bob") == (len(alice) * bs if shared else 0)
    assert run(engine, prompt, "bob", "s") == (len(alice) * bs if shared else 0)
    assert run(engine, prompt, "alice") == len(alice) * bs


def test_salted_hashes_agree_across_processes():
    """The salt is a digest of the tenant and cache_salt strings, which hash() would key differently per
    process: a router in another process must compute the engine's keys."""
    code = (
        "from motet.cluster.prompt_blocks import block_hashes; from motet.engine.core.block_manager import prefix_salt;"
        "print(block_hashes(list(range(40)), 7, prefix_salt('alice', 'user-1'), 16))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout
        for seed in (1, 2)
    }
    from motet.cluster.prompt_blocks import block_hashes
    from motet.engine.core.block_manager import prefix_salt

    assert runs == {f"{block_hashes(list(range(40)), 7, prefix_salt('alice', 'user-1'), 16)}\n"}
    salts = {prefix_salt(t, s) for t in ("alice", "bob") for s in (None, "user-1", "user-2")}
    assert len(salts) == 6 and 0 not in salts
    assert prefix_salt("alice", None, True) == prefix_salt("bob", None, True) == prefix_salt(None, None) == 0
    assert prefix_salt("alice", "x", True) == prefix_salt("bob", "x", True) != prefix_salt("alice", "x")


# -- the speculation history: budgets per tenant ----------------------------------------------------------------
def scope(tenant: str, adapter: int = 0) -> DraftScope:
    return DraftScope(tenant, None, adapter, None, False)


def test_another_tenants_traffic_cannot_evict_a_tenants_history():
    history = OutputHistory(4)  # the server's budgets
    history.record(scope("alice"), [], [1, 2, 3, 4, 5, 6])
    want = history.propose(scope("alice"), [1, 2], 4)
    assert want[0] == [3, 4, 5, 6]
    # Bob floods the history: more scopes and more tokens than any budget, over and over.
    for i in range(600):
        history.record(scope("bob", i), [], [(i * 7 + j) % 500 for j in range(400)])
    assert history.propose(scope("alice"), [1, 2], 4) == want
    assert history.num_tokens <= history.max_tokens


def test_a_tenant_slot_is_freed_only_by_its_own_idleness():
    clock = Clock()
    history = OutputHistory(4, max_tenants=2, tenant_idle_s=100, clock=clock)
    history.record(scope("alice"), [], [1, 2, 3])
    history.record(scope("bob"), [], [4, 5, 6])
    for t in range(1, 5):  # both stay active: carol is turned away, and never evicts either
        clock.now = 60.0 * t
        assert history.propose(scope("alice"), [1], 2)[0] == [2, 3]
        assert history.propose(scope("bob"), [4], 2)[0] == [5, 6]
        history.record(scope("carol"), [], [7, 8, 9])
        assert history.propose(scope("carol"), [7], 2) == ([], [])
    clock.now += 99.0  # bob goes quiet, alice stays busy
    assert history.propose(scope("alice"), [1], 2)[0] == [2, 3]
    clock.now += 1.0  # bob idle for 100 s
    history.record(scope("carol"), [], [7, 8, 9])
    assert history.propose(scope("carol"), [7], 2)[0] == [8, 9]  # carol took bob's slot, not alice's
    assert history.propose(scope("alice"), [1], 2)[0] == [2, 3]
    assert history.propose(scope("bob"), [4], 2) == ([], [])
    assert history.turned_away == 4


def test_memory_stays_bounded_over_many_tenants():
    history = OutputHistory(
        4, max_tenants=4, scopes_per_tenant=3, tokens_per_tenant=300, tokens_per_scope=200
    )
    for t in range(20):
        for i in range(10):
            history.record(scope(f"t{t}", i), [9, 9], list(range(t, t + 150)))
    assert history.num_tokens <= history.max_tokens == 4 * 300
    assert len(history) <= 4 * 3
    history.record(scope("t0", 99), [], list(range(1000)))  # one long output: its start, within the budget
    assert history.num_tokens <= history.max_tokens
