"""Driving an engine to the end in tests that compare two ways of running the same requests (graphs vs eager,
a kernel vs the reference): each request's tokens, keyed by its prompt."""

from __future__ import annotations

from collections.abc import Sequence

from motet.engine.outputs import RequestOutputs


def finished_tokens(engine) -> dict[tuple[int, ...], list[int]]:
    """Step `engine` until it drains; each finished request's output tokens, keyed by its prompt's."""
    tokens, answers = {}, RequestOutputs()
    while engine.has_unfinished():
        for out in answers.step(engine):
            if out.finished:
                tokens[tuple(out.prompt_token_ids)] = list(out.token_ids)
    return tokens


def mixed_adapter_tokens(engine, prompts, params, adapters: int = 0, tmp_path=None) -> dict:
    """`prompts` run to the end on `engine` (`finished_tokens`), with `adapters` random rank-8 adapters (seeds
    0, 1, ...) written under `tmp_path` and spread over them: prompt i on adapter i % 3 where there is one, else
    the base model. `params` is one SamplingParams or one per prompt."""
    from motet.evals.lora_reference import write_random_adapter

    names = [
        engine.add_lora(f"a{i}", write_random_adapter(tmp_path / f"a{i}", engine.model_config, 8, seed=i))
        for i in range(adapters)
    ]
    each = params if isinstance(params, Sequence) else [params] * len(prompts)
    for i, (p, ps) in enumerate(zip(prompts, each, strict=True)):
        engine.add_request(p, ps, adapter=names[i % 3] if i % 3 < adapters else None)
    return finished_tokens(engine)
