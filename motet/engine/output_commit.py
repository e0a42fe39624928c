"""A row's landed tokens made into its `OutputDelta` (motet/engine/outputs.py): the whole commit of a row whose ending
reads its text (`advance`, called from `commit_tokens`), and the text half of the others' (`append_token` now,
`text` later).

Per token: whether it ends the request by itself (EOS, a stop token id, the length limits), its text (incremental
detokenizing, motet/engine/detokenizer.py), the stop strings over that text and the grammar's advance; after the
step's tokens, the tokens the grammar forces (jump-forward). The engine's `commit_tokens` hands each row here:
`advance` commits a row whole (its ending depends on its text: a grammar, stop strings, drafts), `append_token`
only appends a row whose token decides its ending by itself, and `text` makes those rows' deltas later, while the
next step computes (`LLMEngine.commit_text`).

It owns each request's text state (`TextState`, by request id, from `start` until its last delta or `forget`): the
detokenizer, the stop strings, the tokens given out, the output logprobs and the timestamps of `RequestTimings`.
It ends nothing itself: each call returns the finishes it found, and the engine ends those requests (their blocks,
adapter and drafts' history are the engine's), as vLLM's `update_from_output` returns what finished. It counts the
tokens for `EngineStats`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from motet.engine.config import EngineConfig
from motet.engine.core.fairness import VirtualTokenCounter
from motet.engine.core.sequence import Sequence
from motet.engine.detokenizer import IncrementalDetokenizer, StopChain, StopStringMatcher
from motet.engine.guided import GuidedDecoding
from motet.engine.outputs import OutputDelta, RequestTimings, TokenLogprob
from motet.engine.sampling_params import SamplingParams
from motet.engine.structured_output import StructuredOutputs
from motet.grammar.tool_call_parser import RepeatedCallStop

log = logging.getLogger("motet.engine")

Finish = tuple[str, int | str | None]  # (finish_reason, stop_reason)


@dataclass(slots=True)
class TextState:
    """A request's output text as the commit makes it: its detokenizer and stop strings, how many of its tokens
    were given out already (the prompt's counted), its output logprobs, and when it entered the serving system,
    was first scheduled, and produced its first and its latest token (time.monotonic(); None: not yet)."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher | StopChain
    num_emitted: int
    arrival_time: float
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def timings(self) -> RequestTimings:
        scheduled = self.scheduled_time if self.scheduled_time is not None else self.arrival_time
        first = self.first_token_time if self.first_token_time is not None else scheduled
        last = self.last_token_time if self.last_token_time is not None else first
        return RequestTimings(scheduled - self.arrival_time, first - scheduled, last - first)


class TextRow(NamedTuple):
    """A row whose token decided its ending by itself (`Sequence.decided_by_tokens`): its text is made later."""

    seq: Sequence
    text: TextState
    token: int
    finish: Finish | None  # if the token ended it


@dataclass
class LandedStep:
    """What `commit_tokens` leaves to `commit_text`: the deltas made already (rows committed whole, and rows that
    failed), and the rows whose text is still to be made."""

    outputs: list[OutputDelta]
    text_rows: list[TextRow]


class Committed(NamedTuple):
    """A row committed whole: its delta, and (finish_reason, stop_reason) if it ended (the engine ends it)."""

    delta: OutputDelta
    finish: Finish | None


class OutputCommit:
    """Rows' landed tokens into deltas, under the engine's `config` (read as it is: `jump_forward` may change).
    `tokenizer` is the engine's (Hugging Face) tokenizer: the detokenizers' and, without special tokens, the
    text a grammar forces; `structured_output` holds the requests' grammars, which their tokens advance."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: set[int],
        max_model_len: int,
        tokenizer,
        structured_output: StructuredOutputs,
        fairness: VirtualTokenCounter,
    ):
        self.config, self.eos_token_ids, self.max_model_len = config, eos_token_ids, max_model_len
        self.tokenizer, self.structured_output, self.fairness = tokenizer, structured_output, fairness
        self.texts: dict[str, TextState] = {}
        # Tokens processed so far, as vLLM counts them (EngineStats.prompt_tokens, generation_tokens).
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def start(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float
    ) -> TextState:
        """A new request's text state (`forget` drops it where the request ends without a last delta)."""
        stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        if params.stop_on_repeated_tool_call:
            stops = StopChain(stops, RepeatedCallStop())
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        state = self.texts[request_id] = TextState(detok, stops, len(prompt_token_ids), arrival_time)
        return state

    def forget(self, request_id: str) -> None:
        self.texts.pop(request_id, None)

    def _drop(self, seq: Sequence, state: TextState) -> None:
        """The request's last delta is made: its text state goes (if still its: never a later request's of the same
        id)."""
        if self.texts.get(seq.request_id) is state:
            del self.texts[seq.request_id]

    def scheduled(self, request_id: str, now: float) -> None:
        """The request is scheduled: its queue time ends here (a preempted one keeps its first)."""
        state = self.texts.get(request_id)  # (none: aborted, its step still in flight)
        if state is not None and state.scheduled_time is None:
            state.scheduled_time = now

    def advance(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> Committed:
        """Append the step's tokens one by one (with speculation, several) until one ends the request, then
        the tokens its grammar forces (jump-forward)."""
        g, state = self.structured_output.get(seq.request_id), self.texts[seq.request_id]
        text, finish = "", None
        for token, lp in zip(tokens, logprobs, strict=True):
            if lp is not None:
                state.output_logprobs.append(lp)
            if g is not None and not g.accept(token):
                # A token the grammar refuses (a row whose masks left it none never gets here: commit_tokens
                # ends it): end here, the output still matches so far.
                text += self._flush(state)
                finish = ("stop", None)
            else:
                more, finish = self._append(seq, state, g, token)
                text += more
            if finish is not None:
                break
        if g is not None and finish is None:
            forced = g.jump_forward(self.encode) if self.jumps_forward(seq) else []
            self.structured_output.stats.jump_forward_tokens += len(forced)
            for t in forced:
                more, finish = self._append(seq, state, g, t)
                text += more
                if finish is not None:
                    break
        return Committed(self._delta(seq, state, text, finish, now), finish)

    def jumps_forward(self, seq: Sequence) -> bool:
        """Whether the tokens the row's grammar forces are appended after its landed tokens (jump-forward,
        `EngineConfig.jump_forward`): appended unsampled, never where logprobs or the token masks must see each
        one."""
        return self.config.jump_forward and seq.params.logprobs is None and not seq.params.masks_tokens

    def end_masked(self, seq: Sequence, now: float) -> Committed:
        """Every token the row's grammar allows is masked by another setting (min_tokens holding back the stop
        token the grammar needs): it ends here, its output matching the grammar so far."""
        state = self.texts[seq.request_id]
        text = self._flush(state)
        return Committed(self._delta(seq, state, text, ("stop", None), now), ("stop", None))

    def append_token(self, seq: Sequence, token: int, logprob) -> TextRow:
        """A text-free row's token: appended, its text left to `text`; the row's `finish` if the token ends it."""
        state = self.texts[seq.request_id]
        if logprob is not None:
            state.output_logprobs.append(logprob)
        seq.append_token(token)
        return TextRow(seq, state, token, self.token_finish(seq, token))

    def text(self, landed: LandedStep) -> tuple[list[OutputDelta], list[str]]:
        """Detokenize the rows `commit_tokens` left and make their deltas, after the step's others: the step's
        deltas, and the requests that failed here (the engine aborts them). It reads and writes only those rows'
        text state, so it may run while the next step computes."""
        outputs, failures, now = landed.outputs, [], time.monotonic()
        for seq, state, token, finish in landed.text_rows:
            try:
                text = state.stops.feed(self._token_text(seq, state, token, finish))[0]
                if finish is not None:
                    text += self._flush(state)
                out = self._delta(seq, state, text, finish, now)
            except Exception as e:  # (a tokenizer bug) the row's own failure
                log.exception("request %s failed while detokenizing its token", seq.request_id)
                failures.append(seq.request_id)
                self._count(seq, state, 0, now)
                self._drop(seq, state)
                out = failed(seq.request_id, repr(e), state.timings())
            outputs.append(out)
        return outputs, failures

    def token_finish(self, seq: Sequence, token: int) -> Finish | None:
        """(finish_reason, stop_reason) if the appended `token` ends the request by itself (EOS, a stop token id,
        the length limits), else None."""
        params = seq.params
        if (
            token in self.eos_token_ids
            and not params.ignore_eos
            and seq.num_output_tokens > params.min_tokens
        ):
            return ("stop", None)
        if token in params.stop_token_ids and seq.num_output_tokens > params.min_tokens:
            return ("stop", token)
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return ("length", None)
        return None

    def _append(
        self, seq: Sequence, state: TextState, g: GuidedDecoding | None, token: int
    ) -> tuple[str, Finish | None]:
        """Append one token: its new text, and (finish_reason, stop_reason) if it ends the request (`g`: its
        grammar, if any)."""
        seq.append_token(token)
        text = self._token_text(seq, state, token, self.token_finish(seq, token))
        if g is not None:
            g.observe_text(text)
        new, stopped = state.stops.feed(text)
        if stopped:
            finish = ("stop", state.stops.matched)
        elif g is not None and g.terminated:  # the grammar accepted its stop token
            finish = ("stop", None)
        else:
            finish = self.token_finish(seq, token)
        if finish is not None and not stopped:
            new += self._flush(state)
        return new, finish

    @staticmethod
    def _token_text(seq: Sequence, state: TextState, token: int, finish: Finish | None) -> str:
        """The appended token's text; none for the stop token that ends the request (EOS, a stop token id), as
        vLLM's detokenizer leaves it out unless include_stop_str_in_output (where special tokens are kept, its
        `<|im_end|>` would otherwise end the text)."""
        if finish is not None and finish[0] == "stop" and not seq.params.include_stop_str_in_output:
            return ""
        return state.detok.push(token)

    @staticmethod
    def _flush(state: TextState) -> str:
        """The text held back at the request's end: the detokenizer's, then the stop strings'."""
        return state.stops.feed(state.detok.flush())[0] + state.stops.flush()

    def _delta(
        self, seq: Sequence, state: TextState, text: str, finish: Finish | None, now: float
    ) -> OutputDelta:
        """The row's delta: `text`, its new text, and its tokens since its previous delta; the request's last
        (`finish`) drops its text state."""
        reason, stop_reason = finish if finish is not None else (None, None)
        n = seq.num_tokens - state.num_emitted
        state.num_emitted = seq.num_tokens
        self.fairness.charge(seq.tenant, output_tokens=n)
        first = state.first_token_time is None  # (prompt logprobs are complete by the first token)
        self._count(seq, state, n, now)
        if finish is not None:
            self._drop(seq, state)
        return OutputDelta(
            seq.request_id,
            text,
            seq.token_ids[-n:] if n else [],
            state.output_logprobs[-n:] if n and state.output_logprobs else [],
            finish is not None,
            reason,
            stop_reason,
            list(seq.prompt_logprobs) if first and seq.params.prompt_logprobs is not None else None,
            seq.num_cached_tokens,
            timings=state.timings() if finish is not None else None,
        )

    def _count(self, seq: Sequence, state: TextState, num_new_tokens: int, now: float) -> None:
        """The token counters and the request's timestamps, for EngineStats and RequestTimings."""
        if state.first_token_time is None:
            state.first_token_time = now
            self.num_prompt_tokens += seq.num_prompt_tokens
        state.last_token_time = now
        self.num_generation_tokens += num_new_tokens


def failed(request_id: str, error: str, timings=None) -> OutputDelta:
    """The delta of a request that failed alone (its step's others go on)."""
    return OutputDelta(request_id, finished=True, finish_reason="abort", error=error, timings=timings)
