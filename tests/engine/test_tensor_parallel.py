"""Tensor and expert parallelism over two gloo ranks on this machine (the engine's runner and one worker
process): logits and greedy output against Hugging Face transformers (and PEFT for mixed adapters), the
same greedy output as one rank with grammars and speculation on, a rank that fails to load or dies."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import torch

from motet.engine.config import EngineConfig
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.model_config import load_model_config
from motet.engine.worker.parallel import Parallel, RankFailure
from motet.grammar.specs import JsonSchemaSpec
from motet.models.declaration import ModelLoadError
from tests.engine.speculative.test_speculative_grammar import SCHEMA
from tests.engine.test_engine import PROMPTS, engine_logits, hf_greedy_outputs, hf_logits
from tests.live_server import forked_running
from tests.lora.test_lora_engine import pool_bytes_for
from tests.models.test_moe import MOE_MODELS
from tests.peft_adapters import TINY_ADAPTERS, peft_reference, save_peft_adapters, tiny_requests
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def tp_workers() -> list[psutil.Process]:
    """This process's tensor-parallel worker processes still running: its children, and those the tests' zygote
    forked for it (tests/live_server.py)."""
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if "motet.engine.worker.tp_rank" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE
    ] + forked_running("motet.engine.worker.tp_rank")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    # biases on q/k/v (split with their heads), an untied lm_head, a vocabulary (320) split in two
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), arch="qwen2", tied=False)


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory):
    # SmolLM2-135M's case: 3 key/value heads (groups of 3 query heads) over 2 ranks split 2 + 1; also 99
    # intermediate columns (50 + 49) and a vocabulary of 321 (161 + 160, the second shard padded)
    return build_tiny_model(
        tmp_path_factory.mktemp("uneven"),
        hidden_size=72,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=99,
        vocab_size=321,
    )


@pytest.mark.parametrize("arch", ["llama", "llama-eager", "qwen2", "uneven"])
def test_two_ranks_logits_match_hf_in_batches_and_chunks(arch, tiny_model_dir, qwen2_dir, uneven_dir):
    model_dir = {"qwen2": qwen2_dir, "uneven": uneven_dir}.get(arch, tiny_model_dir)
    compiled = arch != "llama-eager"  # the native CPU step (its ops all-reduce through a callback) or eager
    config = EngineConfig(
        model=str(model_dir), block_size=8, num_kv_blocks=128, tensor_parallel_size=2, compile_step=compiled
    )
    engine = LLMEngine(config, model_dir=model_dir)
    try:
        assert engine.runner.workers is not None and len(tp_workers()) == 1
        assert (engine.runner.native is not None) == compiled
        attn = engine.runner.model.layers[0].self_attn
        # rank 0's half of the tiny models' 4 query and 2 KV heads; of 9 and 3, the larger part
        assert (attn.num_heads, attn.num_kv_heads) == ((6, 2) if arch == "uneven" else (2, 1))
        refs = [hf_logits(model_dir, p) for p in PROMPTS]
        for chunk in (None, 7):
            for got, ref in zip(engine_logits(engine, PROMPTS, chunk=chunk), refs, strict=True):
                torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    finally:
        engine.close()
    assert tp_workers() == []


@pytest.fixture(scope="module")
def uneven_loras(uneven_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-loras")
    peft = save_peft_adapters(uneven_dir, out, TINY_ADAPTERS, std=0.1)
    return peft, {name: out / name for name, _, _ in TINY_ADAPTERS}


def test_two_ranks_mixed_adapters_greedy_match_peft(uneven_dir, uneven_loras):
    """Every module's adapters cut with its rank's part (unevenly, as the heads and columns are)."""
    peft, paths = uneven_loras
    prompts, names = tiny_requests()
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    # room for about one adapter: adapters are evicted and placed again on both ranks (the worker mirrors each
    # placement at the driver's slot and range)
    room = pool_bytes_for(paths, 1, load_model_config(uneven_dir), Parallel(0, 2))
    with LLM(
        str(uneven_dir),
        num_kv_blocks=256,
        block_size=8,
        max_lora_rank=32,
        adapter_memory_gb=room / 2**30,
        lora_time_slice=3,
        max_num_seqs=4,
        max_num_batched_tokens=48,
        tensor_parallel_size=2,
    ) as llm:
        for name, path in paths.items():
            llm.add_lora(name, path)
        outs = llm.generate(prompts, params, names)
        assert llm.engine.adapters.pool.num_evicted > 0  # ranges and slots reused on both ranks
    for p, n, out in zip(prompts, names, outs, strict=True):
        tokens, _ = peft_reference(peft, n, p, 12)
        assert out.token_ids == tokens[len(p) :], n


def test_two_ranks_grammar_and_speculation_give_one_ranks_greedy(tiny_model_dir):
    texts = ['{"name": "motet", "tokens": [1, 2, 3], "ok": true} ' * 2, "def add(a, b):\n", "x"]
    plain = SamplingParams(temperature=0, max_tokens=24)
    guided = SamplingParams(temperature=0, max_tokens=48, grammar=JsonSchemaSpec(SCHEMA))
    outs = {}
    for tp in (1, 2):
        with LLM(
            str(tiny_model_dir), num_kv_blocks=128, block_size=8, speculative="ngram", tensor_parallel_size=tp
        ) as llm:
            ids = [llm.tokenizer.encode(t) for t in texts]
            outs[tp] = [o.token_ids for o in llm.generate(ids * 2, [plain] * 3 + [guided] * 3)]
            spec = llm.engine.stats().speculative
            assert spec.accepted_tokens > 0  # drafts were verified on both ranks
    assert outs[2] == outs[1]


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_over_two_ranks_greedy_matches_hf(variant, expert_parallel, tmp_path_factory):
    arch, overrides = MOE_MODELS[variant]
    model_dir = build_tiny_model(tmp_path_factory.mktemp(variant), arch=arch, **overrides)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    with LLM(
        str(model_dir),
        num_kv_blocks=128,
        block_size=8,
        max_num_batched_tokens=48,
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
    ) as llm:
        experts = next(
            layer.mlp.experts for layer in llm.engine.runner.model.layers if hasattr(layer.mlp, "experts")
        )
        assert experts.num_local == (2 if expert_parallel else 4)  # whole experts, or every expert's half
        outs = llm.generate(PROMPTS, params)
    assert [out.token_ids for out in outs] == hf_greedy_outputs(model_dir, PROMPTS, 12)


def test_a_model_with_fewer_kv_heads_than_ranks_is_refused_naming_the_fix(tmp_path):
    model_dir = build_tiny_model(tmp_path / "m", num_attention_heads=4, num_key_value_heads=1)
    config = EngineConfig(model=str(model_dir), num_kv_blocks=16, tensor_parallel_size=2)
    with pytest.raises(ModelLoadError, match="1 key/value heads.*--tensor-parallel-size of at most 1"):
        LLMEngine(config, model_dir=model_dir)
    assert tp_workers() == []


@pytest.mark.parametrize("compiled", [True, False], ids=["native", "eager"])
def test_a_gguf_file_over_two_ranks_matches_hf_on_its_dequantized_weights(compiled, tmp_path, monkeypatch):
    """Its Q4_0/Q8_0 blocks split as they are (input columns in whole blocks), the tied Q8_0 table by
    vocabulary rows: the reference one rank is held to (tests/engine/test_gguf_model_file.py)."""
    from transformers import AutoModelForCausalLM

    from tests.engine.test_gguf_model_file import GGUF_TYPES, greedy_hf, write_gguf_file
    from tests.kernels.test_quantization import (
        assert_close_but_for_rounding_flips,
        gguf_reference,
        quantizing_inputs,
    )
    from tests.own_cache import own_cache

    own_cache(monkeypatch, tmp_path / "cache")
    source = build_tiny_model(tmp_path / "source")
    path = write_gguf_file(source, tmp_path / "bare" / "tiny-q4.gguf", GGUF_TYPES)
    hf = AutoModelForCausalLM.from_pretrained(gguf_reference(source, tmp_path / "ref", GGUF_TYPES)).eval()
    hf = quantizing_inputs(hf, lm_head=True)
    with LLM(
        str(path), block_size=8, num_kv_blocks=128, tensor_parallel_size=2, compile_step=compiled
    ) as llm:
        assert (llm.engine.runner.native is not None) == compiled
        with torch.no_grad():
            want = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
        assert_close_but_for_rounding_flips(engine_logits(llm.engine, PROMPTS), want)
        outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy_hf(hf, p, 10) for p in PROMPTS[:3]]


def test_int4_on_load_over_two_ranks_gives_one_ranks_greedy(tiny_model_dir):
    """Each rank quantizes its own part of the float checkpoint: the same blocks as one rank's."""
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
    outs = {}
    for tp in (1, 2):
        with LLM(
            str(tiny_model_dir), num_kv_blocks=128, block_size=8, quantization="int4", tensor_parallel_size=tp
        ) as llm:
            outs[tp] = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert outs[2] == outs[1]


