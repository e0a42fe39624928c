"""Reading `adapter_config.json` as PEFT would, strictly: which (layer, module) pairs an adapter targets and
with which rank and alpha. Untrusted tenant input: every refusal is an `AdapterError` naming the field.

Config regexes (a string target_modules or exclude_modules, layers_pattern, rank_pattern and alpha_pattern
keys) are matched as PEFT matches them, with `re` semantics; patterns that could backtrack catastrophically
run on the `regex` engine under a time budget, so that a hostile pattern costs at most REGEX_BUDGET_S.
"""

from __future__ import annotations

import gc
import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import regex

from motet.lora.peft_format import CONFIG_FILE, LINEAR_MODULES, PEFT_DEFAULT_TARGETS, AdapterError

# Config fields that change what the adapter computes beyond y += B A x * scale: refuse when set.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) is not supported; merge the adapter or retrain as plain LoRA",
    "lora_bias": "LoRA biases (lora_bias) are not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "trainable_token_indices": "trainable_token_indices (embedding updates) is not supported",
    "arrow_config": "arrow_config (adapter routing) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
    "use_bdlora": "BD-LoRA (use_bdlora) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
}

# Limits against adversarial adapter configs (the weights' limits are in motet/lora/adapter.py).
MAX_PATTERN_CHARS = 1024  # one config regex; PEFT's documented and users' patterns are < 200 characters
MAX_CONFIG_ENTRIES = 4096  # entries of target_modules, exclude_modules, layers_to_transform, layers_pattern,
# rank_pattern, alpha_pattern; one per module of a 126-layer Llama (what all-linear expands to) is 882
REGEX_BUDGET_S = 1.0  # seconds for matching all of one adapter's config regexes against the base model's
# module names: real configs take milliseconds (a rank_pattern naming each of a 126-layer Llama's 882 modules
# ~0.2 s), a catastrophically backtracking pattern is cut off here instead of running for minutes or more
MAX_CONFIG_RANK = 1 << 16  # r and rank_pattern values (the ranks actually used must also be <= max_rank)
MAX_LORA_ALPHA = 1e6  # lora_alpha and alpha_pattern values; real ones are 1 .. ~1e3


class _CollectorTime(threading.local):
    """CPU seconds each thread has spent in the garbage collector: a collection of everything a long-lived
    process holds can take a second and runs in whichever thread allocated last, so a budget for one adapter's
    regexes leaves it out (CI charged one to a config that takes 40 ms to check, and refused it)."""

    total = 0.0
    began: float | None = None


_collector = _CollectorTime()


def _time_collections(phase: str, _info: dict) -> None:
    if phase == "start":
        _collector.began = time.thread_time()
    elif _collector.began is not None:
        _collector.total += time.thread_time() - _collector.began
        _collector.began = None


gc.callbacks.append(_time_collections)


def _own_cpu_time() -> float:
    """This thread's CPU seconds outside the garbage collector."""
    return time.thread_time() - _collector.total


