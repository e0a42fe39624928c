"""Latency isolation to the last token (motet/engine/core/latency.py): while a light tenant's request runs, the step
stays within the TPOT target and the tenant over its share yields rows (kept running, with their KV); when
nobody is light, the step is the full budget. The engine's tokens are the same with and without it."""

from __future__ import annotations

import itertools

import pytest

from motet.engine.core.block_manager import BlockManager
from motet.engine.core.fairness import VirtualTokenCounter
from motet.engine.core.latency import BACKGROUND_SLACK, LINGER_S, StepCost
from motet.engine.core.scheduler import Scheduler
from motet.engine.core.sequence import QueueOrder, Sequence, SequenceStatus
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from tests.engine.test_fairness import run_step

_arrivals = iter(range(10**9))


def seq(tenant, prompt_len=6, max_tokens=16, background=False):
    first = 1000 * (ord(tenant[0]) - ord("a"))
    return Sequence(
        list(range(first, first + prompt_len)),
        SamplingParams(max_tokens=max_tokens),
        order=QueueOrder(next(_arrivals)),
        tenant=tenant,
        background=background,
    )


# -- the step's cost, learned ---------------------------------------------------------------------------------
def test_step_cost_fits_floor_and_per_token_cost():
    cost = StepCost()
    assert cost.tokens_within(0.06) is None  # nothing seen yet: no sizing
    for tokens in [1, 8, 64, 16, 3, 40, 64, 2, 32, 12] * 3:
        cost.observe(tokens, 0.015 + 0.0023 * tokens)
    fixed, per_token = cost.line()
    assert fixed == pytest.approx(0.015, rel=1e-6) and per_token == pytest.approx(0.0023, rel=1e-6)
    assert cost.tokens_within(0.06) == 19  # (0.06 - 0.015) / 0.0023 = 19.6
    assert cost.tokens_within(0.001) == 1  # never below one token


def test_step_cost_of_one_step_size_is_proportional_and_ignores_idle_gaps():
    cost = StepCost()
    for _ in range(10):
        cost.observe(64, 0.128)
    cost.observe(64, 3600.0)  # the engine sat idle: not a step's time
    cost.observe(0, 0.5)
    assert cost.line() == (0.0, pytest.approx(0.002))
    assert cost.tokens_within(0.06) == 30


def test_step_cost_follows_the_load():
    cost = StepCost()
    for tokens in [4, 60] * 20:
        cost.observe(tokens, 0.01 + 0.001 * tokens)
    for tokens in [4, 60] * 60:  # the machine got twice as slow
        cost.observe(tokens, 0.02 + 0.002 * tokens)
    assert cost.line()[1] == pytest.approx(0.002, rel=0.05)


# -- the scheduler --------------------------------------------------------------------------------------------
def make(target_s=0.06, max_seqs=64, budget=256, per_token=0.0023):
    sched = Scheduler(
        BlockManager(4096, 4), max_seqs, budget, fairness=VirtualTokenCounter(), tpot_target_s=target_s
    )
    for tokens in [1, 8, 64, 16, 3, 40, 64, 2, 32, 12]:  # the steps before: 15 ms + 2.3 ms a token
        sched.policy.latency.observe(tokens, 0.015 + per_token * tokens)
    return sched


def burst(sched, n=40, max_tokens=200):
    heavy = [seq("a", max_tokens=max_tokens) for _ in range(n)]
    for s in heavy:
        sched.add(s)
    while any(s.num_output_tokens == 0 for s in heavy):  # all prefilled and decoding
        run_step(sched)
    return heavy


def test_alone_the_burst_gets_the_full_step():
    sched = make()
    burst(sched)
    batch = run_step(sched)
    assert len(batch) == 40 and sched.policy.num_capped_steps == 0


