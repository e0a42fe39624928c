"""What every handler needs: the serving system (a ServingFront, motet/actors/front.py: the model as `system.model`,
requests through `system.submit_all`), the served model's names, auth, metrics, the API's own limits, lifecycle."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from motet.actors.front import ServingFront
from motet.actors.reply import ReplyStream
from motet.api.auth import Authenticator
from motet.api.errors import APIError, echo
from motet.api.metrics import Metrics
from motet.api.rate_limits import RateLimiter
from motet.api.starting import LOADING_MESSAGE, LOADING_TYPE, RETRY_AFTER_S, loading_body
from motet.api.usage import UsageStore
from motet.grammar.limits import GrammarLimits
from motet.lora.manager import AdapterRef

if TYPE_CHECKING:  # the families' stores: each family's routes read ServerState, so a runtime import would
    # make a cycle between the family's package and this module (the server builds the stores: api/server.py)
    from motet.api.adapters.store import AdapterStore
    from motet.api.batches.runner import BatchRunner
    from motet.api.files.store import FileStore
    from motet.api.fine_tuning.runner import FineTuningRunner
    from motet.api.responses.store import ResponseStore


class InFlight:
    """The generating requests a drain waits for, by their reply streams (each handler's list, which
    motet/api/streams.py holds in here while the request runs): a drain past its deadline ends them."""

    def __init__(self):
        self._held: list[list[ReplyStream]] = []  # a request's, once a holder (its handler, its response)

    def __len__(self) -> int:
        return len(self._held)

    def enter(self, streams: list[ReplyStream]) -> None:
        self._held.append(streams)

    def leave(self, streams: list[ReplyStream]) -> None:
        del self._held[next(i for i, held in enumerate(self._held) if held is streams)]

    def requests(self) -> list[list[ReplyStream]]:
        """Each request's reply streams, once (by identity: two requests' lists may be equal)."""
        return list({id(held): held for held in self._held}.values())


MODELS_NAMED = 20  # in a model_not_found message; a tenant may have thousands of adapters


class ModelLoading(APIError):
    """503 while the model loads: llama.cpp's body (motet/api/starting.py `loading_body`, which answers before this
    app is built), with the start-up's phase where `progress` (the health probes)."""

    def __init__(self, progress: bool = False):
        super().__init__(
            503, LOADING_MESSAGE, code=503, type=LOADING_TYPE, headers={"Retry-After": str(RETRY_AFTER_S)}
        )
        self.progress = progress

    def body(self) -> dict:
        return loading_body(self.progress)


@dataclass
class ServerState:
    system: ServingFront  # the API's one door into serving; it reaches no engine
    model_names: list[str]  # the first is the served name, the others are accepted aliases
    auth: Authenticator = field(default_factory=Authenticator)
    metrics: Metrics = field(default_factory=Metrics)
    max_body_bytes: int = 4 << 20
    adapters: AdapterStore | None = None  # None: no adapter uploads (in-process tests)
    responses: ResponseStore | None = None  # stored Responses API responses; None: none are stored
    files: FileStore | None = None  # /v1/files; None: no files API
    batches: BatchRunner | None = None  # /v1/batches (with its store); None: no batch API
    fine_tuning: FineTuningRunner | None = (
        None  # /v1/fine_tuning/jobs (with its store); None: no fine-tuning API
    )
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set on SIGTERM: new requests get 503, in-flight ones finish
    inflight: InFlight = field(default_factory=InFlight)  # the generating requests (a drain waits for them)
    fatal: BaseException | None = None  # start-up failed (e.g. the model could not be loaded)
    # --reasoning-parser (motet/grammar/reasoning.py): the model's reasoning becomes reasoning_content; "none": off;
    # None: the model family's, else the chat template's
    reasoning_parser: str | None = None
    tool_call_parser: str | None = (
        None  # --tool-call-parser (motet/grammar/tool_formats/); None: the template's
    )
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request may bring its own
    # what a request that omits a sampling field gets (motet/api/generation_config.py): request field -> value
    sampling_defaults: dict = field(default_factory=dict)
    limiter: RateLimiter = field(default_factory=RateLimiter)  # per-tenant limits (motet/api/rate_limits.py)
    on_stop: list = field(default_factory=list)  # callables run when the server stops (after the system)
    usage: UsageStore | None = None  # tenants' usage by model and minute (motet/api/usage.py); None: not kept
    # Sizes of a request's schema / grammar refused before it is compiled (motet/grammar/limits.py has the
    # defaults; `motet serve --grammar-max-*`): the API checks them as it reads response_format and tools.
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)

    def __post_init__(self):
        self.metrics.model_name = self.model_name
        if not isinstance(self.grammar_limits, GrammarLimits):
            raise ValueError(
                f"grammar_limits must be a GrammarLimits, got {type(self.grammar_limits).__name__}"
            )

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_loaded(self, progress: bool = False) -> None:
        """Every route but the probes answers 503 until the model has loaded (llama.cpp's "Loading model", with
        a Retry-After; `progress`: with the start-up's phase, as /health answers): a readiness check that polls
        `/v1/models` must not pass early."""
        if self.fatal is not None:
            raise APIError(503, f"the server failed to start: {self.fatal}")
        if not self.system.ready:
            raise ModelLoading(progress)

    def check_ready(self, progress: bool = False) -> None:
        """Loaded and not draining: new work may start."""
        self.check_loaded(progress)
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})

    async def resolve_adapter(self, tenant: str, model: str) -> AdapterRef | None:
        """The adapter serving `model` for `tenant` (None: the base model); unknown or not this tenant's: 404."""
        if model in self.model_names:
            return None
        ref = await self.adapters.resolve(tenant, model) if self.adapters is not None else None
        if ref is not None:
            return ref
        raise await self.unknown_model(tenant, model)

    async def unknown_model(self, tenant: str, model: str) -> APIError:
        """The 404 for a model `tenant` cannot use, naming the ones it can, as GET /v1/models lists them for it:
        the served name and the adapters it sees (the shared ones and its own; never another tenant's, nor the
        path the model was loaded from)."""
        names = [self.model_name]
        if self.adapters is not None:
            names += [a.ref.model for a in await self.adapters.visible(tenant)]
        shown = ", ".join(echo(n) for n in names[:MODELS_NAMED])
        more = f" and {len(names) - MODELS_NAMED} more" if len(names) > MODELS_NAMED else ""
        return APIError(
            404,
            f"The model {echo(model)} does not exist; the models you can use are {shown}{more} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )

    @functools.cached_property
    def token_text(self) -> Callable[[int], str]:
        model = self.system.model

        @functools.lru_cache(maxsize=1 << 16)
        def text(token_id: int) -> str:
            return model.decode([token_id], skip_special_tokens=False)

        return text


def state_and_tenant(request) -> tuple[ServerState, str]:
    """The server's state, and the tenant the request's API key names (an APIError where the key is refused)."""
    state: ServerState = request.app.state.motet
    return state, state.auth.tenant(request.headers.get("authorization"))
