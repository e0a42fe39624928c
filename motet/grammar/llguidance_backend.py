"""The llguidance backend: JSON schema, JSON object, regex, choice and EBNF (GBNF), on an Earley parser
over a lazily built lexer, so compiling is fast and masks are computed per step.

llguidance refuses (rather than ignores) every JSON-schema keyword and `format` it does not implement,
so what it compiles it enforces; motet turns its `lenient` and `coerce_one_of` options off and drops a
schema's own `x-guidance` options, so a request cannot loosen that. OpenAI-style strict mode (no
properties or items beyond those a schema lists) is applied as xgrammar's `strict_mode` does it: an
`additionalProperties: false` / `items: false` where a schema lists properties / prefix items and says
nothing more. Structural tags are xgrammar's format: refused here, so the fallback order picks xgrammar.
"""

from __future__ import annotations

import json
import threading

import llguidance as llg
import torch

from motet.grammar.backend import Backend, CompiledGrammar, Matcher, built_once, set_token_bits
from motet.grammar.enforceable import COMPOSITION, simplify
from motet.grammar.schema_normalize import map_children, map_subschemas, normalize_schema
from motet.grammar.specs import EbnfSpec, GrammarError, GrammarSpec, JsonSchemaSpec, RegexSpec, short_error

# Where JSON lets whitespace in, a run of at most `n` of these (motet's bound; see grammar.specs).
_WHITESPACE = "[\\x20\\x0A\\x0D\\x09]"


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher: llg.LLMatcher, stop_token_ids: list[int]):
        self._m = matcher
        self._stop = stop_token_ids
        self._terminated = False
        self._stop_in_history = False  # whether llguidance counted the stop token (not when already stopped)

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._terminated:
            return False
        if token_id in self._stop:
            # llguidance takes a stop token only where the grammar may end (and then stops)
            already_stopped = self._m.is_stopped()
            if not self._m.is_accepting() or not self._m.consume_token(token_id):
                return False
            self._terminated, self._stop_in_history = True, not already_stopped
            return True
        # try_consume_tokens leaves the state as it was when the token does not fit (consume_token would
        # put the matcher into its error state for good)
        return self._m.try_consume_tokens([token_id]) == 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._terminated:
            set_token_bits(bitmask, row, self._stop, clear=True)
            return
        _check_bitmask(bitmask)
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    @classmethod
    def fill_many(cls, bitmask: torch.Tensor, items: list[tuple[Matcher, int]]) -> None:
        batch_fill(bitmask, items)

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if self._terminated and not self._stop_in_history:  # that stop token never entered its history
            num_tokens -= 1
        self._terminated = False
        if num_tokens and not self._m.rollback(num_tokens):
            raise ValueError(f"llguidance cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    def find_jump_forward_string(self) -> str:
        if self._terminated:
            return ""
        forced = self._m.compute_ff_bytes()
        for cut in range(len(forced), max(-1, len(forced) - 4), -1):  # end on a whole UTF-8 character
            try:
                return forced[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""


# The two fills are what llguidance.torch's fill_next_token_bitmask(_par) do. That module is not imported: it
# compiles a kernel with torch.compile as it loads, which imports dynamo (3.7 s of every process start here).
def _check_bitmask(bitmask: torch.Tensor) -> None:
    if (
        bitmask.dtype != torch.int32
        or not bitmask.is_cpu
        or bitmask.dim() != 2
        or not bitmask.is_contiguous()
    ):
        raise ValueError("llguidance fills a contiguous 2-D int32 bitmask on the CPU")


_executor: llg.LLExecutor | None = None


def batch_fill(bitmask: torch.Tensor, items: list[tuple[LLGuidanceMatcher, int]]) -> None:
    """Fill the rows of many matchers in one call, on llguidance's own threads (it releases the GIL)."""
    global _executor
    if _executor is None:
        _executor = llg.LLExecutor()
    _check_bitmask(bitmask)
    _executor.unsafe_compute_mask_ptr(
        [(m._m, r) for m, r in items], bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
    )


class LLGuidanceCompiled(CompiledGrammar):
    backend = "llguidance"

    def __init__(self, matcher: llg.LLMatcher, stop_token_ids: list[int]):
        self._template = matcher  # a fresh matcher; each sequence gets a copy (the grammar is shared)
        self._stop = stop_token_ids
        self._lock = threading.Lock()

    def matcher(self) -> LLGuidanceMatcher:
        with self._lock:
            return LLGuidanceMatcher(self._template.deep_copy(), self._stop)


class LLGuidanceBackend(Backend):
    name = "llguidance"

    @built_once
    def llg_tokenizer(self) -> llg.LLTokenizer:
        """Built once (about a second): special tokens are never allowed, stop tokens end the grammar."""
        import llguidance.hf  # imports transformers: only where the vocabulary is built (the first grammar's)

        tok = self.tokenizer
        return llguidance.hf.from_tokenizer(
            tok.tokenizer, n_vocab=tok.vocab_size, eos_token=list(tok.stop_token_ids)
        )

    def compile_json_schema(self, spec: JsonSchemaSpec) -> LLGuidanceCompiled:
        return self._compile(spec, json_schema_grammar(spec))

    def compile_regex(self, spec: RegexSpec) -> LLGuidanceCompiled:
        # JSON-schema / ECMAScript meaning of \d and \w (ASCII), as xgrammar reads a regex
        return self._compile(
            spec, llg.LLMatcher.grammar_from_lark(f"start: /{llg.regex_to_lark(spec.pattern, 'dw')}/")
        )

    def compile_ebnf(self, spec: EbnfSpec) -> LLGuidanceCompiled:
        return self._compile(spec, ebnf_grammar(spec))

    def compile_structural_tag(self, spec) -> LLGuidanceCompiled:
        raise GrammarError("llguidance does not support xgrammar's structural tags", "unsupported")

    def _compile(self, spec: GrammarSpec, grammar: str) -> LLGuidanceCompiled:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.llg_tokenizer)
        if is_error:
            raise self.cannot_compile(spec, messages[0])
        matcher = llg.LLMatcher(self.llg_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise self.cannot_compile(spec, matcher.get_error())
        return LLGuidanceCompiled(matcher, self.tokenizer.stop_token_ids)


def json_schema_grammar(spec: JsonSchemaSpec) -> str:
    """llguidance's grammar for a JSON schema spec: strict where asked, motet's whitespace bound."""
    schema = map_subschemas(simplify(normalize_schema(spec.schema_dict())), _without_no_ops)
    schema = {k: v for k, v in schema.items() if k != "x-guidance"}  # the server's options, not the request's
    if spec.strict:
        schema = close_schema(schema)
    options: dict = {"lenient": False, "coerce_one_of": False, "item_separator": ",", "key_separator": ":"}
    if spec.max_whitespace > 0:
        options["whitespace_pattern"] = f"{_WHITESPACE}{{1,{spec.max_whitespace}}}"
    else:
        options["whitespace_flexible"] = False
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as e:
        raise GrammarError(f"llguidance cannot read this JSON schema: {short_error(e)}") from None


def _without_no_ops(node):
    """`uniqueItems: false` constrains nothing, but llguidance refuses the keyword whatever its value."""
    if isinstance(node, dict) and node.get("uniqueItems") is False:
        return {k: v for k, v in node.items() if k != "uniqueItems"}
    return node


def close_schema(schema: dict) -> dict:
    """Strict mode: objects that list properties admit no others, arrays that list prefix items no more
    items, unless the schema says otherwise. Where an `allOf` remains the schema is left open (closing
    its parts would exclude each other's properties); so is a node beside a composition keyword, and a
    branch of an `anyOf` / `oneOf` whose siblings shape the same value, for the same reason."""
    if '"allOf"' in json.dumps(schema):
        return schema

    def close(node, closable: bool = True):
        if not isinstance(node, dict):
            return node
        out = map_children(node, close)
        if _SHAPING & set(node):
            for key in ("anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    out[key] = [close(branch, closable=False) for branch in node[key]]
        if not closable or any(k in node for k in COMPOSITION):
            return out
        if ("properties" in node or "patternProperties" in node) and not _OPENING_PROPERTIES & set(node):
            out["additionalProperties"] = False
        if "prefixItems" in node and not _OPENING_ITEMS & set(node):
            out["items"] = False
        return out

    return close(schema)


# Keywords beside an anyOf / oneOf that shape the same object or array as its branches.
_SHAPING = {"properties", "patternProperties", "additionalProperties", "required", "prefixItems", "items"}
_OPENING_PROPERTIES = {"additionalProperties", "unevaluatedProperties"}
_OPENING_ITEMS = {"items", "additionalItems", "unevaluatedItems"}


def ebnf_grammar(spec: EbnfSpec) -> str:
    """An EBNF (GBNF) grammar, converted to llguidance's Lark; its root rule becomes the start rule."""
    text = spec.grammar
    if spec.root != "root":
        text = f"root ::= {spec.root}\n{text}"
    try:
        return llg.grammar_from("gbnf", text)
    except (ValueError, AssertionError, KeyError, IndexError) as e:
        raise GrammarError(
            f"llguidance cannot read this EBNF grammar: {short_error(e)}", "unsupported"
        ) from None
