"""Virtual token counters (motet/engine/fairness.py): pure policy, no threads."""

from __future__ import annotations

from motet.engine.fairness import VirtualTokenCounter


def test_pick_lowest_counter_ties_to_first():
    vtc = VirtualTokenCounter()
    for t in "abc":
        vtc.arrive(t)
    vtc.charge("a", input_tokens=10)
    vtc.charge("b", output_tokens=1)  # 2 with the default weights
    assert vtc.pick(["a", "b", "c"]) == "c"
    vtc.charge("c", input_tokens=5)
    assert vtc.pick(["a", "b", "c"]) == "b"
    assert vtc.pick([]) is None


def test_weights():
    vtc = VirtualTokenCounter(input_weight=1, output_weight=3)
    vtc.charge("a", input_tokens=4, output_tokens=2)
    assert vtc.counter("a") == 10


def test_new_tenant_is_lifted_to_min_active():
    vtc = VirtualTokenCounter()
    vtc.arrive("a")
    vtc.arrive("b")
    vtc.charge("a", input_tokens=100)
    vtc.charge("b", input_tokens=40)
    vtc.arrive("c")  # new: no credit banked for the time it was away
    assert vtc.counter("c") == 40
    vtc.arrive("a")  # already active: unchanged
    assert vtc.counter("a") == 100


def test_idle_tenant_banks_no_credit():
    vtc = VirtualTokenCounter()
    vtc.arrive("a")
    vtc.arrive("b")
    vtc.charge("a", input_tokens=10)
    vtc.charge("b", input_tokens=500)
    vtc.leave("a")  # a goes idle at 10 while b keeps receiving service
    vtc.charge("b", output_tokens=100)
    vtc.arrive("a")
    assert vtc.counter("a") == vtc.counter("b") == 700


def test_when_nobody_is_active_newcomer_starts_at_last_leaver():
    vtc = VirtualTokenCounter()
    vtc.arrive("a")
    vtc.charge("a", input_tokens=1000)
    vtc.leave("a")
    vtc.arrive("b")
    assert vtc.counter("b") == 1000
    vtc.arrive("a")  # equal footing now
    assert vtc.counter("a") == 1000


def test_backlogged_heavy_tenant_does_not_starve_light_one():
    """A floods 20 requests, B sends 4 later; admissions interleave once B arrives."""
    vtc = VirtualTokenCounter()
    queues = {"a": 20, "b": 0}
    for _ in range(20):
        vtc.arrive("a")
    order = []
    for step in range(24):
        if step == 4:
            for _ in range(4):
                vtc.arrive("b")
            queues["b"] = 4
        tenant = vtc.pick([t for t, n in queues.items() if n])
        queues[tenant] -= 1
        order.append(tenant)
        vtc.charge(tenant, input_tokens=10, output_tokens=10)
    # B's 4 requests are all admitted within the 8 admissions after it arrived, not after A's 16 left.
    assert order[4:12].count("b") == 4
    assert order[:4] == ["a"] * 4