def test_a_light_tenant_runs_every_step_and_the_burst_yields_rows_that_keep_their_kv():
    sched = make()
    heavy = burst(sched)
    light = seq("b", prompt_len=10, max_tokens=8)
    sched.add(light)
    first = run_step(sched)
    assert (
        light in first.seqs and first.num_new_tokens[first.seqs.index(light)] == 10
    )  # its whole prompt at once
    tables = {s.seq_id: list(s.block_table) for s in heavy}
    steps = 1
    while not light.is_finished:
        batch = run_step(sched)
        steps += 1
        assert light in batch.seqs or light.is_finished
        assert batch.num_tokens <= 19  # (60 ms - 15 ms) / 2.3 ms
        assert not batch.preempted
    assert steps == 8  # one token a step, 8 tokens
    yielded = [s for s in heavy if s not in batch.seqs]
    assert yielded and all(s.status is SequenceStatus.RUNNING for s in yielded)
    assert all(s.block_table[: len(tables[s.seq_id])] == tables[s.seq_id] for s in yielded)  # KV kept
    assert sched.num_preemptions == 0


def test_the_cap_lingers_for_the_light_tenants_next_turn_then_lifts(monkeypatch):
    import motet.engine.core.scheduler as scheduler_module

    clock = [1000.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: clock[0])
    sched = make()
    burst(sched)
    light = seq("b", max_tokens=2)
    sched.add(light)
    while not light.is_finished:
        run_step(sched)
    clock[0] += LINGER_S / 2
    assert run_step(sched).num_tokens <= 19  # b's next turn is likely: the step stays small
    clock[0] += LINGER_S
    assert len(run_step(sched)) == 40  # b has gone: the burst has the full step again


def test_the_bursts_last_requests_still_yield_to_a_light_one():
    sched = make()
    burst(sched, n=20)  # within a's fair share of 64 slots
    light = seq("b", max_tokens=4)
    sched.add(light)
    run_step(sched)
    assert run_step(sched).num_tokens <= 19 and sched.policy.num_capped_steps == 2


def test_tenants_of_like_demand_do_not_size_each_others_steps():
    sched = make()
    for tenant, n in (("a", 6), ("c", 4)):
        for _ in range(n):
            sched.add(seq(tenant, prompt_len=30, max_tokens=50))
    for _ in range(4):
        run_step(sched)
    assert sched.policy.num_capped_steps == 0


def test_two_backlogged_tenants_are_not_light():
    sched = make(max_seqs=16)
    for tenant in "ac":
        for _ in range(30):
            sched.add(seq(tenant, max_tokens=100))
    for _ in range(10):
        batch = run_step(sched)
    assert len(batch) == 16 and sched.policy.num_capped_steps == 0


def test_batch_work_yields_to_interactive_requests():
    sched = make()
    batch_rows = [seq("a", max_tokens=100, background=True) for _ in range(30)]
    for s in batch_rows:
        sched.add(s)
    for _ in range(3):
        run_step(sched)
    assert sched.policy.num_capped_steps == 0  # batch work alone: the full step
    interactive = [seq("c", max_tokens=6) for _ in range(4)]  # the same load as the batch would be too
    for s in interactive:
        sched.add(s)
    run_step(sched)
    # Beside 4 decoding interactive rows the batch rows may add only what keeps the step within 1.1x of those
    # rows alone: (1.1 x (15 ms + 4 x 2.3 ms) - 15 ms) / 2.3 ms = 5 tokens in all, one batch row's.
    spare = sched.policy.latency.cost.tokens_within(BACKGROUND_SLACK * sched.policy.latency.cost.seconds(4))
    assert spare == 5
    while not all(s.is_finished for s in interactive):
        unfinished = [s for s in interactive if not s.is_finished]
        batch = run_step(sched)
        assert all(s in batch.seqs for s in unfinished) and batch.num_tokens <= spare
        assert len(batch) > len(unfinished)  # the batch still moves
    assert sched.num_preemptions == 0
    progressed = sum(s.num_output_tokens for s in batch_rows)
    batch = run_step(
        sched
    )  # the interactive rows are gone: no row to protect, the batch runs at the 60 ms cap
    assert len(batch) == 19 and sum(s.num_output_tokens for s in batch_rows) == progressed + 19


