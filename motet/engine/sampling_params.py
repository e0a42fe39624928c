"""Per-request sampling parameters, validated so that a bad value names its field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from motet.grammar.reasoning import REASONING_FORMATS
from motet.grammar.specs import GrammarSpec

MAX_TEMPERATURE = 2.0  # OpenAI's documented range is [0, 2]
# vLLM documents > 0; past 10 it only ever picks unseen tokens, below 1/10 only seen ones. Below that a seen
# token's logit grows past what fp32 holds (1e-40 made it infinite, 1e-300 a division by zero) and the row has no
# distribution left: vLLM answers with an out-of-vocabulary token.
MAX_REPETITION_PENALTY = 10.0
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY
MAX_STOP_STRINGS = 32  # stop strings, and stop token ids, per request (OpenAI allows 4)
MAX_STOP_STRING_CHARS = 1024
MAX_CACHE_SALT_CHARS = 256  # a salt is hashed, never stored: this only bounds what a request may send
MAX_BAD_WORDS = 128  # bad_words per request: each is tokenized twice and checked at every position
MAX_BAD_WORD_CHARS = 256
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-232 overflows them to inf and the
# softmax to NaN, which samples no token at all.
GREEDY_TEMPERATURE = 1e-5


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF-style, over prompt and output tokens
    frequency_penalty: float = 0.0  # OpenAI-style, over output tokens
    presence_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's plus the top k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured output: the output must match `grammar` (grammar.specs), compiled with
    # `grammar_backend` (None: the engine's). With `reasoning` (a reasoning format's name, motet/grammar/reasoning.py;
    # True: "think"), an output that opens with "<think>" (or whose prompt opened it) is constrained after
    # "</think>", any other from its first token. A format whose markers are special tokens (GPT-OSS's) needs
    # them in the text: skip_special_tokens False.
    grammar: GrammarSpec | None = None
    grammar_backend: str | None = None
    reasoning: str | None = None
    # With `reasoning` and a grammar the output must reach (a forced tool call): the reasoning takes at most half
    # of max_tokens, then the engine forces its end tag and the grammar holds for the rest (motet/engine/guided.py).
    bound_reasoning: bool = False
    # Tool calls (motet/grammar/tool_call_parser.RepeatedCallStop): a call that repeats an earlier call of the
    # output ends it (without the repeat), as a small model otherwise repeats its call until max_tokens.
    stop_on_repeated_tool_call: bool = False
    # Speculative decoding, where the engine has it on: False opts this request out (its output is the
    # same either way; this only trades the verification's extra tokens for fewer steps).
    speculative: bool = True
    # vLLM's cache_salt: requests with different salts never share prefix-cache blocks (nor, in motet, the
    # speculation history), on top of the tenant's own separation (block_manager.prefix_salt).
    cache_salt: str | None = None
    # vLLM's logits masks (motet/engine/worker/token_masks.py): `bad_words` never appear in the output (the last token
    # of a bad word's tokens is masked where the tokens before it were just generated), and only
    # `allowed_token_ids` may be sampled. `bad_words_token_ids` is what the engine derives from `bad_words`
    # with the tokenizer (vLLM's `_bad_words_token_ids`); None until then.
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.reasoning, bool):
            self.reasoning = "think" if self.reasoning else None
        self.validate()

    def validate(self) -> None:
        """Every field in its documented range (OpenAI's where it documents one, else vLLM's), finite,
        and of its type: a bad value names its field. Bounds that depend on the model (token ids, top_k
        against the vocabulary) are checked by the engine (motet/engine/request_checks.py)."""

        def bad(name: str, why: str):
            raise ValueError(f"{name} {why}, got {_show(getattr(self, name))}")

        def number(name: str, integer: bool = False):
            v = getattr(self, name)
            kinds = (int,) if integer else (int, float)
            if isinstance(v, bool) or not isinstance(v, kinds) or not math.isfinite(v):
                bad(name, f"must be a finite {'integer' if integer else 'number'}")
            return v

        if not 0 <= number("temperature") <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE}]")
        if not 0 < number("top_p") <= 1:
            bad("top_p", "must be in (0, 1]")
        if number("top_k", integer=True) < 0:
            bad("top_k", "must be >= 0 (0 or -1 disables it)")
        if not 0 <= number("min_p") <= 1:
            bad("min_p", "must be in [0, 1]")
        if not MIN_REPETITION_PENALTY <= number("repetition_penalty") <= MAX_REPETITION_PENALTY:
            bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]")
        if not -2 <= number("frequency_penalty") <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= number("presence_penalty") <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if self.seed is not None and not -(2**63) <= number("seed", integer=True) < 2**63:
            bad("seed", "must be a 64-bit integer")
        if number("max_tokens", integer=True) < 1:
            bad("max_tokens", "must be >= 1")
        if number("min_tokens", integer=True) < 0:
            bad("min_tokens", "must be >= 0")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= number(name, integer=True) <= 20:
                bad(name, "must be in [0, 20]")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"must hold at most {MAX_STOP_STRINGS} strings")
        if any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            bad("stop", f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            bad("stop_token_ids", f"must hold at most {MAX_STOP_STRINGS} token ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integer token ids")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            bad("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if self.reasoning is not None and self.reasoning not in REASONING_FORMATS:
            bad("reasoning", f"must be a reasoning parser's name ({', '.join(REASONING_FORMATS)}) or None")
        if len(self.bad_words) > MAX_BAD_WORDS:
            bad("bad_words", f"must hold at most {MAX_BAD_WORDS} strings")
        if any(
            not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in self.bad_words
        ):
            bad(
                "bad_words",
                f"must be strings with a non-space character, of at most {MAX_BAD_WORD_CHARS} characters",
            )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            bad("allowed_token_ids", "must be a non-empty list of non-negative integer token ids")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            bad("grammar", "must be a grammar spec (grammar.JsonSchemaSpec, RegexSpec, ...)")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def masks_tokens(self) -> bool:
        """Whether bad_words or allowed_token_ids take tokens away from the sampler."""
        return bool(self.bad_words) or self.allowed_token_ids is not None
