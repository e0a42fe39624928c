"""Start-up that fits the card (issue 30, item 5): weights read straight into the engine's dtype, the KV cache
sized from a share of the memory by default on CUDA, and the engine warmed up before the server says it is
ready.

The loaded weights are checked against Hugging Face transformers' own (the checkpoint cast to the dtype) and the
quantized ones against quantizing the checkpoint's fp32 values; the peak memory of a load is read in a fresh
process (benchmarks/load_peak.py), with a bound far from both the new figure and the old one."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import save_file
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.load_peak import measure
from motet.actors.system import ServingSystem
from motet.api.app import create_app
from motet.api.cli import build_parser, engine_config
from motet.api.state import ServerState
from motet.engine.config import CPU_KV_CACHE_MEMORY_GB, CUDA_GPU_MEMORY_UTILIZATION, EngineConfig
from motet.engine.llm import LLM
from motet.engine.llm_engine import LLMEngine
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights.model_config import load_model_config
from motet.engine.worker.cuda_graphs import DecodeGraphs, buckets
from motet.engine.worker.model_runner import ModelRunner
from motet.engine.worker.step_backends import EagerSteps
from motet.kernels.quant import FORMATS, INT8
from tests.tiny_models import build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def runner(model_dir, **options) -> ModelRunner:
    """The model as the engine loads it; the eager model keeps its float weights (the native step takes
    them over)."""
    config = EngineConfig(model=str(model_dir), device="cpu", num_kv_blocks=4, compile_step=False, **options)
    return ModelRunner(model_dir, load_model_config(model_dir), config)


def hf_weights(model_dir) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as transformers loads them (fp32), by our parameter names (q/k/v and gate/up
    fused)."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    out = {"embed_tokens.weight": sd["embed_tokens.weight"], "norm.weight": sd["norm.weight"]}
    out["lm_head.weight"] = sd.get("lm_head.weight", sd["embed_tokens.weight"])
    for i in range(hf.config.num_hidden_layers):
        p = f"layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight"):
            out[p + name] = sd[p + name]
        out[p + "mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"]
        for kind in ("weight", "bias"):
            parts = [sd.get(f"{p}self_attn.{m}_proj.{kind}") for m in "qkv"]
            if parts[0] is not None:
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
        )
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", False)])  # qwen2: biases
def test_weights_load_as_the_checkpoint_cast_to_the_dtype(tmp_path, dtype, arch, tied):
    model_dir = build_tiny_model(tmp_path, arch=arch, tied=tied)
    model = runner(model_dir, dtype=dtype).model
    want = hf_weights(model_dir)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(params) == set(want)
    for name, p in params.items():
        assert p.dtype == DTYPES[dtype] and p.device.type == "cpu", name
        assert torch.equal(p, want[name].to(DTYPES[dtype])), name
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    assert model.rope.cos.dtype == model.rope.sin.dtype == torch.float32  # the rotary tables stay fp32


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tied", [True, False])
def test_quantized_weights_come_from_the_checkpoints_values(tmp_path, name, dtype, tied):
    """Each projection's blocks are the fp32 checkpoint's quantized (not its values rounded to the dtype first),
    the lm_head's int8 blocks too (a tied one: the table's), and no float copy of them is kept."""
    model_dir = build_tiny_model(tmp_path, tied=tied)
    model = runner(model_dir, dtype=dtype, quantization=name).model
    want = hf_weights(model_dir)
    expected = {
        f"{n}.weight": FORMATS[name] for n, m in model.named_modules() if m in model.decoder_linears()
    }
    expected["lm_head.weight"] = INT8
    for weight_name, fmt in expected.items():
        layer = model.get_submodule(weight_name.removesuffix(".weight"))
        got, ref = layer.quantized, fmt.quantize(want[weight_name])
        assert got.format is fmt, weight_name
        assert torch.equal(got.data, ref.data) and torch.equal(got.scales, ref.scales), weight_name
        assert (got.mins is None and ref.mins is None) or torch.equal(got.mins, ref.mins), weight_name
        assert layer.weight.numel() == 0 and layer.weight.dtype == DTYPES[dtype], weight_name
    # the table keeps the checkpoint's values, in the dtype
    assert torch.equal(model.embed_tokens.weight, want["embed_tokens.weight"].to(DTYPES[dtype]))
    assert not any(p.is_meta for p in model.parameters())


def write_checkpoint(path, dtype=torch.float32):
    """A random Llama checkpoint of 28.6M parameters (115 MB in fp32), written without building a model."""
    cfg = LlamaConfig(
        vocab_size=16000, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=8, tie_word_embeddings=True, max_position_embeddings=512,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + n: (h,) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")})
        shapes.update({f"{p}self_attn.{m}_proj.weight": (h, h) for m in "qkvo"})
        shapes.update({f"{p}mlp.{m}_proj.weight": (inter, h) for m in ("gate", "up")})
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    save_file(
        {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}, str(path / "model.safetensors")
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_loading_needs_little_more_than_the_weights(tmp_path, dtype):
    """Peak resident memory while the model loads, in a fresh process, over the bytes of the loaded weights.
    It was 4.0x (bf16) and 2.0x (fp32): an fp32 model, a cast copy, and the mapped checkpoint; now the weights
    and a few MiB (8 MiB of a run of rows, 14% of this model in bf16)."""
    write_checkpoint(tmp_path)
    found = measure(dtype, str(tmp_path), None, num_kv_blocks=4)
    assert found["load_ratio"] < 1.5, found


def test_kv_cache_default_is_a_share_of_the_memory_on_cuda_a_fixed_size_on_cpu(monkeypatch):
    """On CUDA (read from the config alone: nothing touches a device) the KV cache takes what vLLM's default
    share leaves; on CPU the fixed size. An explicit size wins over the default share, an explicit share over
    both. (torch told it has a GPU: a device the machine lacks is refused, tests/api/test_flags.py)"""
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cuda = EngineConfig(device="cuda")
    assert cuda.memory_utilization == CUDA_GPU_MEMORY_UTILIZATION == 0.9
    fixed = EngineConfig(device="cuda", kv_cache_memory_gb=2.5)
    assert fixed.memory_utilization is None and fixed.kv_cache_gb == 2.5
    assert (
        EngineConfig(device="cuda", kv_cache_memory_gb=2.5, gpu_memory_utilization=0.5).memory_utilization
        == 0.5
    )
    cpu = EngineConfig(device="cpu")
    assert cpu.memory_utilization is None and cpu.kv_cache_gb == CPU_KV_CACHE_MEMORY_GB == 1.0
    assert EngineConfig(device="cpu", gpu_memory_utilization=0.3).memory_utilization == 0.3
    # the command line's defaults are the config's: `motet serve --device cuda` takes the share
    args = build_parser().parse_args(["serve", "--device", "cuda"])
    assert engine_config(args).memory_utilization == CUDA_GPU_MEMORY_UTILIZATION
    args = build_parser().parse_args(["serve", "--device", "cuda", "--kv-cache-memory-gb", "3"])
    assert engine_config(args).memory_utilization is None and engine_config(args).kv_cache_gb == 3
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        EngineConfig(kv_cache_memory_gb=0)


# -- warm-up ----------------------------------------------------------------------------------------------


def test_a_slow_load_tells_its_progress(tiny_model_dir, monkeypatch, caplog, tmp_path):
    """Quantizing on load was a minute of silence on a busy CPU: the load logs its share of the layers as it goes
    (here every layer: no wait between lines), then its time, and the native step's packing its own. Each says so
    as it begins (issue 57: the packing took 13-28 s before its one line, quantizing 35 s before its first)."""
    from motet.engine.weights import load_progress

    monkeypatch.setattr(load_progress, "EVERY_S", 0.0)
    monkeypatch.setenv("MOTET_WEIGHTS_CACHE_DIR", str(tmp_path))  # empty: prepared here, not mapped
    with caplog.at_level("INFO", logger="motet.engine"):
        ModelRunner(tiny_model_dir, load_model_config(tiny_model_dir), EngineConfig(
            model=str(tiny_model_dir), device="cpu", num_kv_blocks=4, quantization="int8"))  # fmt: skip
    said = [r.getMessage() for r in caplog.records]
    layers = load_model_config(tiny_model_dir).num_hidden_layers
    assert f"quantizing the weights to int8: 50% (1 of {layers} layers)" in " ".join(said), said
    assert any(m.startswith("quantizing the weights to int8: done in") for m in said), said
    assert any(m.startswith("packed the weights for the native CPU step in") for m in said), said
    starts = [
        f"quantizing the weights to int8 ({layers} layers, as they load) ...",
        f"packing the weights for the native CPU step ({layers} layers) ...",
    ]
    assert [m for m in said if m in starts] == starts, said  # each before its progress
    for start in starts:
        what = start.split(" (")[0]
        progress = next(
            i for i, m in enumerate(said) if m.startswith(f"{what}: 50% (1 of {layers} layers) in")
        )
        assert said.index(start) < progress, said


def test_the_engine_warms_up_before_its_first_step(tiny_model_dir, monkeypatch, caplog):
    calls = []
    warm_up, execute = ModelRunner.warm_up, ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: calls.append("warm_up") or warm_up(self))
    monkeypatch.setattr(ModelRunner, "execute", lambda self, *a: calls.append("execute") or execute(self, *a))
    with caplog.at_level("INFO", logger="motet.engine"):
        llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=32)
    assert calls == ["warm_up"]  # while the engine is built
    assert any(r.getMessage().startswith("warm-up: one token through the step in") for r in caplog.records)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    assert calls[:2] == ["warm_up", "execute"] and calls.count("warm_up") == 1


@pytest.mark.parametrize("compile_step", [True, False])
def test_warm_up_writes_no_kv_and_changes_no_output(tiny_model_dir, monkeypatch, compile_step):
    """The warm-up token writes nothing to the KV cache and samples nothing: sampled outputs (unseeded: the
    engine's random state) are those of an engine that did not warm up."""

    def outputs():
        llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=32, compile_step=compile_step)
        cold = all(not k.any() and not v.any() for k, v in llm.engine.runner.kv_caches)
        params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
        return cold, [o.token_ids for o in llm.generate([[5, 6, 7], [9] * 20], params)]

    warm = outputs()
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self: None)
    assert warm == outputs()
    assert warm[0]


