"""What the engine gives out: per step and request, only what is new (`OutputDelta`), and the one accumulator of
those into whole answers (`RequestOutput`, `RequestOutputs`) for whoever needs answers in process.

As vLLM V1's engine core returns `EngineCoreOutput`s (new token ids, logprobs, finish) and its `OutputProcessor`
accumulates them, `LLMEngine.step()` returns one `OutputDelta` per request it advanced, its new text made already
(motet/engine/output_commit.py). The serving layer carries that same record through the reply streams to the API
(several merged into one for a slow reader, `OutputDelta.merge`), across Ray unchanged; the offline `LLM`, scripts
and tests accumulate them here. The records a delta carries (`TokenLogprob`, `RequestTimings`) live here too: the
API and the worker import them, never the engine's core.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the top alternatives (token_id, logprob), best first; a prompt
    token's also has its rank in the distribution (1: the likeliest)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None


@dataclass(frozen=True)
class RequestTimings:
    """A finished request's phases in seconds, as vLLM's request histograms define them: queued (arrival in
    the serving system to first scheduled), prefill (first scheduled to first token), decode (first token to
    the last); inference is prefill + decode. A preempted request keeps its first scheduling."""

    queue_s: float
    prefill_s: float
    decode_s: float

    @property
    def inference_s(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass(frozen=True, slots=True)
class OutputDelta:
    """Everything new for one request since its previous delta: what one step added, or several merged."""

    request_id: str
    text: str = ""  # new text
    token_ids: list[int] = field(default_factory=list)  # new tokens
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, where the request asked for logprobs
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # where asked for: once, with the first delta
    num_cached_tokens: int = 0  # of the prompt's tokens, how many came from the prefix cache
    # The request failed (finish_reason "abort"; the others in its step did not): the engine's description; past
    # the scheduler actor, the ServingError its client is told (motet/actors/serving_errors.py).
    error: str | Exception | None = None
    timings: RequestTimings | None = None  # with the delta that finishes it: its phases, for the metrics

    @property
    def last(self) -> bool:
        """No delta follows this one: the request finished or failed."""
        return self.finished or self.error is not None

    @staticmethod
    def merge(deltas: Sequence[OutputDelta]) -> OutputDelta:
        """One request's deltas, in order, as one: texts, tokens and logprobs joined, the ending the latest's, the
        prompt logprobs, error and timings whichever delta carried them."""
        if len(deltas) == 1:
            return deltas[0]
        last = deltas[-1]
        return OutputDelta(
            last.request_id,
            "".join(d.text for d in deltas),
            [t for d in deltas for t in d.token_ids],
            [lp for d in deltas for lp in d.logprobs],
            last.finished,
            last.finish_reason,
            last.stop_reason,
            next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
            last.num_cached_tokens,
            next((d.error for d in deltas if d.error is not None), None),
            next((d.timings for d in reversed(deltas) if d.timings is not None), None),
        )


@dataclass(kw_only=True)
class RequestOutput:
    """A request's whole answer so far, accumulated from its deltas (`add`): what the offline `LLM` returns."""

    request_id: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all output text so far
    delta: str = ""  # the text the latest delta added
    token_ids: list[int] = field(default_factory=list)  # all output tokens so far
    num_new_tokens: int = 0  # the tokens the latest delta added
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0
    error: str | Exception | None = None
    timings: RequestTimings | None = None  # set by the delta that finishes it

    def add(self, d: OutputDelta) -> None:
        self.text += d.text
        self.delta = d.text
        self.token_ids += d.token_ids
        self.num_new_tokens = len(d.token_ids)
        self.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.finished, self.finish_reason, self.stop_reason = d.finished, d.finish_reason, d.stop_reason
        self.num_cached_tokens = d.num_cached_tokens
        self.error = self.error or d.error
        self.timings = d.timings or self.timings


class RequestOutputs:
    """Requests' whole answers, by request id, from the engine's deltas. `track` a request to give its answer its
    prompt (`step` tracks the engine's requests itself); a delta of a request not tracked starts an answer without
    one."""

    def __init__(self) -> None:
        self.answers: dict[str, RequestOutput] = {}

    def track(self, request_id: str, prompt_token_ids: list[int]) -> RequestOutput:
        answer = self.answers[request_id] = RequestOutput(
            request_id=request_id, prompt_token_ids=prompt_token_ids
        )
        return answer

    def add(self, deltas: Iterable[OutputDelta]) -> list[RequestOutput]:
        """Each delta added to its request's answer: the answers, one per delta, in the deltas' order."""
        touched = []
        for d in deltas:
            answer = self.answers.get(d.request_id)
            if answer is None:
                answer = self.answers[d.request_id] = RequestOutput(request_id=d.request_id)
            answer.add(d)
            touched.append(answer)
        return touched

    def step(self, engine) -> list[RequestOutput]:
        """One `engine.step()` (an LLMEngine), its deltas added: the answers of the requests it advanced. The
        engine's requests not tracked yet are tracked first."""
        for request_id in engine.requests.keys() - self.answers.keys():
            self.track(request_id, engine.requests[request_id].prompt_token_ids)
        return self.add(engine.step())
