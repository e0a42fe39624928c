"""The pre-tokenizer of a GGUF byte-level BPE vocabulary, by llama.cpp's name for it (`tokenizer.ggml.pre`): the
splits llama.cpp's src/llama-vocab.cpp applies for that name, written as the model's own tokenizer.json writes
them (a `Split` per regex, each match kept apart, in turn, then byte-level without its own regex)."""

from __future__ import annotations

# Qwen2's (and Qwen3's) split before byte-level BPE: its tokenizer.json's Split pattern, one digit at a time
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Llama 3's: Qwen2's with numbers in runs of up to three digits
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# "gpt-4o" (GPT-OSS's files): o200k's split, as openai/gpt-oss-20b's tokenizer.json has it (tiktoken's o200k_base
# pat_str; llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O spells the case classes with look-aheads, its regex engine
# having no \p{Lu}): words with their case runs and a contraction, numbers of up to three digits
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# "deepseek-v3" (LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM): three splits in turn, deepseek-ai/DeepSeek-V3's tokenizer.json's
# (their \r \n are the characters themselves there): numbers of up to three digits, runs of CJK ideographs and kana,
# then words, punctuation and whitespace
DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^""" + "\r\n" + r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[" + "\r\n" + r"]*|\s*[" + "\r\n" + r"]+|\s+(?!\S)|\s+",
)
# "deepseek-llm" (LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM, DeepSeek LLM's and DeepSeek-V2's files): six splits in turn, as
# llama-vocab.cpp lists them: each newline alone, cased letters (the scripts with case, written out), ASCII and
# full-width punctuation, trailing whitespace, CJK and Hangul runs, digit runs
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
    r"\s?[!-/:-~" + "\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002" + "]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    r"\p{N}+",
)
# a name -> its splits in turn, for the names whose tokenizer.json splits by regex before byte-level BPE
SPLITS = {
    "qwen2": (QWEN2_SPLIT,),
    "llama-bpe": (LLAMA3_SPLIT,),
    "dbrx": (LLAMA3_SPLIT,),
    "gpt-4o": (GPT4O_SPLIT,),
    "deepseek-v3": DEEPSEEK_V3_SPLITS,
    "deepseek-llm": DEEPSEEK_LLM_SPLITS,
}
# names whose tokenizer.json keeps a word that is itself in the vocabulary whole (the BPE model's ignore_merges):
# GPT-OSS's, as tiktoken encodes
IGNORE_MERGES = frozenset({"gpt-4o"})
# names that split each digit apart before GPT-2's byte-level regex: SmolLM's, StarCoder's, Granite 3's ("refact")
_DIGITS_APART = ("smollm", "starcoder", "refact")


def pre_tokenizer(pre: str):
    """The `tokenizers` pre-tokenizer for `pre` (one of gguf_config.PRE_TOKENIZERS); GPT-2's byte-level split for
    the names that use it as it is ("default", "gpt-2", "olmo")."""
    from tokenizers import Regex, pre_tokenizers

    if pre in SPLITS:
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in SPLITS[pre]]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
        return pre_tokenizers.Sequence([*splits, byte_level])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _DIGITS_APART:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level
