"""The messages the actors exchange. Plain dataclasses: what moves, not what to do with it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from motet.actors.reply import ReplyStream
from motet.engine.llm_engine import EngineStats
from motet.engine.outputs import OutputDelta
from motet.engine.request import EngineRequest
from motet.engine.sampling_params import SamplingParams
from motet.lora.manager import AdapterRef


# -- API -> ingress ---------------------------------------------------------------------------------------
@dataclass
class GenerateSpec:
    """One API request: a prompt (text, token ids or chat messages) and one SamplingParams per choice."""

    request_ids: list[str]  # one per choice (n)
    params: list[SamplingParams]
    tenant: str = "default"
    adapter: AdapterRef | None = None  # None: the base model
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    max_tokens: int | None = None  # None: the rest of the context window
    prompt_param: str = "prompt"  # the request field an error about the prompt names
    grammar_param: str | None = None  # the request field an error about the grammar names
    # How the prompt becomes tokens: the tokenizer's special tokens (BOS) added or not (None: added to a
    # text prompt, not to a chat, whose template writes them), and vLLM's truncate_prompt_tokens (keep the
    # last N tokens; -1: as many as fit; None: all).
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0  # vLLM's request priority (lower: sooner), among the tenant's own requests
    background: bool = False  # batch work: yields to interactive requests (motet/engine/core/latency.py)

    @property
    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


@dataclass
class Submit:
    specs: list[GenerateSpec]  # queued all or none; reply: list[Admission], one per spec


@dataclass
class Admission:
    prompt_token_ids: list[int]
    streams: list[ReplyStream]  # one per choice, in spec order
    prompt_text: str = ""  # the rendered prompt ("" for token-id prompts)
    # The ingress's own phases of the request, for its trace (motet/api/tracing.py): name, start and end
    # (perf_counter seconds) and attributes, e.g. ("adapter_load", t0, t1, {"motet.adapter.cached": True}).
    phases: list[tuple[str, float, float, dict]] = field(default_factory=list)


# -- ingress -> adapter queues -> scheduler ---------------------------------------------------------------
@dataclass
class QueuedRequest:
    """A request in the adapter queues: the engine's record, built once by the ingress, and its reply stream."""

    request: EngineRequest  # its adapter is also its queue's key
    stream: ReplyStream


@dataclass
class Enqueue:
    requests: list[QueuedRequest]  # all or none; reply: None, or raises QueueFull


@dataclass
class Take:
    """Scheduler -> adapter queues: pop requests one at a time, each from the tenant `pick` chooses among
    those with queued work (given as tenant -> its next request's prompt tokens), until it answers None.
    Reply: `Taken`."""

    pick: Callable[[Mapping[str, int]], str | None]


@dataclass
class Taken:
    requests: list[QueuedRequest]  # each tenant's oldest first (requests cancelled since may be among them)
    more: bool  # requests are still queued


@dataclass
class WorkQueued:
    """Adapter queues -> scheduler: requests are waiting to be taken."""


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
class Step:
    """Between steps: apply these changes, then run one engine step (if there is work)."""

    admit: list[EngineRequest] = field(default_factory=list)  # taken whole by engine.add
    aborts: list[str] = field(default_factory=list)
    removals: list[str] = field(default_factory=list)  # adapter names (the engine's)


@dataclass
class StepDone:
    outputs: list[OutputDelta]  # the step's, one a request it advanced
    refused: list[tuple[str, Exception]]  # admitted requests the engine would not take, and why
    stats: EngineStats  # after the step
    ran: bool  # a batch ran (False: nothing was schedulable)
    seconds: float = 0.0
