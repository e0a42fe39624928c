"""The LoRA slot cache: device stacks, LRU slots that never evict the step's adapters, the host LRU in front
of the disk, and the step's segments (checked against a per-row reference delta)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import motet.lora.slot_cache as slot_cache
from motet.engine.config import ModelConfig
from motet.lora.adapter import TARGET_MODULES, AdapterError, LoRAAdapter, load_adapter, module_shape
from motet.lora.slot_cache import MODULE_GROUPS, LoRASlotCache

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


def write_adapter(path, rank: int, modules, seed: int = 0, alpha: float = 8.0):
    """A PEFT-format adapter directory with random non-zero factors."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(BASE.num_hidden_layers):
        for m in modules:
            n_in, n_out = module_shape(BASE, m)
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if m[0] in 'qkvo' else 'mlp'}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g)
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules)}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture
def adapters(tmp_path):
    specs = {
        1: (4, ["q_proj", "v_proj"]),
        2: (8, list(TARGET_MODULES)),
        3: (2, ["down_proj"]),
        4: (8, ["o_proj"]),
    }
    return {i: write_adapter(tmp_path / f"a{i}", r, mods, seed=i) for i, (r, mods) in specs.items()}


def make(adapters, reads=None, **kw) -> LoRASlotCache:
    """A slot cache whose misses load adapter `uid` from `adapters[uid]` (as the manager's `load` does)."""

    def fetch(uid):
        if uid not in adapters:
            raise AdapterError(f"adapter id {uid} is not loaded")
        if reads is not None:
            reads.append(adapters[uid].name)
        adapter = load_adapter(adapters[uid], BASE, max_rank=8)
        cache.put(uid, adapter)
        return adapter

    cache = LoRASlotCache(BASE, fetch=fetch, **{"max_loras": 2, "max_cpu_loras": 4, "max_lora_rank": 8, **kw})
    return cache


def test_batch_delta_matches_per_row_reference(adapters):
    cache = make(adapters, max_loras=3)
    # rows: 3 of adapter 2, 2 base, 4 of adapter 1, 1 of adapter 2 again (a second segment of its slot)
    ids, counts = [2, 0, 1, 2], [3, 2, 4, 1]
    lora = cache.batch(ids, counts)
    assert lora.seg_starts.tolist() == [0, 3, 5, 9, 10] and lora.max_seg_len == 4
    slot = cache.resident
    assert lora.seg_slots.tolist() == [slot[2], -1, slot[1], slot[2]]
    row_ids = [a for a, n in zip(ids, counts, strict=True) for _ in range(n)]
    for modules in MODULE_GROUPS:  # q/k/v (adapter 1 targets q and v only), o, gate/up, down
        n_in = module_shape(BASE, modules[0])[0]
        sizes = [module_shape(BASE, m)[1] for m in modules]
        x = torch.randn(len(row_ids), n_in)
        for layer in range(BASE.num_hidden_layers):
            y = torch.randn(len(row_ids), sum(sizes))
            expected = y.clone()
            lora.add(y, x, layer, modules, sizes)
            col = 0
            for m, size in zip(modules, sizes, strict=True):
                for row, a in enumerate(row_ids):
                    w = cache.get_cpu(a).weights.get((layer, m)) if a else None
                    if w is not None:
                        A, B, scale = w
                        expected[row, col : col + size] += (x[row] @ A.t() @ B.t()) * scale
                col += size
            torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


def test_group_stacks_hold_each_module_at_its_rank_major_rows_and_output_columns(adapters):
    """The layout the kernels read: a group's A rows j * n + m are module m's rank j, its B columns the module's
    columns of the fused output; each module's stacks are views of them."""
    cache = make(adapters)
    slot = cache.activate([2])[2]  # rank 8, every module
    adapter = cache.get_cpu(2)
    for layer in range(BASE.num_hidden_layers):
        for modules, group in cache.stacks[layer].groups.items():
            n, col = len(modules), 0
            for m, name in enumerate(modules):
                a, b, scale = adapter.weights[(layer, name)]
                size = b.shape[0]
                torch.testing.assert_close(group.A[slot].view(8, n, -1)[:, m], a)
                torch.testing.assert_close(group.B[slot, col : col + size], b)
                assert group.scales[m, slot] == scale
                A, B, scales = cache.stacks[layer][name]
                assert A.data_ptr() == group.A[:, m].data_ptr() and B.data_ptr() == group.B[:, col].data_ptr()
                assert scales.data_ptr() == group.scales[m].data_ptr()
                col += size


def test_batch_views_cover_only_targeted_modules_cut_to_the_batch_rank(adapters):
    cache = make(adapters)
    lora = cache.batch([1, 1], [2, 1])
    assert lora.seg_slots.tolist() == [cache.resident[1]] and lora.seg_starts.tolist() == [0, 3]
    assert set(lora.weights[0]) == {"q_proj", "v_proj"}
    A, B, scales = lora.weights[0]["q_proj"]
    assert A.shape[1] == 4 and B.shape[2] == 4 and scales.shape == (2,)
    # one group (q/k/v), k inactive: its expand is skipped; the shrink covers the group's rows of rank 4
    qkv = ("q_proj", "k_proj", "v_proj")
    assert list(lora.weights[0].groups) == [qkv] and lora.weights[0].groups[qkv].active == (True, False, True)
    assert lora.weights[0].groups[qkv].A.shape[1] == 3 * 4
    lora = cache.batch([3, 2], [1, 1])
    assert set(lora.weights[1]) == set(TARGET_MODULES) and lora.weights[1]["q_proj"][0].shape[1] == 8
    assert list(lora.weights[1].groups) == list(MODULE_GROUPS)
    assert sorted(m for g in MODULE_GROUPS for m in g) == sorted(TARGET_MODULES)
    # a module alone that belongs to a group is refused (its delta would otherwise be silently missing)
    lora = cache.batch([1], [1])
    with pytest.raises(ValueError, match="not a module group"):
        lora.add(torch.zeros(1, 32), torch.zeros(1, 32), 0, ("q_proj",), (32,))


