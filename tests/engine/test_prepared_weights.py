"""The prepared-weights cache (motet/engine/worker/prepared_weights.py, motet/engine/weights/prepared_store.py): a
start that finds its entry maps the native step's weights instead of reading and packing the checkpoint, and
computes what a start without the cache computes; an entry of another file, instruction-set tier or settings is
never read; a corrupt one is rebuilt; the bound evicts the least recently used; `motet cache ls / rm`."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch

from motet.api.cli import main
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.gguf_table import GgufTable
from motet.engine.weights.prepared_store import DATA, INDEX, PreparedStore
from motet.engine.worker import model_runner, prepared_weights
from motet.kernels import cpu_native
from tests.engine.test_engine import PROMPTS, engine_logits
from tests.engine.test_gguf_model_file import write_gguf_file
from tests.kernels.test_quant_formats import quantize, random_blocks
from tests.models.test_moe import MOE_MODELS
from tests.tiny_models import build_tiny_model

pytestmark = [
    pytest.mark.skipif(cpu_native.library() is None, reason="no C++ compiler for the CPU kernels"),
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]
OPTIONS = dict(device="cpu", block_size=8, num_kv_blocks=256)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# a GGUF file as llama.cpp's K-quant mixes write them: the tied table in Q6_K, projections in Q5_0 / Q4_K / Q8_0
# (requantized to int8 where motet's kernels have no block of that type)
GGUF_MIX = {"token_embd": "Q6_K", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K",
            "ffn_gate": "Q5_0", "ffn_up": "Q5_0", "ffn_down": "Q6_K"}  # fmt: skip


@pytest.fixture
def cache(tmp_path, monkeypatch) -> PreparedStore:
    """This test's own cache."""
    monkeypatch.setenv("MOTET_WEIGHTS_CACHE_DIR", str(tmp_path / "weights"))
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))  # (a GGUF file's derived config)
    return PreparedStore(tmp_path / "weights")