def brief(value, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters: messages echo tenant input, which may be huge."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# Patterns made of literals, `.`, `\.` and anchors: no repetition, so PEFT's wrappers around them match in
# polynomial time on short module names and they run on `re` itself (no timeout, but timed all the same).
_PLAIN = re.compile(r"(?:[A-Za-z0-9_\-.^$]|\\\.)*")
_REPEAT = re.compile(r"\{(?:\d+(?:,\d*)?|,\d+)\}")
_FOLD = 256  # plain rank/alpha_pattern keys per folded alternation (bounds one uninterruptible compile)


def _ambiguous(pattern: str) -> str | None:
    """Syntax that `regex` (VERSION0) reads differently from `re` though `re` accepts it, or None.

    `re` takes `{e<=1}` (not a repeat) as literal text and `[[:alpha:]]` as a set of `[:alph`, where `regex`
    reads fuzzy matching and a POSIX class; the engines disagree on some possessive repeats; comments could
    hide any of these from this scan. All are refused: real adapter configs use none of them."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "#":
            return "'#' (a comment)"
        if c == "{" and not _REPEAT.match(pattern, i):
            return "'{' that does not start a {m,n} repeat"
        if c in "*+?}" and pattern.startswith("+", i + 1) or pattern.startswith("(?>", i):
            return "a possessive quantifier or atomic group"
        if c == "[":
            i += 1
            i += pattern.startswith("^", i)
            i += pattern.startswith("]", i)  # a leading ']' is a literal
            while i < n and pattern[i] != "]":
                if pattern[i] == "\\":
                    i += 2
                    continue
                if pattern[i] == "[":
                    return "'[' inside a character set"
                if pattern[i] in "-&~|" and pattern.startswith(pattern[i] * 2, i):
                    return f"{pattern[i] * 2!r} inside a character set"
                i += 1
        i += 1
    return None


@dataclass
class _ConfigRegex:
    regexes: _Regexes
    field: str
    compiled: re.Pattern | regex.Pattern
    timed: bool  # on the `regex` engine, interrupted when the budget runs out

    def match(self, name: str):
        return self.regexes.run(self, "match", name)

    def fullmatch(self, name: str):
        return self.regexes.run(self, "fullmatch", name)


class _Regexes:
    """One adapter's config regexes, compiled and matched as PEFT does (`re` semantics: `wrapped` is PEFT's
    regex around the tenant's pattern), all within REGEX_BUDGET_S of compiling and matching together. The
    budget counts this thread's CPU time (the garbage collector's left out), so a busy machine does not refuse a pattern that is not slow (the
    `regex` engine's own timeout, a backstop per match, is wall-clock).

    Refusals name the field: a pattern longer than MAX_PATTERN_CHARS, one that `re` rejects (PEFT would
    raise on it), one that `regex` would read differently, and whatever runs past the budget."""

    def __init__(self, file: Path):
        self.file, self.left = file, REGEX_BUDGET_S

    def _slow(self, field: str) -> AdapterError:
        return AdapterError(
            f"{self.file}: {field}: pattern too slow (compiling and matching the config's regexes against the "
            f"base model's module names took over {REGEX_BUDGET_S:g} s); simplify it, e.g. list the module names"
        )

    def _plain(self, field: str, pattern: str) -> bool:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise AdapterError(
                f"{self.file}: {field}: pattern too long ({len(pattern)} characters; "
                f"the limit is {MAX_PATTERN_CHARS})"
            )
        if _PLAIN.fullmatch(pattern):
            return True
        if what := _ambiguous(pattern):
            raise AdapterError(
                f"{self.file}: {field}: pattern uses {what}, which is ambiguous between regex engines; "
                "escape it or rewrite the pattern"
            )
        return False

    def _compile(self, field: str, named: str, wrapped: str, timed: bool) -> _ConfigRegex:
        if self.left <= 0:
            raise self._slow(field)
        start = _own_cpu_time()
        try:
            compiled = re.compile(wrapped)  # refuse what PEFT's own re.match/fullmatch would raise on
            if timed:
                compiled = regex.compile(wrapped, regex.VERSION0)  # the same semantics, and a timeout
        except Exception as e:  # re.error, regex.error, RecursionError on deep nesting, ...
            raise AdapterError(f"{self.file}: {named} is not a valid regex ({brief(str(e), 200)})") from None
        finally:
            self.left -= _own_cpu_time() - start
        return _ConfigRegex(self, field, compiled, timed)

    def compile(self, field: str, pattern: str, wrapped: str) -> _ConfigRegex:
        timed = not self._plain(field, pattern)
        return self._compile(
            field, field if field.endswith("]") else f"{field} {brief(pattern)}", wrapped, timed
        )

    def run(self, rx: _ConfigRegex, method: str, name: str):
        start = _own_cpu_time()
        try:
            if self.left <= 0:
                raise TimeoutError
            if rx.timed:
                return getattr(rx.compiled, method)(name, timeout=self.left)
            return getattr(rx.compiled, method)(name)
        except TimeoutError:
            raise self._slow(rx.field) from None
        finally:
            self.left -= _own_cpu_time() - start

    def table(self, field: str, items: list[tuple[str, int | float]]) -> _PatternTable:
        r"""rank_pattern or alpha_pattern: each key as PEFT's get_pattern_key matches it, `(.*\.)?(key)$`.

        Runs of plain keys are folded into one alternation of lookaheads, `(?=(?:.*\.)?(?:key)$)()|...`:
        its first alternative that matches is the first key that matches (the empty group numbers it), so a
        pattern that names every module costs one match per module name, not one per key."""
        blocks: list[tuple[_ConfigRegex, list, bool]] = []
        run: list[tuple[str, int | float]] = []

        def fold():
            wrapped = "|".join(rf"(?=(?:.*\.)?(?:{key})$)()" for key, _ in run)
            blocks.append((self._compile(field, field, wrapped, False), [value for _, value in run], True))
            run.clear()

        for key, value in items:
            label = f"{field}[{brief(key)}]"
            if self._plain(label, key):
                run.append((key, value))
                if len(run) == _FOLD:
                    fold()
            else:
                if run:
                    fold()
                blocks.append((self.compile(label, key, rf"(.*\.)?({key})$"), [value], False))
        if run:
            fold()
        return _PatternTable(blocks)


@dataclass
class _PatternTable:
    blocks: list[tuple[_ConfigRegex, list, bool]]  # (regex, values, folded)

    def get(self, name: str, default):
        """PEFT's get_pattern_key: the value of the first key that matches a dotted suffix of `name`."""
        for rx, values, folded in self.blocks:
            if m := rx.match(name):
                return values[m.lastindex - 1] if folded else values[0]
        return default


@dataclass
class _Selection:
    """How PEFT picks modules and their rank and alpha from a config (check_target_module_exists,
    get_pattern_key), with every regex compiled and bounded."""

    targets: _ConfigRegex | frozenset[str] | None  # None: "all-linear"
    exclude: _ConfigRegex | frozenset[str] | None
    layers: int | frozenset[int] | None  # layers_to_transform; None: every layer
    layers_patterns: list[_ConfigRegex] | None  # None: PEFT's default (the first numbered segment)
    rank_pattern: _PatternTable
    alpha_pattern: _PatternTable


def _dot_suffixes(name: str) -> list[str]:
    """Every t with name.endswith(f".{t}"): a set lookup of these is PEFT's suffix match against a list."""
    return [name[i + 1 :] for i, c in enumerate(name) if c == "."]


def _layer_of(sel: _Selection, name: str) -> int | None:
    """PEFT's layer index of a module name: the first numbered segment (after a `layers_pattern` if given)."""
    if sel.layers_patterns is None:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        for pattern in sel.layers_patterns:
            m = pattern.match(name)
            if m is not None:
                break
    idx = m.groupdict().get("idx") if m else None  # a pattern with a top-level '|' can match without it
    return None if idx is None else int(idx)


def targeted(sel: _Selection, name: str) -> bool:
    """PEFT's check_target_module_exists for one module name of the base model."""
    if isinstance(sel.exclude, _ConfigRegex):
        if sel.exclude.fullmatch(name):
            return False
    elif sel.exclude and (name in sel.exclude or any(s in sel.exclude for s in _dot_suffixes(name))):
        return False
    if sel.targets is None:  # PEFT: every linear module but the output head
        return name.rsplit(".", 1)[-1] in LINEAR_MODULES
    if isinstance(sel.targets, _ConfigRegex):
        return sel.targets.fullmatch(name) is not None
    if name in sel.targets:  # a full name: selected whatever layers_to_transform says
        return True
    if not any(s in sel.targets for s in _dot_suffixes(name)):
        return False
    if sel.layers is None:
        return True
    idx = _layer_of(sel, name)
    return idx is not None and (idx == sel.layers if isinstance(sel.layers, int) else idx in sel.layers)


def read_config(path: Path) -> tuple[dict, _Selection]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{file}: missing; a PEFT LoRA adapter needs {CONFIG_FILE}")
    if file.stat().st_size > 1 << 20:
        raise AdapterError(f"{file}: larger than 1 MiB")
    try:
        cfg = json.loads(file.read_text())
    # ValueError: also UnicodeDecodeError and ints of over 4300 digits; RecursionError: deep nesting
    except (ValueError, RecursionError) as e:
        raise AdapterError(f"{file}: not valid JSON ({brief(str(e), 200)})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{file}: must be a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise AdapterError(
            f"{file}: peft_type is {brief(cfg.get('peft_type'))}; motet serves only LORA adapters"
        )
    for field, reason in _UNSUPPORTED.items():
        if cfg.get(field):
            raise AdapterError(f"{file}: {reason}")
    if cfg.get("modules_to_save"):
        raise AdapterError(
            f"{file}: modules_to_save {brief(cfg['modules_to_save'])} is not supported "
            "(the adapter would replace base model modules)"
        )
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias {brief(cfg['bias'])} is not supported; only 'none'")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError(f"{file}: fan_in_fan_out=true (Conv1D weights) is not supported for Llama models")

    def positive(field, value, integer, limit):
        number = isinstance(value, int | float) and not isinstance(value, bool)
        # int/float comparisons are exact (no overflow on huge ints); NaN compares false
        if not (number and (isinstance(value, int) or not integer) and 0 < value <= limit):
            raise AdapterError(
                f"{file}: {field} must be a positive {'integer' if integer else 'number'} up to {limit:g}, "
                f"got {brief(value)}"
            )

    def entries(field, value):
        if len(value) > MAX_CONFIG_ENTRIES:
            raise AdapterError(
                f"{file}: {field}: {len(value)} entries, above the limit of {MAX_CONFIG_ENTRIES}"
            )

    def names(field, value):
        """None, a regex string, or a list of names (exact or dotted-suffix matches)."""
        if value is None or isinstance(value, str):
            return value
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise AdapterError(f"{file}: {field} must be a list of module names or a regex string")
        entries(field, value)
        return frozenset(value)

    regexes = _Regexes(file)
    positive("r", cfg.setdefault("r", 8), True, MAX_CONFIG_RANK)
    positive("lora_alpha", cfg.setdefault("lora_alpha", 8), False, MAX_LORA_ALPHA)
    patterns = {}
    for field in ("rank_pattern", "alpha_pattern"):
        value = cfg.get(field) or {}
        if not isinstance(value, dict):
            raise AdapterError(f"{file}: {field} must be an object")
        entries(field, value)
        for key, number in value.items():
            if field == "rank_pattern":
                positive(f"{field}[{brief(key)}]", number, True, MAX_CONFIG_RANK)
            else:
                positive(f"{field}[{brief(key)}]", number, False, MAX_LORA_ALPHA)
        patterns[field] = regexes.table(field, list(value.items()))

    targets = names("target_modules", cfg.get("target_modules"))
    if targets is None:
        targets = frozenset(PEFT_DEFAULT_TARGETS)
    elif isinstance(targets, str):
        if targets.lower() == "all-linear":
            targets = None
        else:
            targets = regexes.compile("target_modules", targets, targets)
    exclude = names("exclude_modules", cfg.get("exclude_modules"))
    if isinstance(exclude, str):
        exclude = regexes.compile("exclude_modules", exclude, exclude) if exclude else None

    layers = cfg.get("layers_to_transform")
    if layers is not None and not (
        isinstance(layers, int) or isinstance(layers, list) and all(isinstance(i, int) for i in layers)
    ):
        raise AdapterError(f"{file}: layers_to_transform must be an int or a list of ints")
    if isinstance(layers, list):
        entries("layers_to_transform", layers)
        layers = frozenset(layers) or None  # PEFT: an empty list transforms every layer
    layers_pattern = cfg.get("layers_pattern")
    if layers_pattern is not None and not (
        isinstance(layers_pattern, str)
        or isinstance(layers_pattern, list)
        and all(isinstance(p, str) for p in layers_pattern)
    ):
        raise AdapterError(f"{file}: layers_pattern must be a string or a list of strings")
    layers_patterns = None
    if layers_pattern:  # PEFT: None or empty means its default
        if isinstance(layers_pattern, str):
            layers_pattern = [layers_pattern]
        entries("layers_pattern", layers_pattern)
        layers_patterns = [
            regexes.compile("layers_pattern", p, rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.") for p in layers_pattern
        ]
    selection = _Selection(
        targets, exclude, layers, layers_patterns, patterns["rank_pattern"], patterns["alpha_pattern"]
    )
    return cfg, selection
