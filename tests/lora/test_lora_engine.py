"""Multi-LoRA in the engine: one batch mixing adapters (ranks, target modules) and base-only requests gives,
per request, what Hugging Face transformers + PEFT gives with that adapter alone; the adapters' pool under a
cap and under a byte bound (time slicing, eviction and reloads), prefix caching and adapter removal on top."""

from __future__ import annotations

import pytest
import torch

from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.kernels import cpu_native
from motet.lora.adapter import AdapterError, load_adapter
from tests.engine.test_engine import engine_logits
from tests.peft_adapters import (
    ADAPTERS,
    peft_reference,
    peft_teacher_forced,
    save_peft_adapters,
    tiny_llm,
    tiny_requests,
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def lora_logits(engine: LLMEngine, prompts, adapters, chunk: int | None = None, order=None):
    """All-row logits of each prompt with its adapter, in flattened batches (sequences visited in `order`)."""
    return engine_logits(engine, prompts, chunk, adapters, order)


def assert_adapters_matter(engine: LLMEngine, prompts, adapted, names, margin: float = 0.5) -> None:
    """The adapters matter: each row's logits with its adapter (`adapted`, `names`) are more than `margin` from the
    base model's on the same tokens, and a row without one is within `margin` of them."""
    base = lora_logits(engine, prompts, [None] * len(prompts))
    for a, b, n in zip(adapted, base, names, strict=True):
        assert ((a - b).abs().max() > margin) == bool(n), n


# -- tiny random model: fast -------------------------------------------------------------------------------


def test_mixed_batch_logits_match_peft(tiny_model_dir, tiny_loras):
    peft, paths = tiny_loras
    llm = tiny_llm(tiny_model_dir, paths)
    prompts, names = tiny_requests()
    refs = [peft_reference(peft, n, p, 0)[1] for p, n in zip(prompts, names, strict=True)]
    # Whole prompts, then 7-token chunks (prefill chunks beside short tails), then a shuffled order
    # (an adapter split into several segments).
    for chunk, order in ((None, None), (7, None), (None, [3, 0, 6, 1, 7, 2, 5, 4])):
        got = lora_logits(llm.engine, prompts, names, chunk=chunk, order=order)
        for g, ref in zip(got, refs, strict=True):
            torch.testing.assert_close(g, ref, atol=2e-4, rtol=1e-4)
    assert_adapters_matter(llm.engine, prompts, refs, names)


# Adapters on part of a fused group (q/k/v, gate/up): the group's one shrink and one expand must leave the
# other modules' columns as the base model computes them.
SUBSET_ADAPTERS = [
    ("kv8", 8, ["k_proj", "v_proj"]),
    ("up4", 4, ["up_proj"]),
    ("qgate16", 16, ["q_proj", "gate_proj", "down_proj"]),
]


@pytest.mark.parametrize("compiled", [True, False], ids=["native-step", "eager"])
def test_adapters_on_part_of_a_fused_group_match_peft(tiny_model_dir, tmp_path, compiled):
    peft = save_peft_adapters(tiny_model_dir, tmp_path, SUBSET_ADAPTERS, std=0.1)
    paths = {name: tmp_path / name for name, _, _ in SUBSET_ADAPTERS}
    llm = tiny_llm(tiny_model_dir, paths, max_loras=3, compile_step=compiled)
    runner = llm.engine.runner  # the native step is the CPU's: on CUDA the eager path (and its graphs) runs
    assert (runner.native is not None) == (
        compiled and runner.device.type == "cpu" and cpu_native.library() is not None
    )
    prompts, _ = tiny_requests()
    names = ["kv8", None, "up4", "qgate16", "kv8", "up4", None, "qgate16"]
    refs = [peft_reference(peft, n, p, 0)[1] for p, n in zip(prompts, names, strict=True)]
    for chunk in (None, 7):
        got = lora_logits(llm.engine, prompts, names, chunk=chunk)
        for g, ref in zip(got, refs, strict=True):
            torch.testing.assert_close(g, ref, atol=2e-4, rtol=1e-4)
    assert_adapters_matter(llm.engine, prompts, refs, names)


def test_mixed_batch_greedy_matches_peft_generate(tiny_model_dir, tiny_loras):
    peft, paths = tiny_loras
    # A 48-token budget: prompts are chunked and their chunks share steps with other requests' decodes.
    llm = tiny_llm(tiny_model_dir, paths, max_num_batched_tokens=48)
    prompts, names = tiny_requests()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, min_tokens=12), names)
    for p, n, out in zip(prompts, names, outs, strict=True):
        tokens, _ = peft_reference(peft, n, p, 12)
        assert out.token_ids == tokens[len(p) :], n
    assert llm.engine.adapters.pool.num_placed == 4  # each copied into the pool once