def outputs(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations and every row's logits of the test prompts."""
    greedy = [o.token_ids for o in llm.generate(PROMPTS[:4], GREEDY)]
    return greedy, engine_logits(llm.engine, PROMPTS)


def start(model, **options) -> LLM:
    return LLM(str(model), **OPTIONS, **options)


def gguf_model(tmp_path):
    """A tiny model as a GGUF file in GGUF_MIX (K-quant rows are whole super-blocks of 256: wider layers; gguf-py
    writes no Q6_K blocks: random ones)."""
    source = build_tiny_model(tmp_path / "source", hidden_size=256, intermediate_size=512)

    def blocks(w, qtype):
        return (
            random_blocks(qtype, *w.shape) if qtype == gguf.GGMLQuantizationType.Q6_K else quantize(w, qtype)
        )

    return write_gguf_file(source, tmp_path / "file" / "tiny-mix.gguf", GGUF_MIX, quantize=blocks)


MODELS = {
    "llama-tied": lambda p: build_tiny_model(p),
    "qwen2-untied": lambda p: build_tiny_model(p, arch="qwen2", tied=False),  # q/k/v biases, an untied head
    "gemma3": lambda p: build_tiny_model(p, arch="gemma3"),  # sandwich norms, sliding layers' own rotary
    "mixtral": lambda p: build_tiny_model(p, arch="mixtral", **MOE_MODELS["mixtral"][1]),  # stacked experts
    "gguf-k-quants": gguf_model,
}


@pytest.mark.parametrize(
    "name, options",
    [("llama-tied", {}), ("llama-tied", {"dtype": "bfloat16"}), ("llama-tied", {"quantization": "int4"}),
     ("qwen2-untied", {}), ("qwen2-untied", {"quantization": "int8"}), ("gemma3", {}), ("mixtral", {}),
     ("mixtral", {"quantization": "int4"}), ("gguf-k-quants", {})],
)  # fmt: skip
def test_a_start_from_the_cache_computes_what_a_start_without_it_does(
    cache, tmp_path, monkeypatch, name, options
):
    model = MODELS[name](tmp_path / "model")
    want = outputs(start(model, weights_cache_gb=0, **options))  # no cache
    first = start(model, **options)
    assert not first.engine.runner.prepared.hit and len(cache.entries()) == 1  # prepared, written
    assert _equal(outputs(first), want)

    def no_reading(*args, **kwargs):
        raise AssertionError("a start from the cache read the checkpoint")

    monkeypatch.setattr(model_runner, "load_weights", no_reading)  # nor is anything packed (WeightArena.put)
    again = start(model, **options)
    assert again.engine.runner.prepared.hit
    assert _equal(outputs(again), want)


def _equal(a, b) -> bool:
    (greedy_a, logits_a), (greedy_b, logits_b) = a, b
    return greedy_a == greedy_b and all(torch.equal(x, y) for x, y in zip(logits_a, logits_b, strict=True))


def test_a_gguf_table_stays_in_its_blocks(cache, tmp_path):
    """A GGUF file's embedding table is looked up in the file's own Q6_K blocks: rows as gguf-py dequantizes
    them, no float copy of the table in the model (with the cache or without)."""
    path = gguf_model(tmp_path)
    reader = gguf.GGUFReader(str(path))
    table = next(t for t in reader.tensors if t.name == "token_embd.weight")
    want = torch.from_numpy(gguf.quants.dequantize(table.data, table.tensor_type).copy())
    for llm in (start(path, compile_step=False), start(path), start(path)):
        model = llm.engine.runner.model
        assert isinstance(model.embed_tokens, GgufTable)
        ids = torch.tensor([0, 5, 319, 17, 5])
        assert torch.equal(model.embed_tokens(ids), want[ids])
        vocab, hidden = want.shape
        assert not any(tuple(p.shape) == (vocab, hidden) and not p.is_meta for p in model.parameters())


def test_an_entry_of_another_tier_or_file_is_never_used(cache, tmp_path, monkeypatch):
    model = build_tiny_model(tmp_path / "model")
    start(model)
    (mine,) = cache.entries()
    monkeypatch.setattr(cpu_native, "isa", lambda: "scalar")  # the scalar tier's kernels run: another key
    want = outputs(start(model, weights_cache_gb=0))
    other = start(model)
    assert not other.engine.runner.prepared.hit
    assert {e.settings["isa"] for e in cache.entries()} == {mine.settings["isa"], "scalar"}
    # an entry of the first tier put in the place of the second's (its index names its own key): refused, rebuilt
    theirs = next(e for e in cache.entries() if e.settings["isa"] == "scalar")
    shutil.rmtree(theirs.path)
    shutil.copytree(mine.path, theirs.path)
    tampered = start(model)
    assert not tampered.engine.runner.prepared.hit
    assert _equal(outputs(tampered), want)
    monkeypatch.undo()
    monkeypatch.setenv("MOTET_WEIGHTS_CACHE_DIR", str(cache.root))
    (model / "model.safetensors").touch()  # the file changed (its modification time): a new entry
    assert not start(model).engine.runner.prepared.hit


@pytest.mark.parametrize("damage", ["truncated", "zeroed page", "index edited", "index unreadable"])
def test_a_corrupt_entry_is_rebuilt(cache, tmp_path, damage):
    model = build_tiny_model(tmp_path / "model")
    want = outputs(start(model, weights_cache_gb=0))
    start(model)
    (entry,) = cache.entries()
    data, index = entry.path / DATA, entry.path / INDEX
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "zeroed page":
        raw = bytearray(data.read_bytes())
        raw[:4096] = bytes(4096)
        data.write_bytes(bytes(raw))
    elif damage == "index edited":  # a tensor moved, the checksum left as it was
        body = json.loads(index.read_text())
        name = next(n for n in body["tensors"] if n != prepared_weights.ARENA)
        body["tensors"][name][0] += 64
        index.write_text(json.dumps(body))
    else:
        index.write_text("{")
    rebuilt = start(model)
    assert not rebuilt.engine.runner.prepared.hit
    assert _equal(outputs(rebuilt), want)
    assert start(model).engine.runner.prepared.hit  # written again


def test_the_bound_evicts_the_least_recently_used(tmp_path):
    store = PreparedStore(tmp_path, max_bytes=3 * 4096 + 3000)  # three entries of 4 KiB data and their index
    for i in range(3):
        w = store.writer(f"{i}" * 64, f"m{i}", [], {})
        w.add("x", torch.zeros(1024))
        w.finish({})
    assert store.open("1" * 64) is not None  # m1 used: m0 is now the least recently used
    w = store.writer("3" * 64, "m3", [], {})
    w.add("x", torch.zeros(1024))
    w.finish({})
    assert sorted(e.label for e in store.entries()) == ["m1", "m2", "m3"]


def test_cache_ls_and_rm(cache, tmp_path, capsys):
    a, b = build_tiny_model(tmp_path / "a"), build_tiny_model(tmp_path / "b", seed=1)
    start(a)
    start(b)
    assert main(["cache", "ls", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(r["source"][-1] for r in rows) == sorted(str(m / "model.safetensors") for m in (a, b))
    assert main(["cache", "ls"]) == 0
    listing = capsys.readouterr().out
    assert all(r["key"][:12] in listing for r in rows) and "2 entries" in listing
    assert main(["cache", "rm", rows[0]["key"][:8]]) == 0
    assert [e.key for e in cache.entries()] == [rows[1]["key"]]
    assert main(["cache", "rm", "ffffffff"]) == 2  # no such entry: one line, exit 2
    assert "no entry" in capsys.readouterr().err
    assert main(["cache", "rm", "--all"]) == 0
    assert cache.entries() == []