def test_health_answers_200_only_once_the_engine_has_warmed_up(tiny_model_dir, monkeypatch):
    released, warming = threading.Event(), threading.Event()
    warm_up = ModelRunner.warm_up

    def slow_warm_up(self):
        warming.set()
        assert released.wait(60)
        warm_up(self)

    monkeypatch.setattr(ModelRunner, "warm_up", slow_warm_up)
    cfg = EngineConfig(model=str(tiny_model_dir), device="cpu", num_kv_blocks=32)
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir))
    with TestClient(create_app(ServerState(system, ["tiny"]))) as client:
        assert warming.wait(60)
        r = client.get("/health")  # llama.cpp's 503 while it loads, with the phase it is in (the warm-up)
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model", r.text
        assert r.json()["phase"] == "warming up the step"
        # Readiness checks that poll another route must not pass early either (vLLM's users poll /v1/models)
        body = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
        for r in (
            client.get("/v1/models"),
            client.get("/v1/models/tiny"),
            client.get("/v1/files"),
            client.post("/v1/completions", json=body),
            client.post("/tokenize", json={"model": "tiny", "prompt": "hi"}),
        ):
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] and r.json()["error"]["message"] == "Loading model"
            assert r.json()["error"]["type"] == "unavailable_error"
        assert client.get("/version").status_code == 200  # the probes answer
        assert client.get("/metrics").status_code == 200  # ... and the metrics, as they are while it loads
        assert client.get("/ping").status_code == 503  # ... /ping as /health does
        released.set()
        deadline = time.monotonic() + 60
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.get("/v1/models").status_code == 200


