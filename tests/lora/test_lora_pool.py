"""The adapters' pool and the manager's tiers: packing at each adapter's own rank and targets, placement within a
byte bound that never evicts an adapter in use, the host cache in front of the disk, loads in the background,
and the step's segments (their deltas checked against a per-row reference from the adapters' own factors)."""

from __future__ import annotations

import shutil
import time

import pytest
import torch

from motet.evals.lora_reference import write_random_adapter
from motet.kernels import cpu_native
from motet.lora.adapter import TARGET_MODULES, AdapterError, load_adapter, module_shape
from motet.lora.host_cache import HostCache, HostEntry
from motet.lora.manager import AdapterManager, AdapterRef
from motet.lora.pool import MODULE_GROUPS, AdapterPool, PoolLayout, desc_columns, pack
from motet.models.config import ModelConfig
from motet.models.projections import PROJECTION_GROUPS

BASE = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
)
LAYOUT = PoolLayout(BASE)


def write_adapter(path, rank: int, modules, seed: int = 0, alpha: float = 8.0):
    """A PEFT-format adapter directory with random factors of unit scale (large deltas: the checks see them)."""
    return write_random_adapter(path, BASE, rank, seed, modules=modules, alpha=alpha, a_std=1.0, b_std=1.0)


SPECS = {
    1: (4, ["q_proj", "v_proj"]),
    2: (8, list(TARGET_MODULES)),
    3: (2, ["down_proj"]),
    4: (8, ["o_proj"]),
}


@pytest.fixture
def adapters(tmp_path):
    return {i: write_adapter(tmp_path / f"a{i}", r, mods, seed=i) for i, (r, mods) in SPECS.items()}


def packed(path, dtype=torch.float32):
    return pack(load_adapter(path, BASE, max_rank=8), LAYOUT, dtype)


def never(uid: int) -> bool:
    return False


def always(uid: int) -> bool:
    return True


# -- packing -------------------------------------------------------------------------------------------------
def test_pack_holds_each_targeted_module_at_its_own_rank_with_the_scale_folded_into_bt(adapters):
    adapter = load_adapter(adapters[1], BASE, max_rank=8)  # rank 4, q and v of the q/k/v group
    p = pack(adapter, LAYOUT, torch.float32)
    assert p.rank == 4 and [g is not None for g in p.groups] == [True] + [False] * (len(MODULE_GROUPS) - 1)
    offset, stride, mask = p.groups[0]
    assert mask == 0b101  # q and v, not k
    geo = LAYOUT.groups[0]
    for layer in range(BASE.num_hidden_layers):
        base = offset + layer * stride
        A = p.data[base : base + 2 * 4 * geo.a_ld].view(8, geo.a_ld)
        for pos, m in enumerate(("q_proj", "v_proj")):
            a, b, scale = adapter.weights[(layer, m)]
            assert torch.equal(A[pos * 4 : pos * 4 + 4], a)
            at = base + 8 * geo.a_ld + (4 * geo.bt_ld[0] if m == "v_proj" else 0)
            bt = p.data[at : at + 4 * geo.bt_ld[MODULE_GROUPS[0].index(m)]].view(4, -1)
            torch.testing.assert_close(bt, (b * scale).t())
    # exactly its own modules at its own rank: no padding to a common rank or group
    assert p.data.numel() == LAYOUT.adapter_elements(4, ["q_proj", "v_proj"])
    assert p.data.numel() < LAYOUT.adapter_elements(8, ["q_proj", "k_proj", "v_proj"]) / 2


def test_desc_row_places_every_group_at_the_region(adapters):
    p = packed(adapters[2])
    row = p.desc_row(1024)
    assert row[0] == 8
    for g, group in enumerate(p.groups):
        if MODULE_GROUPS[g] not in PROJECTION_GROUPS:  # the embedding, the head, latent attention's: not here
            assert group is None and row[desc_columns(g)[0]] == -1
            continue
        offset, stride, mask = group
        assert row[desc_columns(g)[0]] == 1024 + offset and row[desc_columns(g)[1]] == stride
        assert row[desc_columns(g)[2]] == mask == (1 << len(MODULE_GROUPS[g])) - 1


# -- placement ------------------------------------------------------------------------------------------------
def test_placement_stays_within_the_bound_and_evicts_least_recently_used_first(adapters):
    one = packed(adapters[1])
    pool = AdapterPool(LAYOUT, 3 * one.nbytes)  # room for three of the same size
    for uid in (1, 2, 3):
        assert pool.place(uid, one, never) is not None
    assert pool.place(4, one, never) is None  # nothing may go: no room
    pool.touch([1])  # 2 is now the least recently used
    assert pool.place(4, one, always) is not None
    assert set(pool.slot_of) == {1, 3, 4} and pool.used_bytes <= pool.capacity_bytes
    assert pool.place(5, one, lambda u: u != 3) is not None  # 3 in use: 1 goes (least recent of the others)
    assert set(pool.slot_of) == {3, 4, 5} and pool.num_evicted == 2
    assert pool.place(4, one, never) == pool.slot_of[4]  # resident: no copy
    assert pool.num_placed == 5


