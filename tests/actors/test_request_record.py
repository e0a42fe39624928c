"""One request record from the ingress to the engine (motet/engine/request.py), and the one rule that says how a
refused request is answered (motet/actors/serving_errors.py)."""

from __future__ import annotations

import anyio
import pytest
from transformers import AutoTokenizer

from motet.actors.messages import GenerateSpec
from motet.actors.serving_errors import (
    EngineFailure,
    InvalidRequest,
    ModelNotFound,
    ServerBusy,
    model_not_found,
    request_refusal,
)
from motet.actors.system import ServingSystem
from motet.engine.request import EngineRequest
from motet.engine.request_checks import RequestError
from motet.engine.sampling_params import SamplingParams
from motet.grammar.specs import GrammarError, JsonObjectSpec
from motet.lora.adapter import AdapterError
from motet.lora.manager import VERSION_STAMP, AdapterRef
from tests.actors.test_actors import _engine_factory


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_the_engine_takes_the_record_the_ingress_built(tiny_model_dir):
    """No max_tokens: the rest of the context window (vLLM's default); bad_words as the HF tokenizer's tokens (as
    vLLM resolves them: the word alone and after a space); the API's own params are left as they were."""
    system = ServingSystem(_engine_factory(tiny_model_dir, max_model_len=256))
    prompt, word = "The quick brown fox", "lazy"
    asked = SamplingParams(temperature=0, bad_words=[word], ignore_eos=True, speculative=False)
    spec = GenerateSpec(["r-0", "r-1"], [asked, asked], tenant="acme", prompt=prompt, priority=2)
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with anyio.create_task_group() as tg:
        await tg.start(system.run)
        adm = await system.submit(spec)
        await adm.streams[0].get()
        seqs = {s.request_id: s for s in system.executor.engine.requests.values()}
        ids = hf.encode(prompt)
        for rid in ("r-0", "r-1"):
            seq = seqs[rid]
            assert seq.prompt_token_ids == ids and (seq.tenant, seq.order.priority) == ("acme", 2)
            assert seq.params.max_tokens == 256 - len(ids)
            alone, spaced = (hf.encode(w, add_special_tokens=False) for w in (word, " " + word))
            expected = [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
            assert seq.params.bad_words_token_ids == expected
        assert asked.max_tokens == SamplingParams().max_tokens and asked.bad_words_token_ids is None
        for rid in ("r-0", "r-1"):
            system.abort(rid)
        await system.stop()


def test_a_record_carries_its_grammar_compiled():
    params = SamplingParams(grammar=JsonObjectSpec())
    with pytest.raises(ValueError, match="compiled"):
        EngineRequest("r", [1, 2], params)
    record = EngineRequest("r", [1, 2], SamplingParams())
    with pytest.raises(AttributeError):  # frozen
        record.priority = 3


def test_a_refusal_is_the_adapters_the_requests_or_the_servers(tmp_path):
    """HTTP's meanings: 404 for an adapter whose files changed since the request named it, 400 for one that
    does not fit and for the request's own fault (naming its field), 500 for the server's."""
    (tmp_path / VERSION_STAMP).write_text("v1")
    ref = AdapterRef.of("t/a", tmp_path)
    mismatch = request_refusal(AdapterError("rank 64 is above max_lora_rank 16"), ref)
    assert isinstance(mismatch, InvalidRequest) and (mismatch.status, mismatch.code) == (
        400,
        "adapter_mismatch",
    )
    (tmp_path / VERSION_STAMP).write_text("v2")  # replaced since
    gone = request_refusal(AdapterError("adapter 'a' was removed"), ref)
    assert isinstance(gone, ModelNotFound) and (gone.status, gone.code, gone.param) == (
        404,
        "model_not_found",
        "model",
    )
    too_long = request_refusal(RequestError("too long", "prompt", "context_length_exceeded"))
    assert (too_long.status, too_long.param, too_long.code) == (400, "prompt", "context_length_exceeded")
    assert request_refusal(ValueError("request id 'x' is already in use")).status == 400
    broken = request_refusal(RuntimeError("CUDA error"))
    assert isinstance(broken, EngineFailure) and broken.status == 500


def test_a_grammar_or_template_refusal_is_decided_where_the_others_are():
    """The ingress's grammar and chat-template refusals go through `request_refusal` too (docs/layout.md: a
    request's refusal is decided in one place): 400 naming the field, 503 (the tenant's own compilations past their
    time limit still running) for a busy compiler; OpenAI's error shape needs the param either way."""
    bad = request_refusal(GrammarError("unsupported keyword 'if'", "unsupported"), param="response_format")
    assert isinstance(bad, InvalidRequest) and (bad.status, bad.param) == (400, "response_format")
    assert bad.message == "response_format: unsupported keyword 'if'"
    busy = request_refusal(GrammarError("3 compilations still run", "busy"), param="tools")
    assert isinstance(busy, ServerBusy) and (busy.status, busy.param) == (503, "tools")
    template = request_refusal(ValueError("the template raised: 'x' is undefined"), param="chat_template")
    assert isinstance(template, InvalidRequest) and (template.status, template.param) == (
        400,
        "chat_template",
    )
    gone = model_not_found("my-adapter")  # a replica's: its shared store no longer has the adapter
    assert isinstance(gone, ModelNotFound) and (gone.status, gone.param, gone.code) == (
        404,
        "model",
        "model_not_found",
    )
