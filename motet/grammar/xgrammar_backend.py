"""The xgrammar backend (default): JSON schema, JSON object, regex, choice and EBNF."""

from __future__ import annotations

import json

import torch
import xgrammar as xgr

from motet.grammar.backend import Backend, CompiledGrammar, GrammarTokenizer, Matcher, set_token_bits
from motet.grammar.enforceable import simplify
from motet.grammar.schema_normalize import normalize_schema
from motet.grammar.specs import EbnfSpec, JsonSchemaSpec, RegexSpec, StructuralTagSpec


class XGrammarMatcher(Matcher):
    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]):
        self._m = xgr.GrammarMatcher(compiled)
        self._stop = stop_token_ids

    def accept_token(self, token_id: int) -> bool:
        if self._m.is_terminated():
            return False
        return self._m.accept_token(int(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_terminated():  # only reachable if the caller ignores termination: allow stop
            set_token_bits(bitmask, row, self._stop, clear=True)
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    @classmethod
    def fill_many(cls, bitmask: torch.Tensor, items: list[tuple[Matcher, int]]) -> None:
        batch_fill(bitmask, items)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._m.rollback(num_tokens)

    def find_jump_forward_string(self) -> str:
        if self._m.is_terminated():
            return ""
        try:
            return self._m.find_jump_forward_string()
        except UnicodeDecodeError:  # the forced bytes end inside a multi-byte character: jump no further
            return ""


_batch_matcher: xgr.BatchGrammarMatcher | None = None


def batch_fill(bitmask: torch.Tensor, items: list[tuple[XGrammarMatcher, int]]) -> None:
    global _batch_matcher
    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher(max_threads="auto")
    _batch_matcher.batch_fill_next_token_bitmask([m._m for m, _ in items], bitmask, [r for _, r in items])


class XGrammarCompiled(CompiledGrammar):
    backend = "xgrammar"

    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]):
        self.compiled = compiled
        self._stop = stop_token_ids

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self.compiled, self._stop)


class XGrammarBackend(Backend):
    name = "xgrammar"
    compile_errors = (Exception,)  # xgrammar's C++ errors surface as RuntimeError / ValueError

    def __init__(self, tokenizer: GrammarTokenizer, max_threads: int = 2):
        super().__init__(tokenizer)
        # xgrammar's own cache off: ours (grammar.cache) is keyed and bounded in one place.
        self._compiler = xgr.GrammarCompiler(tokenizer.xgr_info, max_threads=max_threads, cache_enabled=False)

    def compile_json_schema(self, spec: JsonSchemaSpec) -> XGrammarCompiled:
        # simplify: an equivalent schema whose allOf / composition siblings xgrammar does enforce.
        schema = simplify(normalize_schema(spec.schema_dict()))
        return self._compiled(
            self._compiler.compile_grammar(json_schema_grammar(schema, spec.strict, spec.max_whitespace))
        )

    def compile_regex(self, spec: RegexSpec) -> XGrammarCompiled:
        return self._compiled(self._compiler.compile_regex(spec.pattern))

    def compile_ebnf(self, spec: EbnfSpec) -> XGrammarCompiled:
        grammar = xgr.Grammar.from_ebnf(spec.grammar, root_rule_name=spec.root)
        return self._compiled(self._compiler.compile_grammar(grammar))

    def compile_structural_tag(self, spec: StructuralTagSpec) -> XGrammarCompiled:
        return self._compiled(self._compiler.compile_structural_tag(spec.tag_json()))

    def _compiled(self, compiled: xgr.CompiledGrammar) -> XGrammarCompiled:
        return XGrammarCompiled(compiled, self.tokenizer.stop_token_ids)


def json_schema_grammar(schema: dict, strict: bool, max_whitespace: int) -> xgr.Grammar:
    """xgrammar's grammar for a (normalized) JSON schema with motet's whitespace bound."""
    if max_whitespace > 0:
        fmt = {"any_whitespace": True, "max_whitespace_cnt": max_whitespace}
    else:
        fmt = {"any_whitespace": False, "separators": (",", ":")}
    text = json.dumps(schema)
    try:
        return xgr.Grammar.from_json_schema(text, strict_mode=strict, **fmt)
    except RuntimeError:
        if not strict:
            raise
    # Strict mode narrows the schema (no unlisted properties or items); where that leaves it
    # unsatisfiable (e.g. minItems beyond prefixItems), the schema itself still compiles.
    return xgr.Grammar.from_json_schema(text, strict_mode=False, **fmt)