def test_no_adapters_no_lora_path(tiny_model_dir, tiny_loras):
    _, paths = tiny_loras
    llm = tiny_llm(tiny_model_dir, paths)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert llm.engine.adapters.pool.num_placed == 0  # nothing copied: the pool's pages never touched


def test_prefix_cache_is_not_shared_across_adapters(tiny_model_dir, tiny_loras):
    peft, paths = tiny_loras
    llm = tiny_llm(tiny_model_dir, paths)
    prefix = [(i * 11) % 300 + 3 for i in range(48)]
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    (base,) = llm.generate([prefix + [5]], params)
    (a,) = llm.generate([prefix + [5]], params, ["qv4"])
    (b,) = llm.generate([prefix + [5]], params, ["kod16"])
    (a2,) = llm.generate([prefix + [5]], params, ["qv4"])
    assert (base.num_cached_tokens, a.num_cached_tokens, b.num_cached_tokens) == (0, 0, 0)
    assert a2.num_cached_tokens == 48 and a2.token_ids == a.token_ids
    assert a.token_ids == peft_reference(peft, "qv4", prefix + [5], 6)[0][49:]


def pool_bytes_for(paths, count: int, base, parallel=None) -> int:
    """Adapter memory for the `count` largest of these adapters at once (more would not fit); `parallel`: as a
    tensor-parallel rank 0 packs them."""
    from motet.lora.pool import PoolLayout, pack

    layout = PoolLayout(parallel.layout_shape(base) if parallel else base)
    shard = parallel.lora_sharder(base) if parallel else None
    sizes = sorted(
        pack(load_adapter(p, base, max_rank=32), layout, torch.float32, shard).nbytes for p in paths.values()
    )
    return sum(sizes[-count:]) + 1024


@pytest.mark.parametrize("room", ["cap", "memory"])
def test_more_adapters_than_room_time_slice_and_all_complete(tiny_model_dir, tiny_loras, room):
    """Four adapters, room for two at once: under `max_loras` 2, or in a pool of the two largest ones' bytes.
    Every request completes with the outputs of an engine with room for all; the pool stays in its bound."""
    _, paths = tiny_loras
    names = list(paths) * 3 + [None] * 3
    prompts = [[(i * 5 + j) % 300 + 3 for j in range(4 + i % 7)] for i in range(len(names))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ample = tiny_llm(tiny_model_dir, paths).generate(prompts, params, names)

    if room == "cap":
        options = {"max_loras": 2}
    else:
        from motet.engine.weights.model_config import load_model_config

        options = {"adapter_memory_gb": pool_bytes_for(paths, 2, load_model_config(tiny_model_dir)) / 2**30}
    llm = tiny_llm(tiny_model_dir, paths, lora_time_slice=3, max_num_seqs=4, **options)
    engine = llm.engine
    pool = engine.adapters.pool
    ids = [engine.add_request(p, params, adapter=n) for p, n in zip(prompts, names, strict=True)]
    final, steps, answers = {}, 0, RequestOutputs()
    while engine.has_unfinished():
        batch = engine.schedule()
        if room == "cap":
            assert len({s.adapter_id for s in batch.seqs} - {0}) <= 2
        assert pool.used_bytes <= pool.capacity_bytes
        adapters = [s.adapter_id for s in batch.seqs]
        assert adapters == sorted(adapters)  # one contiguous segment per adapter
        for out in answers.add(engine.commit(batch, engine.execute(batch))):
            final[out.request_id] = out
        steps += 1
        assert steps < 300
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in ample]
    if room == "memory":
        assert pool.num_evicted > 0  # room was made by evicting


def test_remove_lora_lets_running_requests_finish(tiny_model_dir, tiny_loras):
    peft, paths = tiny_loras
    llm = tiny_llm(tiny_model_dir, paths)
    engine = llm.engine
    prompt = [9, 8, 7, 6, 5]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    rid = engine.add_request(prompt, params, adapter="all8")
    ref = engine.adapters.named["all8"]
    answers = RequestOutputs()
    answers.step(engine), answers.step(engine)
    engine.remove_lora("all8")
    with pytest.raises(AdapterError, match="no adapter named 'all8'"):
        engine.add_request(prompt, params, adapter="all8")
    with pytest.raises(AdapterError, match="adapter 'all8' was removed"):
        engine.add_request(prompt, params, adapter=ref)  # a request that resolved it before the removal
    outs = []
    while engine.has_unfinished():
        outs += [o for o in answers.step(engine) if o.request_id == rid]
    assert outs[-1].finished and outs[-1].token_ids == peft_reference(peft, "all8", prompt, 8)[0][5:]
    adapters = engine.adapters
    assert ref.uid not in adapters.host and ref.uid not in adapters.known
    assert next(iter(adapters.pool.lru)) == ref.uid  # the first to leave the pool
    # The same files registered again serve again.
    assert llm.add_lora("all8", paths["all8"]) == ref
    engine.add_request(prompt, params, adapter="all8")


