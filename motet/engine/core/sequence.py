"""A sequence: one request inside the engine (one choice of an API request). Its prompt and growing output,
the scheduler's bookkeeping (KV blocks, computed tokens); its grammar is the structured outputs' and its text (the detokenizer, the stop
strings, the timestamps) is the output commit's (motet/engine/output_commit.py `TextState`)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from motet.engine.core.step_plan import SampledRef
from motet.engine.outputs import TokenLogprob
from motet.engine.request import EngineRequest
from motet.engine.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CacheScope:
    """Which prefix cache a sequence's blocks hash into, and by which RoPE factors its tokens turn."""

    salt: int = 0  # whose prefix cache it is (block_manager.prefix_salt); part of every block's hash
    # LongRoPE (motet/engine/worker/model.py's RotaryEmbedding): whether all its tokens turn by the long factors
    # (a prompt past the original context, or since it grew past it); while they do not, the original context
    # and its prefix salt past it, which the scheduler switches to as it recomputes the sequence there
    long_rope: bool = False
    switch: tuple[int, int] | None = None

    def switch_to_long(self) -> None:
        self.salt, self.long_rope, self.switch = self.switch[1], True, None


@dataclass
class QueueOrder:
    """A sequence's place in the scheduler's order (motet/engine/core/scheduler.py)."""

    arrival: int = 0  # tie-breaker: the engine's count of requests added
    # vLLM's request priority (lower: sooner), among its tenant's own requests only: it trades places in the
    # scheduler's order with them
    priority: int = 0
    place: tuple[int, int] | None = None  # the place it holds as traded; None: the one its arrival gives it


@dataclass
class Sequence:
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    adapter_id: int = 0  # 0: the base model; part of the prefix-cache hash
    cache: CacheScope = field(default_factory=CacheScope)  # whose prefix cache, and which RoPE
    seq_id: int = field(default_factory=lambda: next(_ids))
    request_id: str | None = None
    tenant: str | None = None  # whose request: the scheduler shares the engine fairly between tenants
    order: QueueOrder = field(default_factory=QueueOrder)
    # Batch work (the Batch API's lines, service_tier "flex", a tenant of the batch class): never latency-bound,
    # it yields its rows to interactive requests (motet/engine/core/latency.py).
    background: bool = False

    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    # Tokens sampled by launched steps and not appended yet (an overlapped engine advances a row when it launches
    # its step: the scheduler may schedule the pending token's successor before the token reaches the host).
    num_pending: int = 0
    # Where its latest sampling step leaves its token on the device (set as it is scheduled): the next step may
    # take the token as its input before it reaches the host.
    pending: SampledRef | None = None
    # Of its prompt's tokens, how many came from the prefix cache (the device's or a KV tier's) as it was first
    # admitted: usage's cached_tokens. A sequence recomputed after a preemption (or LongRoPE's switch past the
    # original context) finds its own blocks, its outputs' too, which are no prompt tokens served from the cache:
    # that hit is not counted (vLLM counts the first admission's alone too).
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    window_blocks: list[int] = field(
        default_factory=list
    )  # its sliding-window layers' ring (engine/core/kv_window.py)
    status: SequenceStatus = SequenceStatus.WAITING
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_preemptions: int = 0
    # Speculation: the drafts this step verifies after the last token (set by the engine's proposers, trimmed by the
    # scheduler to its budget, cleared when the step commits); the proposers keep their own per-request state
    # (motet/engine/speculative/proposer.py).
    draft_token_ids: list[int] = field(default_factory=list)
    # Whether its ending is decided by its tokens alone: no grammar (the structured outputs' state,
    # motet/engine/structured_output.py) and no stop matcher that reads its text (the output commit's), so that its
    # text may be made later, while the next step computes (the others' are made as their step lands).
    decided_by_tokens: bool = True

    @classmethod
    def from_request(
        cls, request: EngineRequest, adapter_id: int, cache: CacheScope, arrival: int, decided_by_tokens: bool
    ) -> Sequence:
        """The scheduler's record of a request the engine took (`LLMEngine.add`)."""
        return cls(
            list(request.prompt_token_ids),
            request.params,
            adapter_id=adapter_id,
            cache=cache,
            request_id=request.request_id,
            tenant=request.tenant,
            order=QueueOrder(arrival, request.priority),
            background=request.background,
            decided_by_tokens=decided_by_tokens,
        )

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens, appended or pending, whose KV is not computed yet: what the scheduler may schedule."""
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