def test_placement_evicts_until_a_contiguous_range_is_free(adapters):
    small, big = packed(adapters[3]), packed(adapters[2])
    pool = AdapterPool(LAYOUT, big.nbytes + 2 * small.nbytes)
    for uid in (1, 2, 3):
        pool.place(uid, small, never)
    pool.evict(2)  # a hole between 1 and 3, too small for `big`
    assert pool.place(9, big, lambda u: u == 2) is None  # 1 and 3 may not go
    assert pool.place(9, big, lambda u: u == 3) is not None  # 3 goes: the hole and the tail join
    region = pool.region_of[9]
    assert region.start + region.size <= pool.capacity and pool.used_bytes <= pool.capacity_bytes
    assert set(pool.slot_of) == {1, 9}


def test_an_adapter_larger_than_the_pool_never_fits(adapters):
    big = packed(adapters[2])
    pool = AdapterPool(LAYOUT, big.nbytes // 2)
    assert not pool.fits(big) and pool.place(1, big, always) is None


def test_a_reused_slot_and_range_hold_only_the_new_adapter(adapters):
    """Placed where an evicted adapter of more modules and a higher rank was: the new one's deltas only."""
    pool = AdapterPool(LAYOUT, packed(adapters[2]).nbytes + 256)
    pool.place(2, packed(adapters[2]), never)
    pool.place(1, packed(adapters[1]), always)  # evicts 2
    assert list(pool.slot_of) == [1]
    check_deltas(pool, {1: adapters[1]}, [1, 1, 0], [2, 1, 3])


# -- the step's deltas ------------------------------------------------------------------------------------------
def reference_delta(paths, uid_of_row, x, layer, modules, dtype=torch.float32, bf16_activations=False):
    """Per row, in float64, from the adapters' own factors as the pool stores them (A and B * scale rounded to
    `dtype`): B @ A @ x * scale for each module of the group. `bf16_activations`: of x and the shrink's h rounded
    to bf16 (the native bf16 tier's products), and with the slack of one bf16 rounding step of h (|B| |h| 2^-8),
    which fp32 sums may cross where float64's do not."""
    sizes = [module_shape(BASE, m)[1] for m in modules]
    out = torch.zeros(x.shape[0], sum(sizes), dtype=torch.float64)
    slack = torch.zeros_like(out)
    if bf16_activations:
        x = x.bfloat16().float()
    loaded = {uid: load_adapter(p, BASE, max_rank=8) for uid, p in paths.items()}
    for t, uid in enumerate(uid_of_row):
        col = 0
        for m, size in zip(modules, sizes, strict=True):
            if uid and (layer, m) in loaded[uid].weights:
                a, b, scale = loaded[uid].weights[(layer, m)]
                a, bs = a.to(dtype).double(), (b * scale).to(dtype).double()
                h = a @ x[t].double()
                if bf16_activations:
                    slack[t, col : col + size] = bs.abs() @ h.abs() * 2**-8
                    h = h.bfloat16().double()
                out[t, col : col + size] = bs @ h
            col += size
    return (out, slack) if bf16_activations else out


def check_deltas(pool, paths, uids, counts, dtype=torch.float32):
    """The manager's segments over `pool` for rows of `uids` (`counts` each) add the reference deltas, through
    the torch path and the native kernel."""
    from motet.lora.pool import LoRABatch

    rows = [u for u, n in zip(uids, counts, strict=True) for _ in range(n)]
    starts, slots = [0], []
    for u, n in zip(uids, counts, strict=True):
        starts.append(starts[-1] + n)
        slots.append(pool.slot_of[u] if u else -1)
    lora = LoRABatch(
        torch.tensor(starts, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32), max(counts),
        pool.view(u for u in set(uids) if u),
    )  # fmt: skip
    g = torch.Generator().manual_seed(7)
    tol = dict(atol=1e-4, rtol=1e-4)  # fp32 sums of the stored weights' products
    for layer in range(BASE.num_hidden_layers):
        for gi, modules in enumerate(PROJECTION_GROUPS):  # (a latent attention's: not this base's)
            n_in = module_shape(BASE, modules[0])[0]
            sizes = [module_shape(BASE, m)[1] for m in modules]
            x = torch.randn(len(rows), n_in, generator=g)
            want = reference_delta(paths, rows, x, layer, modules, dtype)
            y = torch.zeros(len(rows), sum(sizes))
            lora.add(y, x, layer, modules, sizes)
            torch.testing.assert_close(y.double(), want, **tol)
            if cpu_native.library() is not None:
                geo = [grp.a_ld for grp in pool.layout.groups], [grp.bt_ld for grp in pool.layout.groups]
                native = torch.zeros_like(y)
                desc = cpu_native.LoraPool.of(pool.data, pool.desc, *geo)
                cpu_native.sgmv(native, x, desc, pool.dtype, lora.seg_starts, lora.seg_slots, group=gi,
                                layer=layer, sizes=sizes)  # fmt: skip
                if dtype == torch.bfloat16 and cpu_native.bf16_activations():  # x and h rounded to bf16
                    want, slack = reference_delta(
                        paths, rows, x, layer, modules, dtype, bf16_activations=True
                    )
                    assert ((native.double() - want).abs() <= slack + 1e-4 + 1e-4 * want.abs()).all()
                else:
                    torch.testing.assert_close(native.double(), want, **tol)
            base_rows = [t for t, u in enumerate(rows) if not u]
            assert not y[base_rows].any()  # rows without an adapter: untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_adapters_add_their_own_deltas(adapters, dtype):
    pool = AdapterPool(LAYOUT, 1 << 20, dtype=dtype)
    for uid, path in adapters.items():
        pool.place(uid, packed(path, dtype), never)
    # rows: 3 of adapter 2, 2 base, 4 of adapter 1, 1 of adapter 3, 2 of adapter 4, 1 of adapter 2 again
    check_deltas(pool, adapters, [2, 0, 1, 3, 4, 2], [3, 2, 4, 1, 2, 1], dtype)


# -- the host cache ---------------------------------------------------------------------------------------------
def entry(nbytes: int) -> HostEntry:
    from motet.lora.pool import PackedAdapter

    return HostEntry(PackedAdapter(torch.zeros(nbytes // 4), 1, ()), None)


def test_host_cache_is_bounded_by_bytes_and_pins_hold():
    cache = HostCache(max_bytes=3000)
    for uid in (1, 2, 3):
        cache.put(uid, entry(1000))
    cache.get(1)  # 2 is now least recently used
    cache.pin(2)
    cache.put(4, entry(1000))  # over the bound: 3 goes (2 is pinned)
    assert set(cache.entries) == {1, 2, 4} and cache.nbytes == 3000
    cache.put(5, entry(2500))  # only pinned 2 and the new one may stay
    assert set(cache.entries) == {2, 5} and cache.nbytes == 3500  # over the bound by the pinned one
    cache.unpin(2)
    assert set(cache.entries) == {5}
    counted = HostCache(max_bytes=10**9, max_entries=2)
    for uid in (1, 2, 3):
        counted.put(uid, entry(100))
    assert set(counted.entries) == {2, 3}


# -- the manager ------------------------------------------------------------------------------------------------
def manager(memory_bytes=1 << 20, host_bytes=1 << 20, **kw) -> AdapterManager:
    return AdapterManager(BASE, memory_bytes=memory_bytes, host_bytes=host_bytes, max_lora_rank=8, **kw)


def settle(m: AdapterManager, uids, in_use=frozenset(), timeout=10.0) -> None:
    """Prefetch until every one of `uids` is resident (the loader thread reads the disk meanwhile)."""
    deadline = time.monotonic() + timeout
    while not all(m.ready(u) for u in uids):
        assert time.monotonic() < deadline, "adapters never became resident"
        m.prefetch(uids, set(in_use))
        m.wait_for_load(0.05)


def test_a_request_never_waits_on_the_disk_its_adapter_loads_in_the_background(adapters):
    m = manager()
    refs = {i: AdapterRef.of(f"t/a{i}", p) for i, p in adapters.items()}
    uid = m.acquire(refs[1])  # neither resident nor host-cached: returns at once, the loader reads it
    assert not m.ready(uid) and m.stats().misses == 1
    settle(m, [uid])
    assert m.ready(uid) and m.stats().disk_loads == 1 and m.stats().placements == 1
    assert m.acquire(refs[1]) == uid and m.stats().hits == 1
    lora = m.batch([uid, 0, uid], [2, 1, 3])
    assert lora.seg_starts.tolist() == [0, 2, 3, 6] and lora.seg_slots.tolist()[1] == -1
    assert lora.max_seg_len == 3
    m.close()


def test_the_serving_layers_load_fills_the_host_cache_so_the_engine_only_copies(adapters):
    m = manager(background=False)
    ref = AdapterRef.of("t/a2", adapters[2])
    m.load(ref)  # the ingress, off its event loop
    uid = m.acquire(ref)
    m.prefetch([uid], set())
    assert m.ready(uid) and m.stats().disk_loads == 1


def test_a_full_pool_evicts_idle_adapters_then_waiting_ones_later_in_line_never_running_ones(adapters):
    one = packed(adapters[1]).nbytes
    m = manager(memory_bytes=2 * one, background=False)
    paths = {
        i: write_adapter(adapters[1].parent / f"q{i}", 4, ["q_proj", "v_proj"], seed=10 + i) for i in range(4)
    }
    refs = [AdapterRef.of(f"t/q{i}", p) for i, p in paths.items()]
    u = [m.acquire(r) for r in refs]
    m.prefetch(u[:2], in_use=set())
    assert m.ready(u[0]) and m.ready(u[1])
    m.prefetch([u[2]], in_use={u[0], u[1]})  # both running: no room
    assert not m.ready(u[2]) and m.blocked == {u[2]}
    m.release(u[1])  # u1's only request is gone: idle
    m.prefetch([u[2]], in_use={u[0]})
    assert m.ready(u[2]) and not m.ready(u[1]) and m.blocked == set()
    # u3 comes before u2 in the admission order and u2 is only waiting: u2 makes room
    m.prefetch([u[3], u[2]], in_use={u[0]})
    assert m.ready(u[3]) and not m.ready(u[2]) and m.ready(u[0])
    assert m.pool.used_bytes <= m.pool.capacity_bytes


def test_pinned_host_copies_outlive_their_files(tmp_path):
    paths = {i: write_adapter(tmp_path / f"a{i}", rank=4, modules=("q_proj",), seed=i) for i in (1, 2, 3)}
    refs = {i: AdapterRef.of(f"t/a{i}", p) for i, p in paths.items()}
    m = manager(background=False, max_cpu_loras=1, memory_bytes=2 * packed(paths[1]).nbytes)
    uid = m.acquire(refs[1])  # pinned while the request is unfinished
    shutil.rmtree(paths[1])
    for i in (2, 3):  # would push 1 out of the host cache (one entry) without the pin
        m.load(refs[i])
    assert uid in m.host
    m.prefetch([m.acquire(refs[2]), m.acquire(refs[3])], set())  # the pool fills with others
    m.prefetch([uid], {refs[2].uid, refs[3].uid})
    m.release(refs[2].uid)
    m.prefetch([uid], {refs[3].uid})
    assert m.ready(uid)  # from its pinned host copy: its files are gone


def test_a_load_that_fails_in_the_background_is_reported_once_per_adapter(adapters):
    m = manager()
    ref = AdapterRef.of("t/a4", adapters[4])
    shutil.rmtree(adapters[4])  # deleted after the request resolved it
    uid = m.acquire(ref)
    deadline = time.monotonic() + 10
    while not m.failures():
        assert time.monotonic() < deadline
        m.wait_for_load(0.05)
    assert "deleted or replaced" in m.failures()[uid]
    with pytest.raises(AdapterError, match="deleted or replaced"):
        m.acquire(ref)  # a new request for the same broken version is refused at once
    m.release(uid)
    assert not m.failures() and uid not in m.failed  # nobody waits for it: the next request tries again
    m.close()


def test_a_removed_version_is_the_first_to_leave_the_pool(adapters):
    m = manager(background=False)
    refs = [m.register(f"a{i}", adapters[i]) for i in (1, 3)]
    uids = [m.acquire(r) for r in refs]
    m.prefetch(uids, set())
    for u in uids:
        m.release(u)
    m.pool.touch([uids[1]])
    m.remove("a3")  # the more recently used one
    assert next(iter(m.pool.lru)) == uids[1] and uids[1] not in m.host and uids[1] not in m.known


def test_an_adapter_larger_than_the_whole_pool_is_refused_naming_the_memory(adapters):
    m = manager(memory_bytes=packed(adapters[1]).nbytes, background=False)
    with pytest.raises(AdapterError, match="more than the server's whole adapter memory"):
        m.load(AdapterRef.of("t/a2", adapters[2]))


def test_a_mirrored_placement_writes_the_same_slot_and_range(adapters):
    """Another rank's pool takes the driver's placements as they are (AdapterPool.put_at)."""
    driver, worker = AdapterPool(LAYOUT, 1 << 20), AdapterPool(LAYOUT, 1 << 20)
    for uid in (1, 2):
        slot = driver.place(uid, packed(adapters[uid]), never)
        worker.put_at(slot, driver.region_of[uid].start, uid, packed(adapters[uid]))
    driver.evict(1)
    slot = driver.place(3, packed(adapters[3]), never)  # reuses 1's slot and range
    worker.put_at(slot, driver.region_of[3].start, 3, packed(adapters[3]))
    assert worker.rows[slot] == driver.rows[slot] and set(worker.slot_of) == {2, 3}
    assert torch.equal(worker.desc, driver.desc)
