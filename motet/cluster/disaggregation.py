"""Prefill/decode disaggregation (`motet serve --prefill-replicas P --decode-replicas D`): which requests take
the prefill pool first, what a prefill replica runs, and what it answers. Plain data and rules: the ingress
(motet/cluster/cluster_system.py) and the replicas (motet/cluster/replica.py) do the calls.

    ingress --route--> a prefill replica (chosen by cached prefix): the prompt alone, max_tokens=1, greedy,
                       no grammar; when it finishes, its full blocks are written through to the shared KV tier
                       (motet/engine/core/kv_shared.py) and the replica answers PrefillDone once they are there
            --route--> a decode replica (chosen by load and adapter residency; the prompt's blocks in the shared
                       tier cost a load there, not a prefill): the request as the client sent it. Its engine
                       misses the prefix on the device, finds it in the shared tier (the KV connector's load),
                       computes the last partial block and decodes. Its stream is the client's response, so
                       usage, logprobs, grammars and adapters are those of colocated serving.

The prefill is an optimisation the decode replica never depends on: a prefill replica lost, refused, slow or
failing to write leaves blocks missing, which the decode replica computes. Requests that gain nothing skip it:
a prompt of fewer than MIN_PREFILL_BLOCKS full blocks (its prefill is a few rows of one step), one cut to its
last tokens or needing prompt logprobs (no prefix hit is allowed), and a multi-prompt request (each prompt is
its own route).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from motet.actors.messages import GenerateSpec
from motet.engine.sampling_params import SamplingParams

MIN_PREFILL_BLOCKS = 4  # full blocks of prompt below which a request is prefilled where it is decoded
PREFILL_SUFFIX = "-prefill"  # of the prefill request's id (the client's request id stays the decode's)


@dataclass
class PrefillDone:
    replica: str
    prompt_tokens: int
    shared_blocks: int  # the route's leading blocks the shared tier holds now (the decode replica loads them)
    seconds: float  # on the prefill replica: admission to the blocks being in the shared tier


def wants_prefill(specs: list[GenerateSpec], block_hashes: tuple[int, ...]) -> bool:
    if len(specs) != 1 or len(block_hashes) < MIN_PREFILL_BLOCKS:
        return False
    return all(p.prompt_logprobs is None for p in specs[0].params)


def prefill_spec(spec: GenerateSpec) -> GenerateSpec:
    """The request's prompt alone, for a prefill replica: one greedy token (discarded), nothing that could fail
    or cost besides the prompt; the same tenant, adapter and cache_salt, so its blocks are keyed as the decode
    replica will look them up."""
    params = SamplingParams(
        temperature=0, max_tokens=1, cache_salt=spec.params[0].cache_salt, ignore_eos=True, speculative=False
    )
    return dataclasses.replace(
        spec,
        request_ids=[spec.request_ids[0] + PREFILL_SUFFIX],
        params=[params],
        max_tokens=1,
        grammar_param=None,
    )
