"""vLLM's request `priority` (lower: sooner) beside the per-tenant fairness: it orders a tenant's own requests
(in the adapter queues, the engine's waiting list, its preemptions) and never moves one tenant before another.
The reference is the scheduler without priorities: with any priorities, the tenants are served in the
order they were without them, and each tenant's requests in order of priority.
"""

from __future__ import annotations

import anyio
import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motet.actors.adapter_queues import AdapterQueuesActor
from motet.actors.messages import Enqueue, QueuedRequest, Take
from motet.actors.reply import ReplyStream
from motet.actors.system import ServingSystem
from motet.engine.core.sequence import QueueOrder, Sequence
from motet.engine.llm import LLM
from motet.engine.request import EngineRequest
from motet.engine.sampling_params import SamplingParams
from tests.actors.test_actors import _engine_factory, _spec
from tests.engine.test_fairness import make, run_step
from tests.live_server import ThreadServer


def started_in_order(requests, max_seqs=1, num_blocks=256, budget=64):
    """(tenant, priority, output tokens) added in this order to the engine's scheduler; the order in which
    they start running."""
    sched = make(num_blocks=num_blocks, max_seqs=max_seqs, budget=budget)
    seqs = []
    for i, (tenant, priority, max_tokens) in enumerate(requests):
        first = 1000 * (ord(tenant) - ord("a")) + 10 * i
        s = Sequence(
            list(range(first, first + 6)), SamplingParams(max_tokens=max_tokens), order=QueueOrder(i)
        )
        s.tenant, s.order.priority = tenant, priority
        seqs.append(s)
        sched.add(s)
    order = []
    for _ in range(5000):
        if not sched.has_work():
            break
        batch = run_step(sched)
        for s in batch.seqs:  # in the order the step took them
            i = next(j for j, x in enumerate(seqs) if x is s)
            if i not in order:
                order.append(i)
    assert not sched.has_work() and sorted(order) == list(range(len(seqs)))
    return order


def test_one_tenants_requests_start_by_priority():
    requests = [("a", p, 3) for p in (0, 5, -1, 5, 2, -1)]
    order = started_in_order(requests)
    assert order == sorted(range(6), key=lambda i: (requests[i][1], i)) == [2, 5, 0, 4, 1, 3]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.integers(-3, 3)), min_size=1, max_size=16),
    st.integers(1, 3),
    st.integers(1, 5),
)
def test_priorities_reorder_a_tenants_requests_only(requests, max_seqs, max_tokens):
    """Requests of one size (fairness counts tokens: a tenant that runs a longer request first is charged more
    sooner, whatever its reason), so the reference is exact: the tenants' turns are those without priorities."""
    plain = started_in_order([(t, 0, max_tokens) for t, _ in requests], max_seqs=max_seqs)
    ranked = started_in_order([(t, p, max_tokens) for t, p in requests], max_seqs=max_seqs)
    assert [requests[i][0] for i in ranked] == [requests[i][0] for i in plain]
    if max_seqs == 1:  # one at a time: each tenant's requests start most urgent first
        for tenant in "abc":
            mine = [i for i in ranked if requests[i][0] == tenant]
            assert mine == sorted(mine, key=lambda i: (requests[i][1], i))


def test_a_tenant_loses_its_least_urgent_request_to_preemption():
    sched = make(max_seqs=4)
    backlog = []
    for i, priority in enumerate((0, 3, -2, 1, 2, -1)):
        s = Sequence(list(range(10 * i, 10 * i + 6)), SamplingParams(max_tokens=100), order=QueueOrder(i))
        s.tenant, s.order.priority = "a", priority
        backlog.append(s)
        sched.add(s)
    for _ in range(3):
        run_step(sched)
    assert {backlog.index(s) for s in sched.running} == {2, 5, 0, 3}  # the 4 most urgent
    light = Sequence(list(range(5000, 5006)), SamplingParams(max_tokens=4), order=QueueOrder(99))
    light.tenant = "b"
    sched.add(light)
    batch = run_step(sched)
    (victim,) = batch.preempted
    assert victim is backlog[3]  # a's least urgent running one (priority 1), not its newest (5)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def queued(rid, tenant, priority, adapter=0):
    request = EngineRequest(rid, [1, 2, 3], SamplingParams(), adapter, tenant=tenant, priority=priority)
    return QueuedRequest(request, ReplyStream(rid))


@pytest.mark.anyio
async def test_adapter_queues_hand_out_a_tenants_most_urgent_request_first():
    q = AdapterQueuesActor(max_queue_len=16)
    async with anyio.create_task_group() as tg:
        await tg.start(q._run)
        await q.ask(Enqueue([queued("a1", "a", 0), queued("a2", "a", 5)]))
        await q.ask(Enqueue([queued("b1", "b", 9)]))
        await q.ask(Enqueue([queued("a3", "a", -1), queued("a4", "a", 0)]))
        await q.ask(Enqueue([queued("a5", "a", -7, adapter=7)]))  # another adapter's queue
        order = iter(["b", "a", "a", "a", "a", "a", None])  # the policy's turns between tenants
        taken = await q.ask(Take(lambda tenants: next(order)))
        assert [r.request.request_id for r in taken.requests] == ["b1", "a5", "a3", "a1", "a4", "a2"]
        q.close()


def test_the_engine_runs_a_tenants_requests_by_priority(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128, max_num_seqs=1, speculative="off")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = [
        engine.add_request([5 + i] * 4, params, tenant="t", priority=p) for i, p in enumerate((2, 0, -4, 0))
    ]
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [ids[2], ids[1], ids[3], ids[0]]


@pytest.mark.anyio
async def test_priority_reaches_the_engine_through_the_serving_system(tiny_model_dir):
    system = ServingSystem(_engine_factory(tiny_model_dir))
    async with anyio.create_task_group() as tg:
        await tg.start(system.run)
        spec = _spec("p", "The quick", max_tokens=50, ignore_eos=True, speculative=False)
        spec.priority = -3
        adm = await system.submit(spec)
        await adm.streams[0].get()  # running
        (seq,) = [s for s in system.executor.engine.requests.values() if s.request_id == "p-0"]
        assert seq.order.priority == -3
        system.abort("p-0")
        await system.stop()


def test_the_api_takes_vllms_priority(tiny_model_dir, tmp_path):
    srv = ThreadServer(
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--data-dir", str(tmp_path)
    )
    try:
        url = f"{srv.url}/v1"
        for path, body in (("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                           ("completions", {"prompt": "hi"})):  # fmt: skip
            body = {"model": "tiny", "max_tokens": 2, **body}
            assert httpx.post(f"{url}/{path}", json={**body, "priority": -5}, timeout=60).status_code == 200
            for bad in (2**63, "1", 1.5):
                r = httpx.post(f"{url}/{path}", json={**body, "priority": bad}, timeout=60)
                assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    finally:
        srv.stop()