def test_a_tenant_sending_long_prompts_back_to_back_is_the_heavy_one():
    """Two 900-token prompts at a time, each replaced as it ends: by its request count a light tenant, whose prompt
    chunks went first at the full budget and left the cap nothing for the other tenant's 8 streams (93 tokens/s
    to 0). Judged by the tokens it brings it is the heavy one: the streams get their token every step, and the
    prompts take the rest of the capped step or, their tenant running fewer sequences than its share, the floor's
    half of it: tokens as long as the streams' own step (15 ms / 2.3 ms + 8 = 15)."""
    sched = make()
    streams = [seq("a", max_tokens=10_000) for _ in range(8)]
    for s in streams:
        sched.add(s)
    run_step(sched)
    prompts = itertools.count()

    def long_prompt():  # each its own tokens: no prefix-cache hit
        first = 10_000 * (1 + next(prompts))
        s = Sequence(list(range(first, first + 900)), SamplingParams(max_tokens=16), order=QueueOrder(next(_arrivals)),
                     tenant="g")  # fmt: skip
        sched.add(s)
        return s

    sent = [long_prompt(), long_prompt()]
    for step in range(250):
        batch = run_step(sched)
        assert all(s in batch.seqs for s in streams), step  # the streams' token every step
        assert batch.num_tokens <= 8 + max(19 - 8, 15) and any(s.tenant == "g" for s in batch.seqs)
        sent = [s if not s.is_finished else long_prompt() for s in sent]
    assert all(s.num_output_tokens == 251 for s in streams)
    assert next(prompts) > 3  # the long prompts were served too, the capped step's other 11 tokens


@pytest.mark.parametrize("flex_tenant", ["a", "c"])
def test_batch_work_does_not_make_a_heavy_tenant_latency_bound(flex_tenant):
    """Beside batch work every interactive tenant counted as latency-bound, the heavy one too: a tenant keeping
    two `flex` requests running (or anyone's batch work) made its 40 streams immune, and a light tenant decoded in
    steps of 40 tokens and more (7.9x slower). Batch work changes nothing between interactive tenants: the light
    one is latency-bound, the heavy one yields, the batch rows wait behind both."""
    sched = make()
    heavy = burst(sched)
    flex = [seq(flex_tenant, max_tokens=500, background=True) for _ in range(2)]
    for s in flex:
        sched.add(s)
    while any(s.status is not SequenceStatus.RUNNING for s in flex):
        run_step(sched)
    light = seq("b", max_tokens=8)
    sched.add(light)
    progressed = sum(s.num_output_tokens for s in heavy)
    while not light.is_finished:
        batch = run_step(sched)
        assert light in batch.seqs and batch.num_tokens <= 19
        assert not any(s.background for s in batch.seqs)  # no spare room beside 19 interactive rows
    assert light.num_output_tokens == 8 and sum(s.num_output_tokens for s in heavy) > progressed  # both moved
    assert sched.num_preemptions == 0


def test_off_when_the_target_is_zero():
    sched = make(target_s=None)
    burst(sched)
    sched.add(seq("b", max_tokens=4))
    run_step(sched)
    assert len(run_step(sched)) == 41 and sched.policy.num_capped_steps == 0


# -- the engine: the same tokens, sized or not ----------------------------------------------------------------
def test_engine_tokens_are_the_same_with_and_without_latency_isolation(tiny_model_dir):
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine

    def run(target_ms):
        engine = LLMEngine(
            EngineConfig(model=str(tiny_model_dir), device="cpu", tpot_target_ms=target_ms, max_num_seqs=16)
        )
        try:
            greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
            for i in range(12):
                engine.add_request(list(range(3 + i, 20 + 2 * i)), greedy, f"a{i}", tenant="a")
            out, answers = {}, RequestOutputs()
            for _ in range(3):
                for o in answers.step(engine):
                    out[o.request_id] = o.token_ids
            for i in range(2):
                engine.add_request(list(range(50 + i, 60 + i)), greedy, f"b{i}", tenant="b")
            engine.add_request(list(range(70, 90)), greedy, "batch", tenant="c", background=True)
            while engine.has_unfinished():
                for o in answers.step(engine):
                    out[o.request_id] = o.token_ids
            return out, engine.scheduler.policy.num_capped_steps
        finally:
            engine.close()

    # A 1 ms target caps every step that can be: each yields all but the latency-bound rows and one more.
    capped, num_capped = run(1.0)
    plain, num_plain = run(0)
    assert num_capped > 0 and num_plain == 0
    assert capped == plain and all(len(t) == 24 for t in plain.values())


