"""The actor runtime and the serving actors, on a tiny random model (no sockets)."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from motet.actors.adapter_queues import AdapterQueuesActor
from motet.actors.messages import Enqueue, GenerateSpec, QueuedRequest, Take
from motet.actors.reply import ReplyStream, merge_streams
from motet.actors.runtime import Actor, ActorStopped, ActorSystem
from motet.actors.serving_errors import EngineFailure, InvalidRequest, QueueFull
from motet.actors.system import ServingSystem
from motet.api.metrics import Metrics
from motet.engine.config import EngineConfig
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import OutputDelta
from motet.engine.request import EngineRequest
from motet.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


# -- runtime -----------------------------------------------------------------------------------------------
class Echo(Actor):
    name = "echo"

    def __init__(self, log):
        super().__init__()
        self.log = log

    async def on_start(self):
        self.log.append(f"start {self.name}")

    async def handle(self, message):
        if message == "boom":
            raise ValueError("boom")
        self.log.append(message)
        return message.upper()


async def test_ask_tell_errors_and_ordered_startup():
    log = []
    a, b = Echo(log), Echo(log)
    b.name = "second"
    system = ActorSystem([a, b])
    async with anyio.create_task_group() as tg:
        await tg.start(system.run)
        assert log == ["start echo", "start second"]
        assert await a.ask("hi") == "HI"
        with pytest.raises(ValueError, match="boom"):
            await a.ask("boom")
        assert await a.ask("still alive") == "STILL ALIVE"  # a failing message does not kill the actor
        await b.tell("told")
        await system.stop()
    assert "told" in log
    with pytest.raises(ActorStopped):
        await a.ask("late")


async def test_reply_stream_merges_pending_deltas():
    s = ReplyStream("r")
    s.put(OutputDelta("r", text="a", token_ids=[1]))
    s.put(OutputDelta("r", text="b", token_ids=[2]))
    s.put(OutputDelta("r", text="c", token_ids=[3], finished=True, finish_reason="stop"))
    s.put(OutputDelta("r", text="ignored"))  # after the final delta
    got = [d async for d in s]
    assert len(got) == 1
    assert (got[0].text, got[0].token_ids, got[0].finish_reason) == ("abc", [1, 2, 3], "stop")


async def test_merge_streams_interleaves_until_all_finish():
    s1, s2 = ReplyStream("1"), ReplyStream("2")
    out = []

    async def consume():
        async for i, d in merge_streams([s1, s2]):
            out.append((i, d.text))

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.sleep(0)
        s1.put(OutputDelta("1", text="x"))
        s2.put(OutputDelta("2", text="y", finished=True))
        await anyio.sleep(0.01)
        s1.put(OutputDelta("1", text="z", finished=True))
    assert sorted(out) == [(0, "x"), (0, "z"), (1, "y")]


def _queued(rid, tenant="t", adapter_id=0):
    return QueuedRequest(
        EngineRequest(rid, [1, 2, 3], SamplingParams(), adapter_id, tenant=tenant), ReplyStream(rid)
    )


async def test_adapter_queues_bound_and_fair_take():
    q = AdapterQueuesActor(max_queue_len=3)
    async with anyio.create_task_group() as tg:
        await tg.start(q._run)
        await q.ask(Enqueue([_queued("a1", "a"), _queued("a2", "a")]))
        await q.ask(Enqueue([_queued("b1", "b")]))
        with pytest.raises(QueueFull):
            await q.ask(Enqueue([_queued("a3", "a")]))
        await q.ask(Enqueue([_queued("x1", "a", adapter_id=7)]))  # another adapter: its own queue
        assert q.depth_by_adapter() == {0: 3, 7: 1}
        order = iter(["b", "a", "a", "a", None])
        taken = await q.ask(Take(lambda tenants: next(order)))
        assert [r.request.request_id for r in taken.requests] == ["b1", "a1", "a2", "x1"]
        assert not taken.more
        q.close()


# -- the serving system on a tiny model ---------------------------------------------------------------------
FAULT_TOKEN = 299  # a prompt holding it makes the forward pass raise (the faulty engine below)


def _engine_factory(model_dir, faulty: bool = False, **kw):
    cfg = dict(model=str(model_dir), num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    cfg.update(kw)

    def build():
        engine = LLMEngine(EngineConfig(**cfg), model_dir=model_dir)
        if faulty:
            inject_fault(engine, FAULT_TOKEN)
        return engine

    return build


def inject_fault(engine: LLMEngine, token: int) -> None:
    """Make the engine's forward pass raise for any batch holding a prompt with `token` (as a kernel bug
    triggered by one request's input would)."""
    execute = engine.runner.execute

    def execute_or_fail(step, *args):
        rows = [engine.requests.get(p.request_id) for p in step]  # (the runner sees the step's plan only)
        if any(token in s.prompt_token_ids for s in rows if s is not None):
            raise RuntimeError("injected fault")
        return execute(step, *args)

    engine.runner.execute = execute_or_fail


