"""What a generation request is billed, however it ends: finished, failed, or cut short by its client.

A request's `Bill` is made once its prompts are tokenized (the routes, as soon as the actors have accepted it).
It first reserves the most tokens the request can use against the tenant's tokens per minute: its prompts, and n
times each choice's max_tokens, or the rest of the context window without one (motet/api/rate_limits.py
refuses it there with 429 when they do not fit). It is closed once, when the request ends:

- a stream, when its last choice has ended, before the answer's last events (a client that has read its whole
  answer finds it in `GET /v1/usage`); a collected answer, before it is sent;
- a stream its client cut, or anything failing midway: when the response ends.

Closing takes what the engine had put on the reply streams that nobody read, and counts every prompt processed
(a choice of it got a token) and every token generated, whether the client read it or not. That is charged
against the tokens per minute in place of the reservation, and added to the tenant's usage records
(motet/api/usage.py: written within its FLUSH_S seconds, and before any read of them) and its request log line.
For an answer that ends normally these are the numbers of the `usage` the client gets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from motet.api import rate_limits, tracing
from motet.api import usage as usage_records

if TYPE_CHECKING:
    from motet.actors.reply import ReplyStream
    from motet.api.choice import Choice


class Bill:
    """One API request's tokens: `choices` answer `prompts` (n each, in order), read from `streams` (one per
    choice), in a context window of `context` tokens; its usage added to `records` (the server's, None: none
    kept); `drop`: the output is not returned (max_tokens 0), so not billed."""

    def __init__(
        self,
        context: int,
        records: usage_records.UsageStore | None,
        prompts: list[list[int]],
        choices: list[Choice],
        streams: list[ReplyStream],
        drop: bool = False,
    ):
        self.context, self.records = context, records
        self.prompts, self.choices, self.streams, self.drop = prompts, choices, streams, drop
        self.n = len(choices) // len(prompts)
        self.usage = (
            usage_records.current.get()
        )  # the request's record (taken here: a stream's body runs elsewhere)
        self.ticket = rate_limits.current()
        self.closed = False

    def reserve(self, max_tokens: int | None) -> None:
        """Reserve the most the request can use (`max_tokens`: each choice's bound; None: the rest of the context
        window); 429 when the tenant's tokens per minute do not hold that many."""
        if self.ticket is None:
            return
        context = self.context
        bounds = [
            context - len(p) if max_tokens is None else min(max_tokens, context - len(p))
            for p in self.prompts
        ]
        most = sum(len(p) + self.n * b for p, b in zip(self.prompts, bounds, strict=True))

        def lower(limit: int) -> tuple[str, str | None]:
            """What to lower for the request to fit `limit` tokens (the advice, and the parameter it names)."""
            prompt = sum(len(p) for p in self.prompts)
            fits = (limit - prompt) // (self.n * len(self.prompts))  # the largest max_tokens that fits
            if fits < 1:
                return f"Its prompt alone is {prompt} tokens: shorten it.", None
            if max_tokens is None:
                return (
                    "Without max_tokens it may use the rest of the context window: set max_tokens "
                    f"(at most {fits} with this prompt and n).",
                    "max_tokens",
                )
            return f"Lower max_tokens (at most {fits} with this prompt and n) or n.", "max_tokens"

        self.ticket.reserve(most, max(bounds), lambda: max(len(c.token_ids) for c in self.choices), lower)

    def close(self) -> None:
        """Bill what the request used (once; later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        for choice, stream in zip(self.choices, self.streams, strict=True):
            if (unread := stream.take_nowait()) is not None:  # generated, but the client was gone
                choice.add(unread)
        requests = prompt = cached = output = 0
        for i, tokens in enumerate(self.prompts):
            group = self.choices[i * self.n : (i + 1) * self.n]
            if not any(c.token_ids for c in group):
                continue  # never processed (the engine counts a prompt with its first token)
            requests = 1
            prompt += len(tokens)
            cached += max(c.num_cached_tokens for c in group)
            output += 0 if self.drop else sum(len(c.token_ids) for c in group)
        if self.ticket is not None:
            self.ticket.settle(prompt + output)
        u = self.usage
        if u is None:
            return
        u.requests += requests
        u.input_tokens += prompt
        u.cached_tokens += cached
        u.output_tokens += output
        firsts = [c.first_token for c in self.choices if c.first_token is not None]
        if firsts and (u.first_token is None or min(firsts) < u.first_token):
            u.first_token = min(firsts)
        if self.records is not None and requests:
            self.records.add(u, requests, prompt, cached, output)
        tracing.annotate(
            **{"gen_ai.usage.input_tokens": u.input_tokens, "gen_ai.usage.output_tokens": u.output_tokens}
        )
