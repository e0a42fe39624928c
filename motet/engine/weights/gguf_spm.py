"""The tokenizer of a GGUF SentencePiece vocabulary (`tokenizer.ggml.model` "llama": the files llama.cpp's converter
writes from a tokenizer.model, Llama 2's, Mistral 7B's, TinyLlama's, Gemma's, Phi-3's), as a `tokenizers` Tokenizer
that encodes as llama.cpp's SPM tokenizer does (src/llama-vocab.cpp: `llm_tokenizer_spm_session`) and, on the models'
text, as `sentencepiece` and the model's own Hugging Face tokenizer (transformers' SpmConverter) do.

llama.cpp's SPM tokenizer, step by step, and its counterpart here:
- control, unknown and user-defined tokens are cut out of the text first, whole (control and unknown ones only where
  the text may name special tokens): added tokens, special (skipped in decoding) or not;
- each stretch of text between them gets a space in front when `tokenizer.ggml.add_space_prefix` says so (llama.cpp's
  default for SentencePiece vocabularies: SentencePiece's dummy prefix), and its spaces become U+2581: the
  normalizer, which runs on each stretch alone;
- then, from the stretch's characters, the adjacent pair whose concatenation is a token of the highest score merges
  first, until none does: a BPE model whose merges are each token's splits into two tokens, ranked by the token's
  score (its rank in SentencePiece's BPE training), as transformers derives them from a tokenizer.model;
- a character that is no token becomes its UTF-8 bytes' <0xNN> tokens (SentencePiece's byte fallback).
Decoding reverses the escaping and the bytes, and drops the dummy prefix's space at the start of the text."""

from __future__ import annotations

from collections.abc import Sequence

# GGUF's token types (gguf.TokenType, tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# token types cut out of the text before the merges (llama.cpp's special tokens), and those that decode to nothing
# where special tokens are skipped
ADDED_TYPES = frozenset({CONTROL, UNKNOWN, USER_DEFINED})
SPECIAL_TYPES = frozenset({CONTROL, UNKNOWN})
# the tokens merges make (the others are cut out first, or are bytes: never the concatenation of two symbols)
_MERGED_TYPES = frozenset({NORMAL, UNUSED})
SPACE = "\u2581"  # SentencePiece's escaped space


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every split of a mergeable token into two tokens, the splits of higher-scored tokens first (equal scores: the
    lower id first; one token's splits: by their left part), as transformers' SpmConverter ranks them."""
    vocab = set(tokens)
    ranked = []
    for i, (token, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        if kind not in _MERGED_TYPES:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, i, left, right))
    ranked.sort()
    return [(left, right) for _, _, left, right in ranked]


def spm_tokenizer(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    add_space_prefix: bool,
    unknown: str | None,
):
    """The `tokenizers` Tokenizer of a SentencePiece vocabulary (`tokens`, their `scores` and token `types`, as GGUF
    stores them), with its added tokens; `unknown`: the unknown token's text, if the vocabulary has one. ValueError
    for a vocabulary that names one token twice."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    byte_fallback = any(kind == BYTE for kind in types)
    bpe = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores, types),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=byte_fallback,
    )
    tok = Tokenizer(bpe)
    escape = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), escape] if add_space_prefix else [escape]
    )
    steps = [decoders.Replace(SPACE, " ")]
    if byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())  # (Strip takes from the first token: the text, once fused)
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    added = [(t, kind) for t, kind in zip(tokens, types, strict=True) if kind in ADDED_TYPES]
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in added if k in SPECIAL_TYPES]
    )
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in added if k not in SPECIAL_TYPES]
    )
    return tok