def test_capture_all_captures_every_base_bucket_largest_first(monkeypatch):
    """On CUDA the warm-up captures every decode bucket of the base model (the capture itself needs a GPU:
    tests/engine/test_cuda_graphs.py); a step then replays the graph of its bucket without capturing."""
    captured = []

    class Graph:
        def replay(self):
            pass

    def capture(self, key, lora):
        captured.append((key, lora))
        self.graphs[key], self.outputs[key] = Graph(), torch.zeros(key[0] * key[1], 4)

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    graphs = DecodeGraphs(lambda *a: None, max_batch=48, max_blocks_per_seq=4, max_seq_len=64, device="cpu")
    graphs.capture_all()
    assert captured == [((b, 1), None) for b in reversed(buckets(48))]
    assert graphs.slot_mapping.eq(-1).all()  # the buffers hold padding rows: no KV write while capturing
    graphs.run_rows([[1], [2], [3]], [0, 4, 9], [[0], [20], [41]], [[0], [1], [2]])
    assert len(captured) == len(buckets(48)) and graphs.replays == 1
    # speculating, verification rows of up to 1 + 2 tokens: their buckets too
    captured.clear()
    graphs = DecodeGraphs(
        lambda *a: None, max_batch=4, max_blocks_per_seq=4, max_seq_len=64, device="cpu", max_query=3
    )
    graphs.capture_all()
    assert captured == [((b, q), None) for b in (4, 2, 1) for q in (3, 2, 1)]


