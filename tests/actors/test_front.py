"""The API's front (motet/actors/front.py): both serving systems answer the same protocol; the model view
(motet/engine/model_view.py) is one shape whether read from a loaded engine or from the files a Ray replica is
built from, and agrees with Hugging Face's tokenizer and config; the ingress's preparation
(motet/actors/input_processor.py) gives HF's tokens from any number of threads at once."""

from __future__ import annotations

import dataclasses
import inspect
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from motet.actors.front import ServingFront
from motet.actors.input_processor import InputProcessor
from motet.actors.messages import GenerateSpec
from motet.actors.serving_errors import InvalidRequest
from motet.actors.system import ServingSystem
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from motet.engine.model_view import ModelView
from motet.engine.sampling_params import SamplingParams

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]


def _members(cls) -> dict[str, object]:
    return {k: v for k, v in vars(cls).items() if not k.startswith("_")}


def test_both_serving_systems_answer_the_front():
    pytest.importorskip("ray")
    from motet.cluster.cluster_system import ClusterSystem

    members = _members(ServingFront)
    assert {"model", "ready", "submit", "submit_all", "abort", "remove_lora", "stats", "run", "stop"} <= set(
        members
    )
    for system in (ServingSystem, ClusterSystem):
        for name, member in members.items():
            theirs = getattr(system, name, None)
            assert theirs is not None, f"{system.__name__} has no {name}"
            if isinstance(member, property):
                assert isinstance(theirs, property), f"{system.__name__}.{name}"
            else:
                assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(member), name
                assert list(inspect.signature(theirs).parameters) == list(
                    inspect.signature(member).parameters
                )
        assert not hasattr(system, "engine") or system is ServingSystem  # the Ray ingress holds no engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=4, max_model_len=256)
    engine = LLMEngine(config, model_dir=tiny_model_dir)
    yield engine
    engine.close()


def test_the_view_is_one_shape_here_and_behind_replicas(engine, tiny_model_dir):
    here = ModelView.of_engine(engine)
    there = ModelView.from_files(engine.config, tiny_model_dir)  # what the Ray ingress reads
    assert type(here) is type(there)
    same = [f.name for f in dataclasses.fields(ModelView) if f.name not in ("tokenizer", "adapter_capacity")]
    assert {k: getattr(here, k) for k in same} == {k: getattr(there, k) for k in same}
    assert here.adapter_capacity is not None and there.adapter_capacity is None  # replicas have their pools
    with pytest.raises(dataclasses.FrozenInstanceError):
        here.max_model_len = 1  # type: ignore[misc]

    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for view in (here, there):
        assert view.max_model_len == 256 and view.chat_template == hf.chat_template
        assert view.render_chat(CHAT) == text
        assert view.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert view.decode(hf.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=False)
        assert hf_config(tiny_model_dir)["architectures"][0] in view.family.names
    # no --max-model-len: the model's positions, as config.json says
    unbounded = ModelView.from_files(dataclasses.replace(engine.config, max_model_len=None), tiny_model_dir)
    assert unbounded.max_model_len == hf_config(tiny_model_dir)["max_position_embeddings"]


def hf_config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_preparation_gives_hf_tokens_from_many_threads(engine, tiny_model_dir):
    inputs = InputProcessor.of(engine, ModelView.of_engine(engine))
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers 5 answers a BatchEncoding
        expected = expected["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=4)
    specs = [
        GenerateSpec(
            [f"r-{i}"], [params], messages=CHAT, chat_template_kwargs={"add_generation_prompt": True}
        )
        for i in range(32)
    ]
    with ThreadPoolExecutor(8) as pool:
        prepared = list(pool.map(inputs.prompt, specs))
    assert all(ids == list(expected) for ids, _ in prepared)
    assert prepared[0][1] == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)

    long = GenerateSpec(["r"], [params], prompt="fox " * (256 * 32), prompt_param="prompt")
    with pytest.raises(InvalidRequest, match="characters long") as refused:
        inputs.prompt(long)
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"
