"""The API's one door into serving: the `ServingFront` protocol, modelled on vLLM V1's EngineClient, which the
local serving system (motet/actors/system.py, the actors and an engine in this process) and the Ray one
(motet/cluster/cluster_system.py, engine replicas behind an ingress) both implement, and the load figures
it answers with.

The API calls nothing else of a serving system (tests/test_manual_relations.py): requests go in through
`submit_all` (the routes', motet/api/completions/generation.py; `submit` is one prompt's, for scripts and tests),
their tokens come back on the admissions' reply streams, and they leave early through `abort`; adapters are dropped
through `remove_lora`; `stats` is the load; and everything the API knows of the model (tokenizer, chat
template, family, limits) is `model`, a frozen ModelView (motet/engine/model_view.py) that exists once the
system is `ready`. No route reaches into an engine: under Ray there is none in the API's process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from motet.actors.messages import Admission, GenerateSpec
from motet.engine.llm_engine import EngineStats
from motet.engine.model_view import ModelView

if TYPE_CHECKING:
    from anyio.abc import TaskStatus


@dataclass(frozen=True)
class TenantStats:
    """A tenant with requests in the server, for an admin's /metrics."""

    tenant: str
    position: int  # in the order tenants are served next (0: first)
    virtual_tokens: float  # its virtual token counter: weighted tokens served, over its weight
    queued: int  # requests in the adapter queues
    waiting: int  # admitted to the engine, not yet running
    running: int


@dataclass(frozen=True)
class Stats(EngineStats):
    """The serving system's load: the engine's stats as of its latest step, with the requests still in the adapter
    queues, and each tenant's place counting those too."""

    queued: int = 0  # requests in the adapter queues, not yet admitted
    queued_adapters: tuple[str, ...] = ()  # adapters of requests in the adapter queues
    tenants: tuple[TenantStats, ...] = ()  # in the order they are served next (one replica's engine only)


class ServingFront(Protocol):
    """What the API calls on a serving system. Every method is called on the event loop; `abort`, `remove_lora`
    and `stats` never block."""

    @property
    def model(self) -> ModelView:
        """The served model (tokenizer, chat template, family, limits); only once `ready`."""
        ...

    @property
    def ready(self) -> bool:
        """Started and not stopped: requests may be submitted."""
        ...

    async def run(self, *, task_status: TaskStatus = ...) -> None:
        """Serve until `stop`; `task_status.started()` once ready."""
        ...

    async def stop(self) -> None: ...

    async def submit(self, spec: GenerateSpec) -> Admission:
        """Prepare (chat template, tokens, limits, adapter, grammar) and queue one prompt's request; its tokens
        come on the admission's reply streams. Raises a ServingError (motet/actors/serving_errors.py) when
        refused."""
        ...

    async def submit_all(self, specs: list[GenerateSpec]) -> list[Admission]:
        """Several prompts of one API request: every one is queued, or none is."""
        ...

    def abort(self, request_id: str) -> None:
        """The client went away: the request stops (queued or running) and frees what it holds."""
        ...

    def remove_lora(self, name: str) -> None:
        """New requests for the adapter `name` are refused; requests already using it finish."""
        ...

    def stats(self) -> Stats:
        """The load as of the latest step (behind --replicas: the replicas' latest reports, summed)."""
        ...
