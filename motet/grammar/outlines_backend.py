"""The outlines-core backend: everything becomes a regex, compiled to a token-level DFA (`Index`).

JSON schemas go through `json_schema.build_regex_from_schema`, in a helper process (see
grammar.regex_worker). EBNF is refused (a DFA cannot express recursive grammars), so the fallback
picks xgrammar. outlines' Vocabulary has one eos id: other stop tokens are allowed wherever it is.
The index is a plain DFA, so rollback is cheap; past the Guide's own rollback window the matcher
replays its history. Known gaps: its DFA has leftmost-first semantics (a user regex `(yes|yes no)`
does not accept "yes no": put longer alternatives first), and it ignores numeric bounds
(minimum/maximum) of JSON schemas.
"""

from __future__ import annotations

import json

import outlines_core as oc
import torch

from motet.grammar.backend import (
    Backend,
    CompiledGrammar,
    GrammarTokenizer,
    Matcher,
    built_once,
    set_token_bits,
)
from motet.grammar.regex_worker import regex_worker
from motet.grammar.schema_normalize import map_subschemas, normalize_schema
from motet.grammar.specs import GrammarError, GrammarSpec, JsonSchemaSpec, RegexSpec, whitespace_regex

# Index construction time grows with the regex; past this size it rarely finishes in seconds and
# the worker thread would burn a core for minutes. Refuse early instead.
MAX_REGEX_CHARS = 100_000
ROLLBACK_WINDOW = 64


_ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
}
_ANY_TYPE = ["null", "boolean", "number", "string", "array", "object"]


def _spell_out_any(schema):
    """outlines-core mis-renders an unconstrained subschema (`{}`: an ungrouped alternation that
    splits the whole regex) or refuses it (`{"description": ...}`, `true`): list the types instead."""
    if schema is True or (isinstance(schema, dict) and set(schema) <= _ANNOTATIONS):
        return {"type": _ANY_TYPE}
    return schema


class OutlinesMatcher(Matcher):
    def __init__(self, compiled: OutlinesCompiled):
        self._c = compiled
        self._guide = oc.Guide(compiled.index, max_rollback=ROLLBACK_WINDOW)
        self._history: list[int] = []
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._terminated:
            return False
        if token_id in self._c.stop_token_ids:
            if not self._guide.is_finished():
                return False
            self._terminated = True
        else:
            try:
                self._guide.advance(token_id, return_tokens=False)
            except (ValueError, OverflowError):  # no transition: state unchanged
                return False
        self._history.append(token_id)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            set_token_bits(bitmask, row, self._c.stop_token_ids, clear=True)
            return
        words = bitmask[row]
        words.zero_()  # outlines writes only the words its vocab spans
        self._guide.write_mask_into(words.data_ptr(), words.numel(), 4)
        if self._guide.is_finished() and len(self._c.stop_token_ids) > 1:
            set_token_bits(bitmask, row, self._c.stop_token_ids)

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if num_tokens > len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens, only {len(self._history)} accepted")
        del self._history[-num_tokens:]
        if self._terminated:  # the stop token never moved the guide
            self._terminated = False
            num_tokens -= 1
        if num_tokens == 0:
            return
        try:
            self._guide.rollback_state(num_tokens)
        except ValueError:  # beyond the guide's window: replay from the start
            self._guide.reset()
            for t in self._history:
                self._guide.advance(t, return_tokens=False)

    def find_jump_forward_string(self) -> str:
        # With byte-level BPE many tokens spell each forced prefix; finding the forced string
        # needs a walk over the DFA's byte transitions, which outlines-core does not expose.
        return ""


class OutlinesCompiled(CompiledGrammar):
    backend = "outlines"

    def __init__(self, index: oc.Index, regex: str, stop_token_ids: list[int]):
        self.index = index
        self.regex = regex
        self.stop_token_ids = stop_token_ids

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)


class OutlinesBackend(Backend):
    name = "outlines"

    def __init__(self, tokenizer: GrammarTokenizer, max_recursion_depth: int = 3):
        super().__init__(tokenizer)
        self.max_recursion_depth = max_recursion_depth

    @built_once
    def vocabulary(self) -> oc.Vocabulary:
        tok = self.tokenizer
        unreachable = set(tok.special_token_ids)
        tokens: dict[bytes, list[int]] = {}
        for i, b in enumerate(tok.decoded_vocab):
            if b and i not in unreachable:
                tokens.setdefault(b, []).append(i)
        return oc.Vocabulary(tok.stop_token_ids[0], tokens)

    def compile_json_schema(self, spec: JsonSchemaSpec) -> OutlinesCompiled:
        schema = json.dumps(map_subschemas(normalize_schema(spec.schema_dict()), _spell_out_any))
        regex = regex_worker().build(
            schema, whitespace_regex(spec.max_whitespace), self.max_recursion_depth, MAX_REGEX_CHARS
        )
        return self._compile(spec, regex)

    def compile_regex(self, spec: RegexSpec) -> OutlinesCompiled:
        return self._compile(spec, spec.pattern)

    def _compile(self, spec: GrammarSpec, regex: str) -> OutlinesCompiled:
        if len(regex) > MAX_REGEX_CHARS:
            raise GrammarError(
                f"outlines: {spec.kind} too complex (regex of {len(regex)} chars > {MAX_REGEX_CHARS})",
                "unsupported",
            )
        try:
            index = oc.Index(regex, self.vocabulary)
        except Exception as e:
            raise self.cannot_compile(spec, e) from e
        return OutlinesCompiled(index, regex, self.tokenizer.stop_token_ids)