def _spec(rid, prompt, n=1, tenant="t", **params):
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 8)
    return GenerateSpec(
        request_ids=[f"{rid}-{i}" for i in range(n)],
        params=[SamplingParams(**params)] * n,
        tenant=tenant,
        prompt=prompt,
        max_tokens=params["max_tokens"],
    )


async def _drain(stream):
    text, tokens, last = "", [], None
    async for d in stream:
        if d.error:
            raise d.error
        text += d.text
        tokens += d.token_ids
        last = d
    return text, tokens, last


@pytest.fixture
async def system(tiny_model_dir, request):
    kw = getattr(request, "param", {})
    sys_kw = {k: kw.pop(k) for k in list(kw) if k in ("max_queue_len", "max_waiting")}
    s = ServingSystem(_engine_factory(tiny_model_dir, **kw), **sys_kw)
    async with anyio.create_task_group() as tg:
        await tg.start(s.run)
        yield s
        await s.stop()


async def test_generates_like_the_offline_engine(system, tiny_model_dir):
    prompts = ["The quick brown fox", "Paris is the capital", [5, 6, 7, 8]]
    admissions = [await system.submit(_spec(f"r{i}", p)) for i, p in enumerate(prompts)]
    results = [await _drain(a.streams[0]) for a in admissions]
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64)
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    for (text, tokens, last), exp in zip(results, expected, strict=True):
        assert tokens == exp.token_ids
        assert text == exp.text
        assert last.finish_reason == exp.finish_reason
    assert system.stats().num_running == 0


async def test_abort_frees_blocks_within_a_step(system):
    adm = await system.submit(_spec("long", "The quick brown fox", max_tokens=200, ignore_eos=True))
    stream = adm.streams[0]
    await stream.get()  # it is running
    assert system.stats().kv_blocks_used > 0
    stream.cancel()
    system.abort(stream.request_id)
    with anyio.fail_after(10):
        while system.stats().kv_blocks_used or system.stats().num_running:
            await anyio.sleep(0.01)
    assert not system.scheduler.live


async def test_invalid_prompt_is_rejected_at_ingress(system):
    with pytest.raises(InvalidRequest) as e:
        await system.submit(_spec("empty", ""))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequest) as e:
        await system.submit(_spec("toolong", [1] * 5000))
    assert e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("system", [{"faulty": True}], indirect=True)
async def test_fault_fails_alone(system):
    good = [await system.submit(_spec(f"g{i}", [5, 6, 7 + i], max_tokens=6)) for i in range(3)]
    bad = await system.submit(_spec("bad", [5, 6, FAULT_TOKEN, 7]))
    with pytest.raises(EngineFailure, match="injected fault"):
        await _drain(bad.streams[0])
    for a in good:
        _, tokens, last = await _drain(a.streams[0])
        assert len(tokens) == 6 or last.finish_reason == "stop"
    # and it keeps serving
    _, tokens, _ = await _drain((await system.submit(_spec("after", "Paris is"))).streams[0])
    assert tokens


@pytest.mark.parametrize("system", [{"max_queue_len": 2, "max_num_seqs": 1, "max_waiting": 1}], indirect=True)
async def test_queue_full(system):
    admitted = []
    with pytest.raises(QueueFull) as e:
        for i in range(6):  # 1 running, 1 admitted, 2 queued: the queue bound is reached by the 5th
            admitted.append(await system.submit(_spec(f"a{i}", "The quick", max_tokens=30, ignore_eos=True)))
    assert e.value.status == 429 and e.value.retry_after > 0
    for adm in admitted:  # every accepted request completes
        _, tokens, _ = await _drain(adm.streams[0])
        assert len(tokens) == 30


@pytest.mark.parametrize("system", [{"max_queue_len": 8, "max_num_seqs": 1, "max_waiting": 1}], indirect=True)
async def test_fairness_across_tenants(system):
    # Tenant A floods; B's single request, arriving last, overtakes most of A's backlog.
    a = [
        await system.submit(_spec(f"a{i}", "The quick brown fox", tenant="A", max_tokens=4)) for i in range(5)
    ]
    b = await system.submit(_spec("b0", "Paris is the capital", tenant="B", max_tokens=4))
    finished = []

    async def watch(name, adm):
        await _drain(adm.streams[0])
        finished.append(name)

    async with anyio.create_task_group() as tg:
        for i, adm in enumerate(a):
            tg.start_soon(watch, f"a{i}", adm)
        tg.start_soon(watch, "b0", b)
    assert finished.index("b0") <= 3, finished  # FIFO would make it last (5)
    assert set(finished) == {f"a{i}" for i in range(len(a))} | {"b0"}


