"""A job's hyperparameters: OpenAI's (n_epochs, batch_size, learning_rate_multiplier, and beta for DPO), each
`"auto"` or a value, and the LoRA options this server adds (lora_rank, lora_alpha, lora_dropout,
lora_target_modules); `resolve` checks them (HyperparameterError names the one to fix) and fills in `auto`.

`auto`, as OpenAI documents it: 3 epochs, more for a small file (so that about 100 examples are seen, at most 25
epochs) and fewer for a large one (about 25,000); a batch of about 0.2% of the examples (1 to 256), but at least a
tenth of them up to 8 (TRL's default batch: see auto_batch_size); a learning rate multiplier of 1, of
BASE_LEARNING_RATE (the learning rate PEFT's and TRL's LoRA examples use); beta 0.1 (TRL's). LoRA: rank 8 and
alpha 16 on every projection of the decoder the server serves adapters on, no dropout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from motet.lora.peft_config import brief

BASE_LEARNING_RATE = 2e-4
AUTO = "auto"
OPENAI_NAMES = ("n_epochs", "batch_size", "learning_rate_multiplier")
LORA_NAMES = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules")
DPO_NAMES = ("beta",)


class HyperparameterError(ValueError):
    def __init__(self, message: str, name: str):
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class Hyperparameters:
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: tuple[str, ...]
    beta: float | None = None  # DPO's

    @property
    def learning_rate(self) -> float:
        return self.learning_rate_multiplier * BASE_LEARNING_RATE

    def object(self) -> dict:
        """As the job shows them (OpenAI's three, beta for DPO, then this server's LoRA options)."""
        out = asdict(self)
        out["lora_target_modules"] = list(self.lora_target_modules)
        if self.beta is None:
            del out["beta"]
        return out

    @classmethod
    def of(cls, values: dict) -> Hyperparameters:
        return cls(**{**values, "lora_target_modules": tuple(values["lora_target_modules"])})


def auto_epochs(n_examples: int) -> int:
    """OpenAI's rule (its cookbook's data preparation): 3, within 100 to 25,000 examples seen and 1 to 25 epochs."""
    if n_examples * 3 < 100:
        return min(25, math.ceil(100 / n_examples))
    if n_examples * 3 > 25_000:
        return max(1, 25_000 // n_examples)
    return 3


def auto_batch_size(n_examples: int) -> int:
    """OpenAI's 0.2% of the examples (1 to 256), but at least a tenth of them up to 8: a LoRA job on a small file
    took one example a step, and its many noisy steps moved the model's other answers too (SmolLM2-135M, the
    docs' 80-example demonstration: 41 of 50 held-out facts kept at batch 1, 48 at batch 8; the base's 50)."""
    return max(1, min(8, n_examples // 10), min(256, round(0.002 * n_examples)))


def _number(value, name: str, low: float, high: float, integer: bool, low_open: bool = False):
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or (integer and isinstance(value, float) and not value.is_integer())
    ):  # (an int is compared as it is: JSON's integers may be past any float)
        kind = "an integer" if integer else "a number"
        raise HyperparameterError(f"{name} must be 'auto' or {kind}, not {brief(value, 40)}", name)
    if not (low < value if low_open else low <= value) or value > high:
        bound = f"more than {low}" if low_open else f"at least {low}"
        raise HyperparameterError(f"{name} must be {bound} and at most {high}, not {brief(value, 40)}", name)
    return int(value) if integer else float(value)


def resolve(
    method: str,
    given: dict,
    n_examples: int,
    *,
    max_rank: int,
    modules: Sequence[str],
) -> Hyperparameters:
    """`given`: the request's hyperparameters (missing ones are `auto`); `max_rank`: the served adapters' largest
    rank; `modules`: the projections adapters may target on this model."""
    known = (*OPENAI_NAMES, *LORA_NAMES, *(DPO_NAMES if method == "dpo" else ()))
    for name in given:
        if name not in known:
            raise HyperparameterError(
                f"unknown hyperparameter {name!r:.40} for {method} (known: {', '.join(known)})", name
            )

    def value(name, auto, low, high, integer, low_open=False):
        v = given.get(name, AUTO)
        return auto if v == AUTO or v is None else _number(v, name, low, high, integer, low_open)

    targets = given.get("lora_target_modules", AUTO)
    if targets == AUTO or targets is None:
        targets = tuple(modules)
    elif not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise HyperparameterError(
            "lora_target_modules must be 'auto' or a list of module names", "lora_target_modules"
        )
    elif unknown := [t for t in targets if t not in modules]:
        raise HyperparameterError(
            f"lora_target_modules: {unknown[0]!r:.40} is not a module adapters may target on this model "
            f"(one of {', '.join(modules)})",
            "lora_target_modules",
        )
    rank = value("lora_rank", min(8, max_rank), 1, max_rank, True)
    return Hyperparameters(
        n_epochs=value("n_epochs", auto_epochs(n_examples), 1, 50, True),
        batch_size=value("batch_size", auto_batch_size(n_examples), 1, 256, True),
        learning_rate_multiplier=value("learning_rate_multiplier", 1.0, 0, 10, False, low_open=True),
        lora_rank=rank,
        lora_alpha=value("lora_alpha", 2.0 * rank, 0, 1024, False, low_open=True),
        lora_dropout=value("lora_dropout", 0.0, 0, 0.9, False),
        lora_target_modules=tuple(dict.fromkeys(targets)),
        beta=value("beta", 0.1, 0, 2, False, low_open=True) if method == "dpo" else None,
    )
