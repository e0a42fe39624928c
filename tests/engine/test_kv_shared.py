"""The KV tier shared by replicas (motet/engine/core/kv_shared.py): two engines on one directory (two replicas), the
second serving the first's prefix from it with PEFT's greedy output; a damaged shared entry dropped for every
reader and recomputed; a salted tenant never reading another's; `wait_saved` as the prefill-to-decode hand-off
(every full block of a finished prompt is in the store when it returns); and an fsspec URL as the store."""

from __future__ import annotations

import pytest

from motet.engine.core.block_manager import chain_block_hashes, prefix_salt
from motet.engine.core.kv_shared import SharedTier
from motet.engine.core.kv_tiers import encode_entry, entry_name
from motet.engine.sampling_params import SamplingParams
from tests.engine.test_kv_tiers import BS, base_reference, greedy, small_llm, tier_stats, tokens
from tests.peft_adapters import peft_reference

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def replica(model_dir, store, adapters=None):
    return small_llm(model_dir, adapters, kv_shared_dir=str(store), kv_shared_gb=0.05)


def entries(store) -> list:
    return sorted(store.glob("*/*.kv"))


def test_a_prefix_computed_by_one_replica_is_loaded_by_another(tiny_model_dir, tiny_loras, tmp_path):
    peft, paths = tiny_loras
    store = tmp_path / "shared"
    prefill, decode = replica(tiny_model_dir, store, paths), replica(tiny_model_dir, store, paths)
    prompt = tokens(64, 3)
    for adapter in (None, "qv4"):
        prefill.generate([prompt + [5]], SamplingParams(temperature=0, max_tokens=1), [adapter])
        prefill.engine.kv_connector.wait_saved()  # the hand-off: no engine step needed on the prefill side
        (out,) = decode.generate([prompt + [5]], greedy(8), [adapter])
        assert out.num_cached_tokens == 64  # all 8 full blocks (the last token is always computed)
        assert out.token_ids == peft_reference(peft, adapter, prompt + [5], 8)[0][65:]
    assert tier_stats(decode, "shared").hit_tokens == 128
    assert tier_stats(prefill, "shared").saved_blocks >= 16
    assert len(entries(store)) >= 16


def test_wait_saved_hands_every_full_prompt_block_over(tiny_model_dir, tmp_path):
    store = tmp_path / "shared"
    llm = replica(tiny_model_dir, store)
    prompt = tokens(45, 4)  # 5 full blocks, 5 tokens more
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    llm.engine.kv_connector.wait_saved()
    shared = llm.engine.kv_connector.shared
    hashes = chain_block_hashes(prompt, 0, 0, BS, len(prompt) - 1)
    assert len(hashes) == 5 and all(h in shared for h in hashes)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_shared_entry_is_dropped_and_recomputed(tiny_model_dir, tiny_loras, tmp_path, damage):
    peft, _ = tiny_loras
    store = tmp_path / "shared"
    first = replica(tiny_model_dir, store)
    prompt = tokens(48, 5)  # 6 blocks; the 4th is damaged: 3 are loaded, the rest recomputed
    first.generate([prompt + [5]], greedy(2))
    first.engine.kv_connector.wait_saved()
    h = chain_block_hashes(prompt, 0, 0, BS, len(prompt))[3]
    (path,) = [p for p in entries(store) if p.name == entry_name(h)]
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[-7] ^= 0x40
    else:
        del blob[-100:]
    path.write_bytes(bytes(blob))
    other = replica(tiny_model_dir, store)
    (out,) = other.generate([prompt + [7]], greedy())
    assert out.token_ids == base_reference(peft, prompt + [7])
    assert out.num_cached_tokens == 3 * BS
    stats = tier_stats(other, "shared")
    assert stats.dropped_entries == 1 and stats.hit_tokens == 3 * BS
    other.engine.kv_connector.wait_saved()  # recomputed and written again, sound
    kv = other.engine.kv_connector
    assert (
        SharedTier(str(store), 1 << 30, kv.shared.identity, kv.layout).read(h, tuple(prompt[24:32]))
        is not None
    )


def run_as(llm, prompt, tenant, cache_salt=None) -> int:
    """One request as `tenant`: its cached tokens."""
    params = SamplingParams(temperature=0, max_tokens=2, cache_salt=cache_salt)
    rid = llm.engine.add_request(prompt, params, tenant=tenant)
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            if out.request_id == rid and out.finished:
                return out.num_cached_tokens
    raise AssertionError("the request did not finish")


def test_a_salted_tenant_never_reads_another_tenants_shared_blocks(tiny_model_dir, tmp_path):
    store = tmp_path / "shared"
    prompt = tokens(64, 6) + [5]
    alice = replica(tiny_model_dir, store)
    assert run_as(alice, prompt, "alice") == 0
    alice.engine.kv_connector.wait_saved()
    other = replica(tiny_model_dir, store)
    assert run_as(other, prompt, "bob") == 0  # another tenant
    assert run_as(other, prompt, "alice", cache_salt="s") == 0  # another salt of the same tenant
    assert tier_stats(other, "shared").hit_tokens == 0  # neither loaded anything
    assert run_as(other, prompt, "alice") == 64  # the same tenant, unsalted: the store serves it
    assert prefix_salt("alice", None) != prefix_salt("bob", None)


def test_an_fsspec_url_store(tiny_model_dir, tiny_loras, tmp_path):
    peft, _ = tiny_loras
    url = f"file://{tmp_path / 'shared'}"
    a, b = replica(tiny_model_dir, url), replica(tiny_model_dir, url)
    prompt = tokens(32, 7) + [9]
    a.generate([prompt], greedy(1))
    a.engine.kv_connector.wait_saved()
    (out,) = b.generate([prompt], greedy())
    assert out.num_cached_tokens == 32 and out.token_ids == base_reference(peft, prompt)


def test_the_bound_evicts_what_a_replica_knows(tmp_path):
    import torch

    from motet.engine.core.kv_blocks import KVLayout

    layout = KVLayout(2, 4, 1, 8, torch.float32)
    one = len(encode_entry("id", 1, (1,) * 4, torch.zeros(layout.block_shape)))
    tier = SharedTier(str(tmp_path), 3 * one, "id", layout)
    for h in range(1, 6):
        assert tier.write(h, (h,) * 4, torch.full(layout.block_shape, float(h)))
    assert [h in tier for h in range(1, 6)] == [False, False, True, True, True]
    assert tier.num_entries == 3 and tier.bytes == 3 * one
    again = SharedTier(str(tmp_path), 3 * one, "id", layout)  # a new replica finds them
    assert again.num_entries == 3
    got = again.read(4, (4,) * 4)
    assert got is not None and torch.equal(got, torch.full(layout.block_shape, 4.0))
    assert again.read(4, (5,) * 4) is None  # another block's tokens: not served


def test_an_engine_going_idle_holds_no_block(tiny_model_dir, tmp_path):
    """A finished request's blocks are held while the saver copies them; the engine's last step before it idles
    takes the copies in, so none stays held (nor out of the tiers) until some later request comes."""
    llm = replica(tiny_model_dir, tmp_path / "shared")
    llm.generate([tokens(40, 8)], greedy(2))
    assert llm.engine.block_manager.num_used_blocks == 0
    assert llm.engine.stats().kv_blocks_used == 0
    assert tier_stats(llm, "shared").blocks == 5