@pytest.mark.parametrize(
    "system", [{"max_queue_len": 16, "max_num_seqs": 2, "max_waiting": 1}], indirect=True
)
async def test_light_tenant_starts_at_the_next_step_under_another_tenants_backlog(system):
    """A's 8 requests fill the engine (2 running, one waiting) and the queue; B's request, queued behind
    them in the same (base model) queue, reaches the engine and runs at the next step, in place of A's newest;
    FIFO would start it after A's first requests finish (40 steps)."""
    fixed = {"max_tokens": 40, "ignore_eos": True, "speculative": False}
    a = [await system.submit(_spec(f"a{i}", "The quick brown fox", tenant="A", **fixed)) for i in range(8)]
    firsts = [await adm.streams[0].get() for adm in a[:2]]  # running
    # A request handed from its queue to the engine is in neither count for a moment: wait for it to land.
    with anyio.fail_after(10):
        while (stats := system.stats()).num_waiting + stats.queued != 6:
            await anyio.sleep(0.01)
    assert stats.num_running == 2
    b = await system.submit(_spec("b0", "Paris is the capital", tenant="B", max_tokens=4, speculative=False))
    # Counted once B is in its queue: its tokenization may span a step on a busy machine, not the policy.
    submitted_at = system.scheduler.steps
    first = await b.streams[0].get()
    assert first.token_ids and system.scheduler.steps - submitted_at <= 3
    tenants = {t.tenant: t for t in system.stats().tenants}
    assert (tenants["B"].running, tenants["A"].running) == (1, 1)  # each its share of the 2 slots
    assert tenants["A"].queued + tenants["A"].waiting == 7 and tenants["A"].virtual_tokens > 0
    # The same, as an admin reads it in /metrics (parsed by Prometheus' own parser).
    metrics = Metrics()
    metrics.refresh(system.stats())
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
        if s.name.startswith("motet_tenant")
    }
    assert samples[("motet_tenant_requests", (("state", "running"), ("tenant", "B")))] == 1
    assert samples[("motet_tenant_requests", (("state", "queued"), ("tenant", "A")))] == tenants["A"].queued
    assert samples[("motet_tenant_virtual_tokens", (("tenant", "A"),))] == tenants["A"].virtual_tokens
    positions = {dict(k[1])["tenant"]: v for k, v in samples.items() if k[0] == "motet_tenant_queue_position"}
    assert sorted(positions.values()) == [0, 1]

    # Every request completes, with what it asked for (A's preempted one recomputed).
    outputs = [
        d.token_ids + (await _drain(adm.streams[0]))[1]
        for d, adm in zip([*firsts, first], [*a[:2], b], strict=True)
    ]
    outputs += [(await _drain(adm.streams[0]))[1] for adm in a[2:]]
    assert len(outputs[2]) == 4
    llm = LLM(str(system.executor.engine.model_dir), num_kv_blocks=64)
    (expected,) = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, **fixed))
    assert all(tokens == expected.token_ids for tokens in outputs[:2] + outputs[3:])


async def test_n_choices_and_slow_reader_gets_merged_deltas(system):
    # Not speculating: one token per step, so one put per step (speculation would put several at once).
    spec = _spec("n", "The quick brown fox", n=2, max_tokens=12, ignore_eos=True, speculative=False)
    adm = await system.submit(spec)
    await anyio.sleep(0.5)  # a slow reader: several steps' deltas are waiting, merged
    for s in adm.streams:
        text, tokens, last = await _drain(s)
        assert len(tokens) == 12 and last.finished
    assert adm.streams[0].num_puts == 12


def _release(system, admissions):
    """What the API does when a client goes away: cancel the streams and abort the requests."""
    for adm in admissions:
        for s in adm.streams:
            s.cancel()
            system.abort(s.request_id)


