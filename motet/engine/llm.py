"""`LLM`: offline generation for scripts and tests, driving the engine's step to the end.

```python
from motet import LLM, SamplingParams

llm = LLM()                                        # the default model
params = SamplingParams(temperature=0, max_tokens=16)
hi = [{"role": "user", "content": "Hi"}]
outs = llm.chat(hi, params)                        # a conversation, through the chat template
outs = llm.generate(["Once upon a time"], params)  # raw texts (or token ids), continued without a template
llm.add_lora("upper", "adapters/upper")            # optional: PEFT adapters, by name
outs = llm.chat(hi, params, adapters=["upper"])
print(outs[0].text)
```

An instruct model (the default one) answers through its chat template: given a bare question, `generate` often
ends at once (an empty text), the end of turn being the likeliest token after it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

from motet.engine.config import DEFAULT_DTYPE, EngineConfig, loaded_dtype
from motet.engine.llm_engine import LLMEngine
from motet.engine.outputs import RequestOutput, RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.engine.weights import load_progress
from motet.lora.manager import AdapterRef

log = logging.getLogger("motet.engine")


class LLM:
    """The engine of `model` (a name, a checkpoint directory or a GGUF file, as `motet serve --model`; None: the
    default model) with `engine_options` (EngineConfig's fields, e.g. `dtype`, `quantization`, `num_kv_blocks`).
    It loads in `motet serve`'s dtype unless told (`dtype="auto"`: bfloat16 where the device computes it natively,
    else float32), and its first line says which, and why."""

    def __init__(self, model: str | None = None, **engine_options):
        load_progress.show_on_stderr()  # where the application configured no logging: a slow start is not silence
        config = EngineConfig(model=model or EngineConfig.model, **engine_options)
        asked = engine_options.get("dtype", DEFAULT_DTYPE)
        log.info("loading %s in %s", config.model, loaded_dtype(config, asked, option='dtype="{}"'))
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
        """Register the PEFT LoRA adapter directory `path` as `name`, for `generate`'s and `chat`'s `adapters`."""
        return self.engine.add_lora(name, path)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        adapters: Seq[AdapterRef | str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt to the end; `adapters` gives each prompt's adapter (a name or a ref). Each
        answer is whole: the engine's deltas accumulated (motet/engine/outputs.py)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
        engine, answers = self.engine, RequestOutputs()
        ids = [
            engine.add_request(p, sp, adapter=adapters[i] if adapters else None)
            for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True))
        ]
        for i in ids:
            answers.track(i, engine.requests[i].prompt_token_ids)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in answers.add(engine.step()):
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        adapters: Seq[AdapterRef | str | None] | None = None,
        **template_options,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of `{"role", "content"}` messages) or several, each rendered by the
        model's chat template with the assistant's turn opened (`template_options` go to the template, e.g.
        `enable_thinking=False`); then as `generate`."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode_chat(c, **template_options) for c in conversations]
        return self.generate(prompts, params, adapters)