def test_warm_up_captures_the_graphs_where_there_are_graphs(tiny_model_dir, monkeypatch):
    r = runner(tiny_model_dir)

    class Graphs:
        graphs = {}

        def capture_all(self):
            self.graphs[(1,)] = "captured"

    monkeypatch.setattr(EagerSteps, "warm_up", lambda *a: pytest.fail("no eager step where graphs replay"))
    r.use_graphs(Graphs())
    r.warm_up()
    assert r.graphs.graphs == {(1,): "captured"}


def native_bf16_cpu() -> bool:
    """Whether this CPU's flags (/proc/cpuinfo, read here on its own) have AVX512_BF16, AMX or Arm's BF16."""
    from pathlib import Path

    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            break
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def test_serve_runs_bf16_where_the_cpu_computes_it_and_float32_stays_one_flag_away(motet_default_dtype):
    """`motet serve`'s default dtype is vLLM's `auto`: bf16 on a CPU whose flags have AVX512_BF16, AMX or Arm's
    BF16, float32 elsewhere; `--dtype float32` still serves float32."""
    native = native_bf16_cpu()
    parser = build_parser()
    auto = engine_config(parser.parse_args(["serve", "--device", "cpu"]))
    assert auto.dtype == ("bfloat16" if native else "float32")
    assert (
        engine_config(parser.parse_args(["serve", "--device", "cpu", "--dtype", "float32"])).dtype
        == "float32"
    )


def test_the_offline_entry_points_show_their_start_up(tiny_model_dir, tmp_path):
    """Issue 57: `LLM()` and `motet generate` were a minute of silence on a busy CPU (Python prints no log line
    below a warning where the application configured none): their start-up lines go to stderr, stdout keeping the
    answer alone; and `motet pull` finds a model it has without importing torch, so it prints the path at once."""
    import os
    import subprocess
    import sys

    from motet.engine.weights import model_store

    offline = f"from motet import LLM; LLM({str(tiny_model_dir)!r}, num_kv_blocks=8)"
    for cmd in (
        [sys.executable, "-c", offline],
        [sys.executable, "-m", "motet.api.cli", "generate", "--model", str(tiny_model_dir), "--prompt", "hi",
         "--max-tokens", "2", "--num-kv-blocks", "8", "--json"],
    ):  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        assert "motet.engine: warm-up: one token through the step in" in run.stderr, run.stderr
        assert "warm-up" not in run.stdout
    model = model_store.default_model_path(tmp_path / "cache")
    model.mkdir(parents=True)
    (model / model_store.COMPLETE_MARKER).write_text(model_store._marker())
    env = {**os.environ, "MOTET_CACHE_DIR": str(tmp_path / "cache")}
    pull = "import sys; from motet.api.cli import main; main(['pull']); print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", pull], capture_output=True, text=True, env=env, timeout=600)
    assert run.stdout.split() == [str(model), "False"], run.stderr


def test_llm_loads_in_serves_dtype_and_says_which(tiny_model_dir):
    """Issue 68, finding 16: `LLM()` loaded the default model in float32 (515 MiB) and logged no dtype where
    `motet serve` loaded bf16 (259 MiB) and said so: the offline API had its own default. Both now take
    EngineConfig's (auto: bf16 on a CPU whose flags have it, float32 elsewhere), and LLM's first line says which and
    why, as serve's does; dtype="float32" / "bfloat16" still load that, without a reason. In a fresh process:
    motet's own default, as a script gets it."""
    import subprocess
    import sys

    expected, other = ("bfloat16", "float32") if native_bf16_cpu() else ("float32", "bfloat16")
    script = (
        "import sys; from motet import LLM; "
        f"llm = LLM({str(tiny_model_dir)!r}, num_kv_blocks=8, **dict(a.split('=') for a in sys.argv[1:])); "
        "print(next(llm.engine.runner.model.parameters()).dtype)"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [f"torch.{expected}"]
    said = f'motet.engine: loading {tiny_model_dir} in {expected} (dtype="auto": this CPU '
    assert said in run.stderr and f'; dtype="{other}" for {other})' in run.stderr, run.stderr
    run = subprocess.run([sys.executable, "-c", script, f"dtype={other}"], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [f"torch.{other}"]
    assert f"motet.engine: loading {tiny_model_dir} in {other}\n" in run.stderr, run.stderr
