"""What each attention's declaration says a layer's paged cache keeps (ModelConfig.cache_layout,
motet/models/attention.py), held to what it replaced and to what reads it: per-head K and V of every KV head, each
rank its share of them; the latent row, every rank all of it; the runner's cache tensors and the memory sizing's
block bytes, and the blocks' layout that the disk and shared KV tiers digest into their identities (pinned: a
change would orphan every stored entry)."""

from __future__ import annotations

import json

import pytest

from motet.engine.config import EngineConfig
from motet.engine.core.kv_blocks import KVLayout
from motet.engine.llm_engine import LLMEngine
from motet.engine.worker.memory import kv_block_bytes
from motet.engine.worker.parallel import Parallel
from motet.models.config import ModelConfig
from tests.models.test_deepseek import V2_LITE_HUB, V3_HUB, build_deepseek

# SmolLM2-135M's shape: 9 query heads over 3 KV heads of 64, 30 layers
SMOLLM2 = dict(
    architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
)  # fmt: skip


def rank_heads(cfg: ModelConfig, size: int) -> list[int]:
    """Each rank's count of the KV heads, as the runner takes it."""
    return [Parallel(rank, size).heads(cfg)[1][1] for rank in range(size)]


def test_per_head_attention_keeps_k_and_v_of_every_kv_head_each_rank_its_share():
    cfg = ModelConfig.from_dict(SMOLLM2)
    layout = cfg.cache_layout
    assert layout.parts == ((3, 64), (3, 64)) and not layout.replicated
    assert layout.elements == layout.per_head_elements == 2 * 3 * 64
    assert cfg.kv_elements_per_token == cfg.per_head_kv_elements_per_token == 30 * 2 * 3 * 64
    assert rank_heads(cfg, 2) == [2, 1]
    for local in rank_heads(cfg, 2):
        assert layout.rank_parts(local) == ((local, 64), (local, 64))
        assert layout.rank_share(local / 3) == local / 3
    assert layout.rank_share(1 / 3) == 1 / 3  # (memory.check_fits: the even share of 3 ranks)


@pytest.mark.parametrize("hub", [V2_LITE_HUB, V3_HUB], ids=["v2_lite", "v3"])
def test_latent_attention_keeps_one_row_that_every_rank_keeps_whole(hub):
    cfg = ModelConfig.from_dict(hub)
    layout = cfg.cache_layout
    heads, layers = hub["num_attention_heads"], hub["num_hidden_layers"]
    assert layout.parts == ((1, 512 + 64),) and layout.replicated
    assert layout.elements == 576 and layout.per_head_elements == heads * (128 + 64 + 128)
    assert cfg.kv_elements_per_token == layers * 576
    assert cfg.per_head_kv_elements_per_token == layers * heads * (192 + 128)
    for size in (2, 4):  # (a latent config's KV heads are its query heads: the runner splits those)
        for local in rank_heads(cfg, size):
            assert layout.rank_parts(local) == ((1, 576),)
            assert layout.rank_share(local / heads) == 1
    assert layout.rank_share(1 / 4) == 1


# KVLayout.describe() of each model's blocks, as motet wrote it before the layout was a value (5c8de52): the disk
# and shared tiers' identities digest it.
DESCRIBED = {
    "llama": '{"layers": 2, "block_size": 8, "kv_heads": 2, "head_dim": 16, "dtype": "float32"}',
    "v2_lite": '{"layers": 3, "block_size": 8, "kv_heads": 1, "head_dim": 24, "dtype": "float32", "parts": 1}',
}


@pytest.mark.parametrize("name", list(DESCRIBED))
def test_the_runner_allocates_the_declared_layout(name, tiny_model_dir, tmp_path):
    """Each layer's cache tensors are the layout's parts, one block's bytes over them all what the memory sizing
    counts, and the blocks' layout what motet has always described."""
    model_dir = tiny_model_dir if name == "llama" else build_deepseek(tmp_path, name)
    options = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=16, compile_step=False)
    config = EngineConfig(model=str(model_dir), **options)
    engine = LLMEngine(config, model_dir)
    try:
        cfg, caches = engine.model_config, engine.runner.kv_caches
        parts = cfg.cache_layout.rank_parts(cfg.num_key_value_heads)
        assert len(caches) == cfg.num_hidden_layers
        assert all([tuple(t.shape) for t in layer] == [(16, 8, *p) for p in parts] for layer in caches)
        itemsize = engine.runner.dtype.itemsize
        held = sum(t[0].numel() * itemsize for layer in caches for t in layer)
        assert held == kv_block_bytes(cfg, 8, itemsize) == cfg.kv_elements_per_token * 8 * itemsize
        assert json.dumps(KVLayout.of(caches).describe()) == DESCRIBED[name]
    finally:
        engine.close()