# -- over HTTP: every tenant with work makes progress -----------------------------------------------------------
def test_a_tenants_prompt_is_answered_while_a_light_tenants_streams_run(tiny_model_dir, tmp_path):
    """Issue 57, finding 1, on a real server: tenant a keeps 8 streams running (light beside a 900-token prompt),
    tenant b sends the prompt; at a 1 ms target (a step of 1 token: less than a's decode rows alone) the prompt got
    no token until a's streams ended. It is answered while they all still run now."""
    import openai

    from tests.live_server import ThreadServer, keys_file

    srv = ThreadServer(
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--api-keys",
        keys_file(tmp_path, {"sk-a": "a", "sk-b": "b"}), "--data-dir", str(tmp_path / "data"), "--threads", "1",
        "--max-model-len", "2048", "--tpot-target-ms", "1",
    )  # fmt: skip
    try:

        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=300)

        streams = [
            client("sk-a").chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"stream {i}"}],
                max_tokens=2000,
                stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for i in range(8)
        ]
        for stream in streams:  # all 8 decoding (the server never waits for a reader: the rest waits for us)
            chunks = iter(stream)
            while not next(chunks).choices[0].delta.content:
                pass
        answer = client("sk-b").completions.create(
            model="tiny", prompt=list(range(20, 320)) * 3, max_tokens=1
        )
        assert answer.usage.prompt_tokens == 900 and answer.usage.completion_tokens == 1
        stats = srv.state.system.stats()
        assert stats.num_running == 8, stats  # a's streams, every one still running
        for stream in streams:
            stream.close()
    finally:
        srv.stop()


