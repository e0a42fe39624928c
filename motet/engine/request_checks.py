"""What a request must satisfy to enter the engine, checked in one place: the prompt against the
context window, the KV pool and the vocabulary, and the sampling parameters that depend on the model.

The serving layer runs these checks before queueing a request (a 400 that names the field), and the
engine runs them again in `add_request`, so offline use gets the same answers.
"""

from __future__ import annotations

from dataclasses import dataclass

from motet.engine.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot take: `param` names the request field, `code` is OpenAI's code."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


# A token is rarely more than a few characters: text beyond this many per token of context cannot fit,
# and is refused before the tokenizer spends time on it.
MAX_CHARS_PER_TOKEN = 32
# The longest prompt text the tokenizer is ever given: one to be cut to its last tokens
# (truncate_prompt_tokens) may be longer than the context (a body is at most --max-body-bytes, but a
# template may expand it).
MAX_PROMPT_CHARS = 8 << 20


def max_text_chars(max_model_len: int, truncating: bool = False) -> int:
    """The longest prompt text the tokenizer is given (`truncating`: one cut to its last tokens after)."""
    return MAX_PROMPT_CHARS if truncating else max_model_len * MAX_CHARS_PER_TOKEN


def check_text_length(text: str, max_model_len: int, param: str = "prompt", truncating: bool = False) -> None:
    """Bounds the tokenizer's work: text that could not fit a context of `max_model_len` tokens is refused
    unread (it needs nothing of the model but that)."""
    limit = max_text_chars(max_model_len, truncating)
    if len(text) > limit:
        fits = "be truncated" if truncating else f"fit this model's context of {max_model_len} tokens"
        raise RequestError(
            f"the {param} is {len(text)} characters long, more than can {fits} "
            f"(at most {limit} characters are read)",
            param,
            "context_length_exceeded",
        )


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_kv_tokens: int  # the KV pool's capacity: a prompt (and one new token) must fit in it
    eos_token_ids: frozenset[int] = frozenset()  # what min_tokens bans besides stop_token_ids

    def max_text_chars(self, truncating: bool = False) -> int:
        """The longest prompt text the tokenizer is given (`truncating`: one cut to its last tokens after)."""
        return max_text_chars(self.max_model_len, truncating)

    def check_text(self, text: str, param: str = "prompt", truncating: bool = False) -> None:
        """Bounds the tokenizer's work: text that could not fit the context window is refused unread."""
        check_text_length(text, self.max_model_len, param, truncating)

    def tokens_to_keep(self, truncate_prompt_tokens: int | None, max_tokens: int | None) -> int | None:
        """vLLM's truncate_prompt_tokens: how many of a prompt's last tokens are kept (None: all of them).
        -1 keeps as many as fit beside the completion (`max_tokens`, at least one token)."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return max(1, min(self.max_model_len - (max_tokens or 1), self.max_kv_tokens - 1))
        room = self.max_model_len - (max_tokens or 0)
        if truncate_prompt_tokens > room:
            raise RequestError(
                f"truncate_prompt_tokens ({truncate_prompt_tokens}) is more than this model's context of "
                f"{self.max_model_len} tokens leaves for the prompt ({room}, beside max_tokens {max_tokens or 0})",
                "truncate_prompt_tokens",
            )
        return truncate_prompt_tokens

    def check_prompt(self, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise RequestError(f"{param} is empty", param)
        if any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size for t in token_ids
        ):
            raise RequestError(f"{param}: token ids must be integers in [0, {self.vocab_size})", param)
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise RequestError(
                f"this model's maximum context length is {limit} tokens; the {param} has {n} tokens "
                "(with no room left for the completion)",
                param,
                "context_length_exceeded",
            )
        if n + 1 > self.max_kv_tokens:
            raise RequestError(
                f"the {param} has {n} tokens, more than this server's KV cache holds "
                f"({self.max_kv_tokens} tokens); raise --num-kv-blocks or --kv-cache-memory-gb",
                param,
                "context_length_exceeded",
            )

    def check_max_tokens(self, num_prompt_tokens: int, max_tokens: int, param: str = "max_tokens") -> None:
        """An explicit completion length must fit the context window beside the prompt (OpenAI's rule)."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; you requested "
                f"{total} ({num_prompt_tokens} in the prompt, {max_tokens} for the completion)",
                param,
                "context_length_exceeded",
            )

    def check_params(self, params: SamplingParams) -> None:
        if params.top_k > self.vocab_size:
            raise RequestError(
                f"top_k must be at most the vocabulary size ({self.vocab_size}), got {params.top_k}", "top_k"
            )
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise RequestError(
                f"stop_token_ids must be token ids in [0, {self.vocab_size})", "stop_token_ids"
            )
        if params.allowed_token_ids is not None and any(
            t >= self.vocab_size for t in params.allowed_token_ids
        ):
            raise RequestError(
                f"allowed_token_ids must be token ids in [0, {self.vocab_size})", "allowed_token_ids"
            )
        if any(t >= self.vocab_size for seq in params.bad_words_token_ids or () for t in seq):
            raise RequestError(
                f"bad_words: a word's tokens are outside this model's vocabulary of {self.vocab_size}",
                "bad_words",
            )
        self._check_something_allowed(params)

    def _check_something_allowed(self, params: SamplingParams) -> None:
        """allowed_token_ids must leave a token that bad_words (a one-token word is banned everywhere) and
        min_tokens (stop_token_ids and EOS until then, as the sampler masks them) do not ban: else no
        position could sample one."""
        if params.allowed_token_ids is None:
            return
        allowed = set(params.allowed_token_ids)
        by_words = {word[0] for word in params.bad_words_token_ids or () if len(word) == 1}
        by_min = set(params.stop_token_ids) | self.eos_token_ids if params.min_tokens > 0 else set()
        if not allowed <= by_words | by_min:
            return
        causes = ["bad_words"] if allowed & by_words else []
        if allowed & by_min:
            causes.append(f"min_tokens ({params.min_tokens}), which bans stop_token_ids and EOS until then")
        raise RequestError(
            f"allowed_token_ids: every allowed token is banned by {' and '.join(causes)}, so no token could "
            "be sampled; allow another token",
            "allowed_token_ids",
        )
