"""The body of `POST /v1/fine_tuning/jobs` (OpenAI's FineTuningJobCreateParams), checked before anything else.

The hyperparameters are taken as a mapping here and checked by motet/training/hyperparameters.py (each `auto` or
a value within OpenAI's ranges, and this server's LoRA options), which names the one to fix.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from motet.api import protocol as P

SUFFIX_PATTERN = r"^[A-Za-z0-9._-]+$"  # it becomes part of a model's name (and of an adapter's directory)
MAX_SEED = 2**31 - 1


class _MethodHyperparameters(P._Request):
    hyperparameters: dict[str, Any] | None = None


class Method(P._Request):
    type: Literal["supervised", "dpo"]
    supervised: _MethodHyperparameters | None = None
    dpo: _MethodHyperparameters | None = None


class FineTuningJobCreate(P._Request):
    unsupported = {"integrations": ((None, []), "no integrations are run (follow the job's events instead)")}
    model: str = Field(min_length=1, max_length=256)
    training_file: str = Field(min_length=1, max_length=P.ID_MAX_CHARS)
    validation_file: str | None = Field(None, min_length=1, max_length=P.ID_MAX_CHARS)
    suffix: str | None = Field(None, min_length=1, max_length=64, pattern=SUFFIX_PATTERN)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    method: Method | None = None
    hyperparameters: dict[str, Any] | None = None  # the legacy place of the supervised method's
    metadata: dict[str, str] | None = None
    # motet's: a `fine-tune` file of chats whose last assistant message the tuned model (and, beside it, the model
    # it was tuned from) should answer, compared after the job trains (motet/training/eval_file.py)
    eval_file: str | None = Field(None, min_length=1, max_length=P.ID_MAX_CHARS)
    _metadata = field_validator("metadata")(
        P._OpenAINoOps._metadata.__func__
    )  # OpenAI's limits, as everywhere

    def method_and_hyperparameters(self) -> tuple[str, dict, str]:
        """The method ("supervised" or "dpo"), its hyperparameters and where the request gave them (for an
        error's `param`). ValueError: the method's parts disagree."""
        if self.method is None:
            return "supervised", dict(self.hyperparameters or {}), "hyperparameters"
        kind = self.method.type
        other = "dpo" if kind == "supervised" else "supervised"
        if getattr(self.method, other) is not None:
            raise ValueError(f"method.{other} is given, but method.type is {kind!r}")
        part = getattr(self.method, kind)
        given = dict(part.hyperparameters or {}) if part is not None else {}
        if self.hyperparameters:
            if kind != "supervised" or given:
                raise ValueError("give the hyperparameters once: in method.<type>.hyperparameters")
            return kind, dict(self.hyperparameters), "hyperparameters"
        return kind, given, f"method.{kind}.hyperparameters"
