"""Per-request sampling parameters, validated so that a bad value names its field."""

from __future__ import annotations

from dataclasses import dataclass, field

from grammar.specs import GrammarSpec


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
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
    # `grammar_backend` (None: the engine's). With `reasoning`, the output starts with the model's
    # reasoning and the grammar applies after "</think>".
    grammar: GrammarSpec | None = None
    grammar_backend: str | None = None
    reasoning: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str):
            raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not self.temperature >= 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", "must be >= 0 (0 or -1 disables it)")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "must be > 0")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "must be in [-2, 2]")
        if self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", "must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad("prompt_logprobs", "must be in [0, 20]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            bad("grammar", "must be a grammar spec (grammar.JsonSchemaSpec, RegexSpec, ...)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