def test_quantized_blocks_that_do_not_split_are_refused_naming_the_fix(tmp_path):
    # 96 intermediate columns (3 blocks) over 2 ranks: each down_proj holds 48 inputs, not whole blocks of 32
    model_dir = build_tiny_model(tmp_path / "m", intermediate_size=96)
    config = EngineConfig(model=str(model_dir), num_kv_blocks=16, tensor_parallel_size=2, quantization="int8")
    with pytest.raises(ModelLoadError, match="whole blocks of 32.*--tensor-parallel-size"):
        LLMEngine(config, model_dir=model_dir)
    assert tp_workers() == []


def test_a_killed_rank_fails_the_step_and_leaves_no_process(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=64, block_size=8, tensor_parallel_size=2)
    try:
        engine = llm.engine
        (worker,) = tp_workers()
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        with pytest.raises(RankFailure):
            for _ in range(50):
                engine.step()
    finally:
        llm.close()
    assert tp_workers() == []


def test_a_worker_exits_when_its_driver_dies(tiny_model_dir, tmp_path):
    """The driver process killed outright (no close): its worker does not outlive it."""
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(
        "import sys, time\n"
        "from motet.engine.llm import LLM\n"
        f"llm = LLM({str(tiny_model_dir)!r}, num_kv_blocks=16, block_size=8, tensor_parallel_size=2)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    driver = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        assert driver.stdout.readline().strip() == "ready"
        workers = [
            p
            for p in psutil.Process(driver.pid).children()
            if "motet.engine.worker.tp_rank" in " ".join(p.cmdline())
        ]
        assert len(workers) == 1
        driver.kill()
        driver.wait(timeout=10)
        gone, alive = psutil.wait_procs(workers, timeout=20)
        assert alive == []
    finally:
        driver.kill()


def test_expert_parallel_with_adapters_grammar_and_speculation_matches_peft_and_one_rank(tmp_path):
    """Mixtral over two expert-parallel ranks, attention adapters mixed with the base model in one batch:
    PEFT's greedy output; with a JSON schema and n-gram speculation on, one rank's."""
    arch, overrides = MOE_MODELS["mixtral"]
    model_dir = build_tiny_model(tmp_path / "mixtral", arch=arch, **overrides)
    specs = [("qv", 8, ["q_proj", "v_proj", "o_proj"]), ("k", 4, ["k_proj", "q_proj"])]
    peft = save_peft_adapters(model_dir, tmp_path, specs, std=0.1)
    names = ["qv", None, "k", "qv"]
    plain = SamplingParams(temperature=0, max_tokens=10, min_tokens=10)
    guided = SamplingParams(temperature=0, max_tokens=40, grammar=JsonSchemaSpec(SCHEMA))
    outs = {}
    for tp in (1, 2):
        with LLM(
            str(model_dir),
            num_kv_blocks=128,
            block_size=8,
            max_lora_rank=8,
            speculative="ngram",
            tensor_parallel_size=tp,
            enable_expert_parallel=tp > 1,
        ) as llm:
            for name, _, _ in specs:
                llm.add_lora(name, tmp_path / name)
            outs[tp] = [
                o.token_ids for o in llm.generate(PROMPTS[:4] * 2, [plain] * 4 + [guided] * 4, names * 2)
            ]
    for prompt, name, got in zip(PROMPTS[:4], names, outs[2][:4], strict=True):
        assert got == peft_reference(peft, name, prompt, 10)[0][len(prompt) :], name
    assert outs[2] == outs[1]