def test_lru_never_evicts_the_steps_adapters(adapters):
    cache = make(adapters)
    cache.activate([1])
    cache.activate([2])
    cache.activate([1])  # 2 is now least recently used
    slots = cache.activate([3])
    assert set(cache.resident) == {1, 3} and slots[3] != cache.resident[1]
    cache.activate([3, 2])  # 1 is the LRU outside the step: evicted, not 3
    assert set(cache.resident) == {3, 2} and cache.num_loads == 4
    cache.activate([2, 3])
    assert cache.num_loads == 4  # resident: no copies
    with pytest.raises(ValueError, match="max_loras=2"):
        cache.activate([1, 2, 3])


def test_reused_slot_holds_only_the_new_adapter(adapters):
    cache = make(adapters, max_loras=1)
    cache.activate([2])  # rank 8, every module
    cache.activate([1])  # rank 4, q and v only, into the same slot
    for layer in cache.stacks:
        for m, (A, B, scales) in layer.items():
            if m in ("q_proj", "v_proj"):
                assert A[0, 4:].abs().sum() == 0 and B[0, :, 4:].abs().sum() == 0 and scales[0] == 2.0
            else:
                assert A[0].abs().sum() == 0 and B[0].abs().sum() == 0 and scales[0] == 0


def test_host_cache_is_an_lru_in_front_of_the_disk(adapters):
    reads = []
    cache = make(adapters, reads, max_cpu_loras=2)
    for i in (1, 2, 1, 3, 1, 2):
        cache.get_cpu(i)
    assert reads == ["a1", "a2", "a3", "a2"]  # 2 was the LRU when 3 came in
    preloaded = LoRAAdapter("x", 1, {})
    cache.put(9, preloaded)
    assert cache.get_cpu(9) is preloaded and len(reads) == 4


def test_unregister_frees_the_slot_and_the_host_copy(adapters):
    cache = make(adapters)
    cache.activate([1, 2])
    cache.unregister(1)
    assert set(cache.resident) == {2} and 1 not in cache.cpu
    del adapters[1]  # as the manager forgets a removed adapter
    with pytest.raises(AdapterError, match="not loaded"):
        cache.activate([1])
    cache.activate([3, 2])  # 3 takes the freed slot without evicting 2
    assert set(cache.resident) == {2, 3}


def test_triton_kernels_take_a_groups_fused_output_and_rank_cut_views(adapters, monkeypatch):
    """What the GPU path sees: y is the fused output, A/B are rank-cut views of a group's stacks, some of its
    modules inactive (k: no adapter of the batch targets it); one shrink and one expand per group (run under
    TRITON_INTERPRET=1 without CUDA)."""
    pytest.importorskip("triton")
    import importlib
    import os
    import sys

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    from motet.kernels import sgmv

    if not torch.cuda.is_available() and type(sgmv._shrink_kernel).__name__ != "InterpretedFunction":
        sgmv = importlib.reload(sys.modules["motet.kernels.sgmv"])  # imported before the interpreter was set

    launches = []

    def triton_add_lora(*args, **kw):  # add_lora's GPU path, counted
        launches.append(("shrink", "expand"))
        sgmv.add_lora_triton(*args, **kw)

    device = "cuda" if torch.cuda.is_available() else "cpu"  # natively on a GPU, interpreted elsewhere
    cache = make(adapters, device=device)
    lora = cache.batch([1, 0, 3], [3, 2, 2])  # ranks 4 and 2: views cut to rank 4 of the 8 stored
    qkv = [module_shape(BASE, m)[1] for m in ("q_proj", "k_proj", "v_proj")]
    cases = [  # (layer, modules, sizes, x): a fused output's column slices, and a plain one
        (0, ("q_proj", "k_proj", "v_proj"), qkv, torch.randn(7, BASE.hidden_size, device=device)),
        (1, ("down_proj",), [BASE.hidden_size], torch.randn(7, BASE.intermediate_size, device=device)),
    ]
    for layer, modules, sizes, x in cases:
        y = torch.randn(7, sum(sizes), device=device)
        ref, got = y.clone(), y.clone()
        lora.add(ref, x, layer, modules, sizes)
        launches.clear()
        with monkeypatch.context() as m:
            m.setattr(slot_cache, "add_lora", triton_add_lora)
            lora.add(got, x, layer, modules, sizes)
        assert launches == [("shrink", "expand")]  # one of each for the whole group (q/k/v: not three)
        assert not torch.allclose(ref, y)  # the adapters did something
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_pinned_host_copies_outlive_their_files(tmp_path):
    import shutil

    paths = {i: write_adapter(tmp_path / f"a{i}", rank=4, modules=("q_proj",), seed=i) for i in (1, 2, 3)}
    cache = make(paths, max_loras=2, max_cpu_loras=1)
    cache.get_cpu(1)
    cache.pin(1)
    shutil.rmtree(paths[1])
    cache.get_cpu(2), cache.get_cpu(3)  # would evict 1 without the pin
    assert 1 in cache.cpu and cache.get_cpu(1).rank == 4
    cache.unpin(1)
    assert list(cache.cpu) == [1]  # back to the size limit, least recently used out
    cache.get_cpu(2)
    with pytest.raises(AdapterError):
        cache.get_cpu(1)  # its files are gone