def test_a_removed_adapter_whose_files_are_gone_still_serves_its_requests(
    tiny_model_dir, tiny_loras, tmp_path
):
    """Its host copy is pinned while requests use it: another adapter cannot push it out of the host
    cache (max_cpu_loras=1) after its files are deleted, and a pool with room for one adapter (the others'
    requests evict it and it comes back from the host) serves it from there."""
    import shutil

    peft, paths = tiny_loras
    doomed = shutil.copytree(paths["all8"], tmp_path / "doomed")
    from motet.engine.weights.model_config import load_model_config

    room = pool_bytes_for({"doomed": doomed, "qv4": paths["qv4"]}, 1, load_model_config(tiny_model_dir))
    llm = tiny_llm(
        tiny_model_dir,
        {"doomed": doomed, "qv4": paths["qv4"]},
        max_cpu_loras=1,
        adapter_memory_gb=room / 2**30,
    )
    engine = llm.engine
    prompt = [9, 8, 7, 6, 5]
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
    rid = engine.add_request(prompt, params, adapter="doomed")
    answers = RequestOutputs()
    answers.step(engine)
    engine.remove_lora("doomed")
    shutil.rmtree(doomed)
    others = [engine.add_request([3, 4, 5, i + 6], params, adapter="qv4") for i in range(3)]
    host = engine.adapters.host
    doomed_id = engine.requests[rid].adapter_id
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in answers.step(engine) if o.finished})
        if rid not in outs:
            assert doomed_id in host
    assert outs[rid].token_ids == peft_reference(peft, "all8", prompt, 8)[0][5:]
    assert all(outs[r].finish_reason == "length" for r in others)
    assert not host.pinned and len(host) <= 1


def test_add_lora_validates(tiny_model_dir, tiny_loras, tmp_path):
    _, paths = tiny_loras
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, max_lora_rank=16)
    with pytest.raises(AdapterError, match="does not exist"):
        llm.add_lora("x", tmp_path / "missing")
    with pytest.raises(AdapterError, match="above this server's max LoRA rank 16"):
        llm.add_lora("big", paths["gu64"])
    a, b = llm.add_lora("a", paths["qv4"]), llm.add_lora("b", paths["all8"])
    assert a.uid > 0 and b.uid > 0 and a.uid != b.uid  # one files' version under two names: two adapters
    # Loaded beforehand (off the event loop), registered without touching the disk again.
    base = llm.engine.model_config
    pre = llm.engine.add_lora("pre", paths["qv4"], load_adapter(paths["qv4"], base))
    assert pre.uid not in (a.uid, b.uid)
    with pytest.raises(AdapterError, match="rank 32, above max_lora_rank 16"):
        llm.engine.add_lora("pre", paths["gu64"], load_adapter(paths["gu64"], base))
    assert llm.engine.adapters.named["pre"] == pre  # a failed replacement keeps the old version
    with pytest.raises(AdapterError, match="no adapter named 'c'"):
        llm.generate([[1, 2]], None, ["c"])


# LoRA outside the decoder layers: the token embedding and the output head (PEFT's lora.Embedding and a Linear on
# lm_head; PEFT saves both base layers' own weights beside them), alone and with decoder modules.
MODEL_ADAPTERS = [
    ("emb4", 4, ["embed_tokens", "q_proj"]),
    ("head8", 8, ["lm_head", "v_proj"]),
    ("both4", 4, ["embed_tokens", "lm_head"]),
    ("qv4", 4, ["q_proj", "v_proj"]),
]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("compiled", [True, False], ids=["native-step", "eager"])
def test_embedding_and_head_adapters_mixed_with_others_match_peft(tmp_path_factory, tmp_path, compiled, tied):
    from tests.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny"), tied=tied)
    peft = save_peft_adapters(model_dir, tmp_path, MODEL_ADAPTERS, std=0.1)
    llm = tiny_llm(model_dir, {n: tmp_path / n for n, _, _ in MODEL_ADAPTERS}, compile_step=compiled)
    prompts, _ = tiny_requests()
    names = ["emb4", None, "head8", "both4", "qv4", "emb4", "both4", None]
    refs = [peft_reference(peft, n, p, 0)[1] for p, n in zip(prompts, names, strict=True)]
    for chunk in (None, 7):
        got = lora_logits(llm.engine, prompts, names, chunk=chunk)
        for g, ref, n in zip(got, refs, names, strict=True):
            torch.testing.assert_close(g, ref, atol=2e-4, rtol=1e-4, msg=n)
    assert_adapters_matter(llm.engine, prompts, refs, names)
    # greedy, with the head's delta on the sampled rows of steps that mix prompt chunks and decodes
    llm48 = tiny_llm(model_dir, {n: tmp_path / n for n, _, _ in MODEL_ADAPTERS}, max_num_batched_tokens=48,
                     compile_step=compiled)  # fmt: skip
    outs = llm48.generate(prompts, SamplingParams(temperature=0, max_tokens=10, min_tokens=10), names)
    for p, n, out in zip(prompts, names, outs, strict=True):
        assert out.token_ids == peft_reference(peft, n, p, 10)[0][len(p) :], n


