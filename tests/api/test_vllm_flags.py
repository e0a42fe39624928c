"""`vllm serve`'s flags on `motet serve`: the parser reads them as motet's own, a real `motet serve` subprocess
started with a vLLM command line serves (its adapter checked against PEFT), `--api-key` composes with
`--api-keys`, and `--gpu-memory-utilization` sizes the KV cache within the host memory available."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from motet.api.cli import build_parser, engine_config, main
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from motet.engine.worker.memory import available_host_memory
from motet.engine.worker.model_runner import kv_block_bytes
from motet.models.declaration import ModelLoadError
from tests.live_server import Server, ThreadServer
from tests.peft_adapters import make_adapter

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_a_vllm_command_line_reads_as_motets_flags():
    args = parse(
        "some/model", "--lora-modules", "a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}',
        "--lora", "c=/z", "--enable-lora", "--api-key", "K", "--gpu-memory-utilization", "0.5",
        "--served-model-name", "m1", "m2", "--trust-request-chat-template",
    )  # fmt: skip
    config = engine_config(args)
    assert config.model == "some/model" and config.gpu_memory_utilization == 0.5
    assert args.lora == ["a=/x", "b=/y", "c=/z"] and args.enable_lora and args.api_key == "K"
    assert args.served_model_name == ["m1", "m2"] and args.trust_request_chat_template
    assert engine_config(parse("--model", "other")).model == "other"
    assert engine_config(parse("same", "--model", "same")).model == "same"


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--lora-modules", "no-path"], "--lora-modules"),
        (["--lora-modules", '{"name": "a"}'], "--lora-modules"),
        (["--lora-modules", '{"name": "a", "path": "/p", "rank": 8}'], "--lora-modules"),
        (["--lora-modules", "{not json"], "--lora-modules"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "1.01"], "--gpu-memory-utilization"),
    ],
)
def test_bad_vllm_flags_are_refused_in_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0], err


def test_the_model_given_twice_is_refused(capsys):
    assert main(["serve", "model-a", "--model", "model-b"]) == 2
    err = capsys.readouterr().err
    assert "given twice" in err and "model-a" in err and "model-b" in err


def test_a_vllm_command_line_serves(tiny_model_dir, tmp_path):
    adapter = make_adapter(tiny_model_dir, tmp_path / "upper", seed=3)
    module = json.dumps({"name": "upper", "path": str(adapter)})
    srv = Server(
        tmp_path, str(tiny_model_dir), "--served-model-name", "tiny", "--api-key", "sk-vllm", "--enable-lora",
        "--lora-modules", module, "--gpu-memory-utilization", "0.02", "--data-dir", str(tmp_path / "data"),
        "--threads", "1",
    )  # fmt: skip
    try:
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        key = {"Authorization": "Bearer sk-vllm"}
        models = httpx.get(f"{srv.url}/v1/models", headers=key).json()["data"]
        assert {"tiny", "upper"} <= {m["id"] for m in models}
        assert httpx.get(f"{srv.url}/metrics", headers=key).status_code == 200  # vLLM's key reads /metrics
        body = {"model": "upper", "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}  # fmt: skip
        r = httpx.post(f"{srv.url}/v1/completions", json=body, headers=key, timeout=120)
        assert r.status_code == 200, r.text
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, adapter).eval()
        ref = peft.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert r.json()["choices"][0]["token_ids"] == ref[0, 4:].tolist()
    finally:
        srv.stop()


def test_api_key_beside_api_keys(tiny_model_dir, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-alice": "alice"}))
    srv = ThreadServer(
        "--model", str(tiny_model_dir), "--api-keys", str(keys), "--api-key", "sk-vllm", "--num-kv-blocks", "64",
        "--data-dir", str(tmp_path / "data"),
    )  # fmt: skip
    try:
        url = srv.url
        for key in ("sk-alice", "sk-vllm"):
            r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk-vllm"}).status_code == 200
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sk-alice"}).status_code == 403
        assert srv.state.auth.principal("Bearer sk-vllm").tenant == "default"
        assert srv.state.auth.principal("Bearer sk-alice").tenant == "alice"
    finally:
        srv.stop()
    keys.write_text(json.dumps({"sk-vllm": "bob"}))
    with pytest.raises(ValueError, match="--api-key"):
        ThreadServer("--model", str(tiny_model_dir), "--api-keys", str(keys), "--api-key", "sk-vllm")


def test_gpu_memory_utilization_sizes_the_kv_cache_on_cpu(tiny_model_dir):
    available = available_host_memory()
    config = EngineConfig(model=str(tiny_model_dir), device="cpu", gpu_memory_utilization=0.01)
    engine = LLMEngine(config, model_dir=tiny_model_dir)
    kv = engine.runner.num_blocks * kv_block_bytes(
        engine.model_config, config.block_size, engine.runner.dtype.itemsize
    )
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    share = 0.01 * available
    assert kv + weights <= share * 1.05  # within the share (the host's use moves a little meanwhile)
    assert kv >= share * 0.5 - weights  # and most of it: the tiny model's weights and steps are small
    # --num-kv-blocks wins; a share too small for anything is refused, naming the flag
    config = EngineConfig(
        model=str(tiny_model_dir), device="cpu", gpu_memory_utilization=0.01, num_kv_blocks=7
    )
    assert LLMEngine(config, model_dir=tiny_model_dir).runner.num_blocks == 7
    with pytest.raises(ModelLoadError, match="--gpu-memory-utilization"):
        LLMEngine(
            EngineConfig(model=str(tiny_model_dir), gpu_memory_utilization=1e-9), model_dir=tiny_model_dir
        )
