"""`LLM`: offline generation for scripts and tests, driving the engine's step to the end.

llm = LLM()                                        # the default model
llm.add_lora("upper", "adapters/upper")            # optional: PEFT adapters, by name
outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16), adapters=["upper"])
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine, RequestOutput
from motet.engine.sampling_params import SamplingParams
from motet.lora.manager import AdapterRef


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        config = EngineConfig(model=model or EngineConfig.model, **engine_options)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any (also on leaving a `with` block)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_lora(self, name: str, path) -> AdapterRef:
        return self.engine.add_lora(name, path)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        adapters: Seq[AdapterRef | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt to the end; `adapters` gives each prompt's adapter (a name or a ref)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
        ids = [
            self.engine.add_request(p, sp, adapter=adapters[i] if adapters else None)
            for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True))
        ]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def chat(self, conversations, params=None, **kw) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode_chat(c, **kw) for c in conversations]
        return self.generate(prompts, params)