# -- the API: which requests are batch work ---------------------------------------------------------------------
def test_batch_work_is_marked_from_the_keys_file_the_flex_tier_and_batch_lines(tiny_model_dir):
    import time

    from starlette.testclient import TestClient

    from motet.actors.system import ServingSystem
    from motet.api.app import create_app
    from motet.api.asgi import BATCH_SCOPE_KEY
    from motet.api.auth import Authenticator
    from motet.api.state import ServerState
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine

    seen = []

    class Recording(LLMEngine):
        def add(self, request):
            seen.append((request.tenant, request.background))
            return super().add(request)

    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=8, max_model_len=512)
    system = ServingSystem(lambda: Recording(cfg, model_dir=tiny_model_dir), max_queue_len=64)
    keys = {"k-live": "live", "k-nightly": {"tenant": "nightly", "priority_class": "batch"}}
    state = ServerState(system, ["tiny"], auth=Authenticator(keys))
    app = create_app(state)

    def batch_line_scope(app):  # what the batch runner's in-process calls carry
        async def wrapped(scope, receive, send):
            if scope["type"] == "http" and scope["path"].endswith("/batch-line"):
                scope = {
                    **scope,
                    "path": "/v1/chat/completions",
                    "raw_path": b"/v1/chat/completions",
                    BATCH_SCOPE_KEY: "live",
                }  # fmt: skip  (a batch line names its batch's tenant)
            await app(scope, receive, send)

        return wrapped

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with TestClient(batch_line_scope(app)) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        def post(key, path="/v1/chat/completions", **extra):
            r = c.post(path, json={**body, **extra}, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.json()

        post("k-live")
        post("k-live", service_tier="auto")
        post("k-live", service_tier="flex")
        post("k-nightly")
        post("k-live", path="/batch-line")
        r = c.post("/v1/chat/completions", json={**body, "service_tier": "priority"},
                   headers={"Authorization": "Bearer k-live"})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "service_tier"
    assert seen == [("live", False), ("live", False), ("live", True), ("nightly", True), ("live", True)]


def test_a_keys_file_priority_class_is_checked():
    from motet.api.auth import Authenticator

    assert Authenticator({"k": {"tenant": "t", "priority_class": "batch"}}).keys["k"].background
    assert not Authenticator({"k": {"tenant": "t"}}).keys["k"].background
    for bad in ({"tenant": "t", "priority_class": "low"}, {"admin": True, "priority_class": "batch"}):
        with pytest.raises(ValueError, match="priority_class"):
            Authenticator({"k": bad})


@pytest.mark.parametrize(("streams", "target_s"), [(24, 0.06), (8, 0.01), (24, 0.01)])
def test_a_light_tenants_streams_never_starve_another_tenants_prompt(streams, target_s):
    """A tenant keeping 8 or 24 streams running is light beside another's 900-token prompt; its rows took the capped
    step whole (24 decode tokens against 19 at a 60 ms target, or against 1 at 10 ms), and the prompt got no token
    until the streams stopped. Every tenant with work makes progress: the least-served held-back tenant gets at least a floor of
    tokens each step (VTC's guarantee), so the prompt is computed in a bounded number of steps while the streams
    keep their token every step."""
    sched = make(target_s=target_s)
    light = [seq("a", max_tokens=10_000) for _ in range(streams)]
    for s in light:
        sched.add(s)
    run_step(sched)
    prompt = Sequence(
        list(range(20_000, 20_900)),
        SamplingParams(max_tokens=4),
        order=QueueOrder(next(_arrivals)),
        tenant="b",
    )
    sched.add(prompt)
    bound = -(-900 // 8) + 2  # at least 8 tokens (of the 256 budget) a step, and the first token's step
    for _ in range(bound):
        batch = run_step(sched)
        assert all(s in batch.seqs for s in light)  # the streams' token every step all the same
        if prompt.num_output_tokens:
            break
    assert prompt.num_computed_tokens >= 900 and prompt.num_output_tokens >= 1
    assert sched.policy.num_capped_steps > 0 and sched.num_preemptions == 0


@pytest.mark.parametrize("slower", [1, 4, 20])
def test_the_floor_holds_in_time_however_slow_steps_get(slower):
    """Beside other busy processes a step's fixed part grows most (its barriers wait for threads off the core): a
    floor of so many tokens a step stretched another tenant's 1,200-token prompt beside 8 streams over ever slower
    steps (179 s against 8.8 s alone). The floor is worth half the capped step's time while the prompt's tenant
    runs fewer sequences than its share: the prompt is done within twice its time alone whether steps take 15 ms
    or 20 times that, and the streams keep their token every step."""
    sched = Scheduler(BlockManager(4096, 4), 64, 256, fairness=VirtualTokenCounter(), tpot_target_s=0.06)
    fixed, per_token = 0.015 * slower**1.5, 0.0023 * slower  # the fixed part grows faster than a token's
    for tokens in [1, 8, 64, 16, 3, 40, 64, 2, 32, 12]:
        sched.policy.latency.observe(tokens, fixed + per_token * tokens)
    streams = [seq("a", max_tokens=10_000) for _ in range(8)]
    for s in streams:
        sched.add(s)
    run_step(sched)
    prompt = Sequence(list(range(20_000, 21_200)), SamplingParams(max_tokens=1), order=QueueOrder(next(_arrivals)),
                      tenant="b")  # fmt: skip
    sched.add(prompt)
    steps = 0
    while not prompt.num_output_tokens:
        batch = run_step(sched)
        assert all(s in batch.seqs for s in streams)
        steps += 1
        sched.policy.latency.observe(batch.num_tokens, fixed + per_token * batch.num_tokens)
    # the prompt alone: 5 full steps; beside the streams its tokens take about half of each step
    alone = 5 * fixed + 1200 * per_token
    assert steps * fixed + 1200 * per_token + steps * 8 * per_token <= 2 * alone, steps
