"""Structured output: grammar specs, backends (xgrammar, llguidance, outlines-core), the compile cache.

Typical use (synchronous; the ingress runs compilation in a worker thread):

    tok = GrammarTokenizer(hf_tokenizer, vocab_size=model_vocab_size)
    cache = GrammarCache()
    compiled = cache.compile_with_fallback(JsonSchemaSpec(schema), tok, timeout_s=10)
    m = compiled.matcher()                    # one per sequence
    bitmask = allocate_bitmask(batch, tok.vocab_size)
    m.fill_bitmask(bitmask, row); apply_bitmask(logits, bitmask, rows=[row, ...])
    m.accept_token(sampled_id)
"""

import importlib

# Lazy exports: `import grammar.<module>` (tool-call and reasoning parsers) should not pay for
# importing torch, xgrammar and outlines-core.
_EXPORTS = {
    "motet.grammar.backend": [
        "Backend",
        "CompiledGrammar",
        "GrammarTokenizer",
        "Matcher",
        "allocate_bitmask",
        "apply_bitmask",
        "bitmask_allows",
    ],
    "motet.grammar.masking": ["fill_bitmasks"],
    "motet.grammar.cache": ["BACKENDS", "DEFAULT_BACKEND", "GrammarCache"],
    "motet.grammar.limits": ["GrammarLimitError", "GrammarLimits"],
    "motet.grammar.schema_normalize": ["normalize_schema"],
    "motet.grammar.specs": [
        "ChoiceSpec",
        "EbnfSpec",
        "GrammarError",
        "GrammarSpec",
        "JsonObjectSpec",
        "JsonSchemaSpec",
        "RegexSpec",
        "StructuralTagSpec",
    ],
}
_WHERE = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'motet.grammar' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