# -- the real default model: slow --------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_mixed_batch_matches_peft(default_model_dir, tmp_path):
    peft = save_peft_adapters(default_model_dir, tmp_path, ADAPTERS, std=0.02)
    llm = LLM(
        str(default_model_dir), num_kv_blocks=512, max_loras=4, max_lora_rank=64, max_num_batched_tokens=64
    )
    for name, _, _ in ADAPTERS:
        llm.add_lora(name, tmp_path / name)
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "What is 12 times 12?"]
    names = [None, "qv4", "all8", "kod16", "gu64", "qv4", None, "all8"]
    prompts = [
        llm.tokenizer.encode_chat([{"role": "user", "content": questions[i % 3]}]) for i in range(len(names))
    ]
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    outs = llm.generate(prompts, params, names)
    full, refs = [], []
    eos = sorted(llm.engine.eos_token_ids)
    for p, n, out in zip(prompts, names, outs, strict=True):
        assert len(out.token_ids) == 16
        full.append(p + out.token_ids)  # PEFT's greedy continuation (checked teacher-forced), its logits
        refs.append(peft_teacher_forced(peft, n, p, out.token_ids, no_eos=eos))
    # Logits over prompt + continuation, all requests in one flattened batch, in 64-token chunks.
    got = lora_logits(llm.engine, full, names, chunk=64)
    diffs = [(g - r).abs().max().item() for g, r in zip(got, refs, strict=True)]
    print("max |logit - PEFT logit| per request:", " ".join(f"{d:.1e}" for d in diffs))
    for g, r in zip(got, refs, strict=True):
        # fp32, the same math in another order (fused q/k/v, SGMV segments, chunked attention): ~1e-4 seen
        torch.testing.assert_close(g, r, atol=1e-3, rtol=1e-4)
    assert_adapters_matter(llm.engine, full, got, names, margin=1.0)


def test_a_reuploaded_adapter_never_reuses_the_old_versions_prefix_cache(tiny_model_dir, tmp_path):
    """Same name, same path, new weights: another version, so another uid in the prefix-cache hashes; its
    requests compute their prompt afresh and give what PEFT gives with the new weights."""
    import shutil

    peft_old = save_peft_adapters(
        tiny_model_dir, tmp_path / "old", [("a", 8, ["q_proj", "v_proj"])], 0.1, seed=1
    )
    peft_new = save_peft_adapters(
        tiny_model_dir, tmp_path / "new", [("a", 8, ["q_proj", "v_proj"])], 0.1, seed=2
    )
    served = tmp_path / "served"
    shutil.copytree(tmp_path / "old" / "a", served)
    llm = tiny_llm(tiny_model_dir, {"a": served})
    prompt = [(i * 11) % 300 + 3 for i in range(40)] + [5]
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6)
    (first,) = llm.generate([prompt], params, ["a"])
    (again,) = llm.generate([prompt], params, ["a"])
    assert again.num_cached_tokens == 40  # the same version shares its blocks
    old_uid = llm.engine.adapters.named["a"].uid

    shutil.rmtree(served)  # deleted and uploaded anew under the same name and path
    shutil.copytree(tmp_path / "new" / "a", served)
    llm.engine.remove_lora("a")
    assert llm.add_lora("a", served).uid != old_uid
    (fresh,) = llm.generate([prompt], params, ["a"])
    assert fresh.num_cached_tokens == 0
    assert first.token_ids == peft_reference(peft_old, "a", prompt, 6)[0][len(prompt) :]
    assert fresh.token_ids == peft_reference(peft_new, "a", prompt, 6)[0][len(prompt) :]
