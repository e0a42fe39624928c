"""A request as the engine takes it: one frozen record, built once and carried whole (vLLM V1's EngineCoreRequest).

The serving ingress builds it (motet/actors/ingress_actor.py: tokenized, validated, its adapter loaded and its
grammar compiled), the adapter queues and the scheduler's `Step` carry it, and `LLMEngine.add` takes it; offline,
`LLMEngine.add_request` builds it from a prompt and SamplingParams. Its params are final when it is built.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from motet.engine.sampling_params import SamplingParams
from motet.grammar.backend import CompiledGrammar
from motet.lora.manager import AdapterRef


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]  # (not copied: whoever built the record no longer changes it)
    params: SamplingParams  # final: bad_words as token ids, max_tokens set (`final_params`)
    adapter: AdapterRef | None = None  # None: the base model
    grammar: CompiledGrammar | None = None  # params.grammar, compiled
    # Whose request it is (None: the offline engine's, which has no tenants): tenants share the engine by
    # weight (motet/engine/core/fairness.py) and each its own prefix-cache blocks and speculation history.
    tenant: str | None = None
    priority: int = 0  # vLLM's (lower: sooner), among the tenant's own requests
    background: bool = False  # batch work: yields to interactive requests (motet/engine/core/latency.py)
    arrival_time: float = field(default_factory=time.monotonic)  # time.monotonic(): its queue time's start

    def __post_init__(self):
        if self.params.grammar is not None and self.grammar is None:
            raise ValueError(f"request {self.request_id!r}: its grammar must come compiled")


def final_params(
    params: SamplingParams,
    max_tokens: int | None = None,
    bad_words_token_ids: list[list[int]] | None = None,
) -> SamplingParams:
    """`params` as a record carries them, in one copy (the caller's own are never changed): with `max_tokens`
    (where the request left it to the context window) and `bad_words_token_ids` (from the engine's tokenizer),
    where given."""
    changes = {}
    if max_tokens is not None:
        changes["max_tokens"] = max_tokens
    if bad_words_token_ids is not None:
        changes["bad_words_token_ids"] = bad_words_token_ids
    return dataclasses.replace(params, **changes) if changes else params