@pytest.mark.parametrize(
    "system", [{"max_queue_len": 300, "max_num_seqs": 1, "max_waiting": 1}], indirect=True
)
async def test_cancelled_queued_requests_never_stall_the_next_one(system):
    """Hundreds of queued requests whose clients left: they leave the queue at once, and a new request
    is served promptly (before the fix, one cancelled entry was dropped per scheduler wake-up)."""
    running = await system.submit(_spec("run", "The quick", max_tokens=2, ignore_eos=True))
    gone = await system.submit(_spec("gone", "The quick brown fox", n=64, max_tokens=50, ignore_eos=True))
    gone2 = await system.submit(_spec("gone2", "Paris is", n=64, max_tokens=50, ignore_eos=True))
    _release(system, [gone, gone2])
    await _drain(running.streams[0])
    with anyio.fail_after(20):
        while system.stats().queued:
            await anyio.sleep(0.01)
        _, tokens, _ = await _drain((await system.submit(_spec("next", "Paris is", max_tokens=3))).streams[0])
    assert len(tokens) == 3
    assert system.stats().queued == 0 and not system.scheduler.live


@pytest.mark.parametrize(
    "system", [{"max_queue_len": 100, "max_num_seqs": 1, "max_waiting": 1}], indirect=True
)
async def test_a_submission_refused_part_way_leaves_nothing_queued(system):
    """A multi-prompt completion is queued whole or not at all: 5 prompts x 30 choices > 100 -> 429, 0 queued."""
    specs = [_spec(f"p{i}", [1, 2, 3], n=30, max_tokens=1) for i in range(5)]
    with pytest.raises(QueueFull):
        await system.submit_all(specs)
    assert system.stats().queued == 0
    (ok,) = await system.submit_all(specs[:1])
    for s in ok.streams:
        await _drain(s)


async def test_the_grammar_vocabulary_is_built_once_the_system_is_idle(tiny_model_dir, monkeypatch):
    """Issue 65: the grammar backends' vocabulary (seconds of a core on a large vocabulary, which the steps of the
    first requests would share the cores with: the first answer of a warm start took a second more) is not built
    while a request runs; once the system has been idle, it is."""
    import threading
    import time

    from motet.actors import ingress_actor
    from motet.grammar import backend

    builds, running = [], threading.Event()
    real_init, real_step = backend.GrammarTokenizer.__init__, LLMEngine.step

    def counted(self, *a, **kw):
        builds.append(running.is_set())
        real_init(self, *a, **kw)

    def slow_step(self, *a, **kw):  # (a request that runs for a second or more)
        time.sleep(0.02)
        return real_step(self, *a, **kw)

    monkeypatch.setattr(backend.GrammarTokenizer, "__init__", counted)
    monkeypatch.setattr(LLMEngine, "step", slow_step)
    s = ServingSystem(_engine_factory(tiny_model_dir))
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(s.run)
            running.set()
            _, tokens, _ = await _drain(
                (await s.submit(_spec("long", [5, 6], max_tokens=60, ignore_eos=True))).streams[0]
            )
            running.clear()
            assert len(tokens) == 60
            assert builds == []  # (none while it ran)
            while not builds:
                await anyio.sleep(ingress_actor.IDLE_POLL_S)
            assert builds == [False]
        await s.stop()


async def test_the_system_serves_before_the_grammar_vocabulary_is_built(tiny_model_dir, monkeypatch):
    """Issue 65: the grammar backends' view of the vocabulary (half a second or more on a real vocabulary) is built
    once the system serves, in a worker thread, never before it is ready: a plain request is answered while that
    build is held; a request with a grammar waits for the same build (one build, however many ask) and then
    matches its grammar."""
    import re
    import threading

    from motet.grammar import backend
    from motet.grammar.specs import RegexSpec

    release, builds = threading.Event(), []
    real_init = backend.GrammarTokenizer.__init__

    def held(self, *a, **kw):
        builds.append(threading.current_thread().name)
        assert release.wait(120)
        real_init(self, *a, **kw)

    monkeypatch.setattr(backend.GrammarTokenizer, "__init__", held)
    s = ServingSystem(_engine_factory(tiny_model_dir))
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(120):
            await tg.start(s.run)
            assert s.ready
            _, tokens, last = await _drain((await s.submit(_spec("plain", [5, 6, 7, 8]))).streams[0])
            assert len(tokens) == 8 and last.finish_reason == "length"
            while not builds:  # (the build under way, held)
                await anyio.sleep(0.01)
            answers = []

            async def shaped():
                admission = await s.submit(_spec("shaped", "Hi", max_tokens=16, grammar=RegexSpec("[ab]{3}")))
                answers.append(await _drain(admission.streams[0]))

            async with anyio.create_task_group() as waiting:
                waiting.start_soon(shaped)
                await anyio.sleep(0.5)
                assert answers == []  # (its grammar waits for the build held)
                release.set()
            [(text, _, last)] = answers
            assert re.fullmatch("[ab]{3}", text) and last.finish_reason == "stop"
            assert len(builds) == 1
        await s.stop()
