"""The messages the actors exchange. Plain dataclasses: what moves, not what to do with it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from actors.reply import ReplyStream
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from grammar.backend import CompiledGrammar


# -- API -> ingress ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoraRef:
    """The adapter a request uses. The scheduler registers it with the engine the first time it is
    used, and again when `version` grows (the adapter was deleted and uploaded anew under the name)."""

    name: str  # the engine's name: "tenant/name" for uploads, plain "name" for --lora adapters
    path: Path
    version: int = 0

    @property
    def model(self) -> str:
        """The name clients use."""
        return self.name.rsplit("/", 1)[-1]


@dataclass
class GenerateSpec:
    """One API request: a prompt (text, token ids or chat messages) and one SamplingParams per choice."""

    request_ids: list[str]  # one per choice (n)
    params: list[SamplingParams]
    tenant: str = "default"
    adapter: LoraRef | None = None  # None: the base model
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    max_tokens: int | None = None  # None: the rest of the context window
    prompt_param: str = "prompt"  # the request field an error about the prompt names
    grammar_param: str | None = None  # the request field an error about the grammar names


@dataclass
class Submit:
    specs: list[GenerateSpec]  # queued all or none; reply: list[Admission], one per spec


@dataclass
class Admission:
    prompt_token_ids: list[int]
    streams: list[ReplyStream]  # one per choice, in spec order
    prompt_text: str = ""  # the rendered prompt ("" for token-id prompts)


# -- ingress -> adapter queues -> scheduler ---------------------------------------------------------------
@dataclass
class QueuedRequest:
    request_id: str
    tenant: str
    adapter: LoraRef | None  # also the adapter queue's key (tests use plain ints)
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: ReplyStream
    fault: bool = False  # test-only: the executor raises on this request's batches
    grammar: CompiledGrammar | None = None  # params.grammar, compiled by the ingress
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class Enqueue:
    requests: list[QueuedRequest]  # all or none; reply: None, or raises QueueFull


@dataclass
class Take:
    """Pop up to `max_requests`, each time from the tenant `pick` chooses among those with work."""

    max_requests: int
    pick: Callable[[Iterable[str]], str | None]  # reply: list[QueuedRequest] (cancelled ones included)


@dataclass
class WorkQueued:
    """Queues -> scheduler: requests of these tenants arrived, or were dropped while queued (cancelled)."""

    arrived: list[str]
    dropped: list[str] = field(default_factory=list)


@dataclass
class Cancel:
    """API -> adapter queues: these requests' clients went away; drop them if still queued."""

    request_ids: list[str]


@dataclass
class Abort:
    request_id: str


@dataclass
class RemoveLora:
    """API -> scheduler: an adapter was deleted; requests already using it finish."""

    name: str  # the engine's name


# -- scheduler -> executor --------------------------------------------------------------------------------
@dataclass
class Execute:
    batch: ScheduledBatch
    faulty: frozenset[str] = frozenset()  # test-only fault injection


@dataclass
class Executed:
    """The part of the batch that ran, its result, and the sequences whose execution raised."""

    batch: ScheduledBatch
    result: object  # engine.model_runner.StepResult
    failed: list[tuple[Sequence, BaseException]] = field(default_factory=list)
    seconds: float = 0.0
