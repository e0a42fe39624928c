"""The text half of the engine's commit: a row's landed tokens made into its `OutputDelta` (motet/engine/outputs.py).

Per token: whether it ends the request by itself (EOS, a stop token id, the length limits), its text (incremental
detokenizing, motet/engine/detokenizer.py), the stop strings over that text and the grammar's advance; after the
step's tokens, the tokens the grammar forces (jump-forward). The engine's `commit_tokens` hands each row here:
`advance` commits a row whole (its ending depends on its text: a grammar, stop strings, drafts), `append_token`
only appends a row whose token decides its ending by itself, and `text` makes those rows' deltas later, while the
next step computes (`LLMEngine.commit_text`). A request that ends is ended through the engine's `finish` (its
blocks, adapter and drafts' history are the engine's). It counts the tokens for `EngineStats` and stamps the
timestamps of `RequestTimings`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from motet.engine.config import EngineConfig
from motet.engine.core.fairness import VirtualTokenCounter
from motet.engine.core.sequence import Sequence
from motet.engine.outputs import OutputDelta

log = logging.getLogger("motet.engine")

Finish = tuple[str, int | str | None]  # (finish_reason, stop_reason)


class TextRow(NamedTuple):
    """A row whose token decided its ending by itself (`Sequence.decided_by_tokens`): its text is made later."""

    seq: Sequence
    token: int
    finish: Finish | None  # if the token ended it


@dataclass
class LandedStep:
    """What `commit_tokens` leaves to `commit_text`: the deltas made already (rows committed whole, and rows that
    failed), and the rows whose text is still to be made."""

    outputs: list[OutputDelta]
    text_rows: list[TextRow]


class OutputCommit:
    """Rows' landed tokens into deltas, under the engine's `config` (read as it is: `jump_forward` may change).
    `finish(seq, reason, stop_reason)` ends a request in the engine, `abort(request_id)` drops one that failed;
    `encode` is the tokenizer's (no special tokens), for the text a grammar forces."""

    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: set[int],
        max_model_len: int,
        encode: Callable[[str], list[int]],
        grammar_stats,
        fairness: VirtualTokenCounter,
        finish: Callable[[Sequence, str, int | str | None], None],
        abort: Callable[[str], object],
    ):
        self.config, self.eos_token_ids, self.max_model_len = config, eos_token_ids, max_model_len
        self.encode, self.grammar_stats, self.fairness = encode, grammar_stats, fairness
        self.finish, self.abort = finish, abort
        # Tokens processed so far, as vLLM counts them (EngineStats.prompt_tokens, generation_tokens).
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def advance(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> OutputDelta:
        """Append the step's tokens one by one (with speculation, several) until one ends the request, then
        the tokens its grammar forces (jump-forward)."""
        g = seq.guided
        text, finish = "", None
        for token, lp in zip(tokens, logprobs, strict=True):
            if lp is not None:
                seq.output_logprobs.append(lp)
            if g is not None and not g.accept(token):
                # A token the grammar refuses (a row whose masks left it none never gets here: commit_tokens
                # ends it): end here, the output still matches so far.
                text += self._flush(seq)
                finish = ("stop", None)
            else:
                more, finish = self._append(seq, token)
                text += more
            if finish is not None:
                break
        if g is not None and finish is None:
            forced = []
            # forced tokens are appended unsampled: never where logprobs or the token masks must see each one
            if self.config.jump_forward and seq.params.logprobs is None and not seq.params.masks_tokens:
                forced = g.jump_forward(self.encode)
            self.grammar_stats.jump_forward_tokens += len(forced)
            for t in forced:
                more, finish = self._append(seq, t)
                text += more
                if finish is not None:
                    break
        if finish is not None:
            self.finish(seq, *finish)
        return self._delta(seq, text, finish, now)

    def end_masked(self, seq: Sequence, now: float) -> OutputDelta:
        """Every token the row's grammar allows is masked by another setting (min_tokens holding back the stop
        token the grammar needs): it ends here, its output matching the grammar so far."""
        text = self._flush(seq)
        self.finish(seq, "stop", None)
        return self._delta(seq, text, ("stop", None), now)

    def append_token(self, seq: Sequence, token: int, logprob) -> Finish | None:
        """A text-free row's token: append it and end the row if the token ends it; (reason, stop_reason) or None."""
        if logprob is not None:
            seq.output_logprobs.append(logprob)
        seq.append_token(token)
        finish = self.token_finish(seq, token)
        if finish is not None:
            self.finish(seq, *finish)
        return finish

    def text(self, landed: LandedStep) -> list[OutputDelta]:
        """Detokenize the rows `commit_tokens` left and make their deltas, after the step's others. It reads and
        writes only those rows' text state, so it may run while the next step computes."""
        outputs, now = landed.outputs, time.monotonic()
        for seq, token, finish in landed.text_rows:
            try:
                text = seq.stops.feed(self._token_text(seq, token, finish))[0]
                if finish is not None:
                    text += self._flush(seq)
                out = self._delta(seq, text, finish, now)
            except Exception as e:  # (a tokenizer bug) the row's own failure
                log.exception("request %s failed while detokenizing its token", seq.request_id)
                self.abort(seq.request_id)
                self._count(seq, 0, now)
                out = failed(seq.request_id, repr(e), seq.timings())
            outputs.append(out)
        return outputs

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

    def _append(self, seq: Sequence, token: int) -> tuple[str, Finish | None]:
        """Append one token: its new text, and (finish_reason, stop_reason) if it ends the request."""
        seq.append_token(token)
        text = self._token_text(seq, token, self.token_finish(seq, token))
        if seq.guided is not None:
            seq.guided.observe_text(text)
        new, stopped = seq.stops.feed(text)
        if stopped:
            finish = ("stop", seq.stops.matched)
        elif seq.guided is not None and seq.guided.terminated:  # the grammar accepted its stop token
            finish = ("stop", None)
        else:
            finish = self.token_finish(seq, token)
        if finish is not None and not stopped:
            new += self._flush(seq)
        return new, finish

    @staticmethod
    def _token_text(seq: Sequence, token: int, finish: Finish | None) -> str:
        """The appended token's text; none for the stop token that ends the request (EOS, a stop token id), as
        vLLM's detokenizer leaves it out unless include_stop_str_in_output (where special tokens are kept, its
        `<|im_end|>` would otherwise end the text)."""
        if finish is not None and finish[0] == "stop" and not seq.params.include_stop_str_in_output:
            return ""
        return seq.detok.push(token)

    @staticmethod
    def _flush(seq: Sequence) -> str:
        """The text held back at the request's end: the detokenizer's, then the stop strings'."""
        return seq.stops.feed(seq.detok.flush())[0] + seq.stops.flush()

    def _delta(self, seq: Sequence, text: str, finish: Finish | None, now: float) -> OutputDelta:
        """The row's delta: `text`, its new text, and its tokens since its previous delta."""
        reason, stop_reason = finish if finish is not None else (None, None)
        n = seq.num_tokens - seq.num_emitted
        seq.num_emitted = seq.num_tokens
        self.fairness.charge(seq.tenant, output_tokens=n)
        first = seq.first_token_time is None  # (prompt logprobs are complete by the first token)
        self._count(seq, n, now)
        return OutputDelta(
            seq.request_id,
            text,
            seq.token_ids[-n:] if n else [],
            seq.output_logprobs[-n:] if n and seq.output_logprobs else [],
            finish is not None,
            reason,
            stop_reason,
            list(seq.prompt_logprobs) if first and seq.params.prompt_logprobs is not None else None,
            seq.num_cached_tokens,
            timings=seq.timings() if finish is not None else None,
        )

    def _count(self, seq: Sequence, num_new_tokens: int, now: float) -> None:
        """The token counters and the request's timestamps, for EngineStats and RequestTimings."""
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.num_prompt_tokens += seq.num_prompt_tokens
        seq.last_token_time = now
        self.num_generation_tokens += num_new_tokens


def failed(request_id: str, error: str, timings=None) -> OutputDelta:
    """The delta of a request that failed alone (its step's others go on)."""
    return OutputDelta(request_id, finished=True, finish_reason="abort", error=error, timings=timings)
