"""A tokenizer as transformers built it, kept so that a later start needs no transformers (issue 65: importing it
and building the tokenizer through it were a second or two of every warm start, on the serving path).

What transformers' fast tokenizer (TokenizersBackend) answers for serving is its Rust tokenizer's (`_tokenizer`:
encode, decode, ids to tokens, the vocabulary's size) plus a few of its own settings (the special tokens, the chat
template): `snapshot` writes those, the Rust tokenizer as transformers left it (its to_str(), every change
transformers made to the file's included), where the class serves them unchanged (`snapshot_of` says when:
a class that overrides how it encodes, decodes or renders, splits special tokens, cleans up decoded spaces or has
several chat templates is not kept; it loads through transformers at every start, as before). `TokenizerSnapshot`
answers as the tokenizer did; anything else asked of it (the grammar backends' vocabulary, training) is asked of
the transformers tokenizer, loaded then. The chat template renders as transformers renders it
(motet/engine/chat_render.py)."""

from __future__ import annotations

import threading
from pathlib import Path

SNAPSHOT_FORMAT = 1
# TokenizersBackend's methods that serving calls: a class that overrides any of them answers in its own way
SERVED_METHODS = ("encode", "_encode_plus", "decode", "_decode", "convert_ids_to_tokens", "__len__",
                  "apply_chat_template", "get_chat_template")  # fmt: skip
SPECIAL = ("bos", "eos", "unk", "pad")


def snapshot_of(hf) -> tuple[dict, str] | None:
    """What a snapshot of `hf` (a transformers tokenizer) holds: its settings, and its Rust tokenizer as JSON; or
    None where it would not answer as `hf` does."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(hf)
    if not isinstance(hf, TokenizersBackend):
        return None
    if any(getattr(cls, m) is not getattr(TokenizersBackend, m) for m in SERVED_METHODS):
        return None
    backend = hf._tokenizer
    cleans = hf.clean_up_tokenization_spaces and not (
        type(backend.model).__name__ == "BPE"
        and not getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    )
    template = hf.chat_template
    if hf.split_special_tokens or cleans or not (template is None or isinstance(template, str)):
        return None
    special = dict(hf.special_tokens_map)
    if not all(isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))
               for v in special.values()):  # fmt: skip
        return None
    backend.no_padding()
    backend.no_truncation()
    return {
        "format": SNAPSHOT_FORMAT,
        "name_or_path": hf.name_or_path,
        "chat_template": template,
        "special_tokens_map": special,
        "special": {k: [getattr(hf, f"{k}_token"), getattr(hf, f"{k}_token_id")] for k in SPECIAL},
        "all_special_ids": list(hf.all_special_ids),
        "model_max_length": hf.model_max_length,
    }, backend.to_str()


class TokenizerSnapshot:
    """A transformers tokenizer's answers for serving, from its snapshot (`snapshot_of`), without transformers;
    `transformers()` loads the real one (`load`, a callable) for anything else."""

    def __init__(self, held: dict, backend: Path, load):
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(backend))  # (off the GIL: it builds beside other threads)
        self.name_or_path = held["name_or_path"]
        self.chat_template = held["chat_template"]
        self.special_tokens_map = held["special_tokens_map"]
        for k, (token, token_id) in held["special"].items():
            setattr(self, f"{k}_token", token)
            setattr(self, f"{k}_token_id", token_id)
        self.all_special_ids = held["all_special_ids"]
        self.model_max_length = held["model_max_length"]
        self.clean_up_tokenization_spaces = (
            False  # (a snapshot is of a tokenizer whose decode cleans nothing)
        )
        self.split_special_tokens = False
        self._load, self._hf, self._lock = load, None, threading.Lock()

    def transformers(self):
        """The transformers tokenizer this is a snapshot of (loaded on first use)."""
        from motet.serial_imports import first_imports

        with first_imports(), self._lock:  # (transformers' first import, maybe: motet/serial_imports.py)
            if self._hf is None:
                self._hf = self._load()
            return self._hf

    def __getattr__(self, name):  # (only for what the snapshot does not hold)
        if name.startswith("__") or name in ("_load", "_hf", "_lock"):
            raise AttributeError(name)
        return getattr(self.transformers(), name)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def apply_chat_template(
        self, conversation, tokenize: bool = True, chat_template: str | None = None, **kwargs
    ):
        from motet.engine.chat_render import render

        if tokenize or chat_template is not None:  # (serving asks for text, in the model's template)
            return self.transformers().apply_chat_template(
                conversation, tokenize=tokenize, chat_template=chat_template, **kwargs
            )
        if self.chat_template is None:
            raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")
        return render(self.chat_template, conversation, self.special_tokens_map, **kwargs)


def read_snapshot(path: Path, backend: Path, load) -> TokenizerSnapshot | None:
    """The snapshot kept at `path` (its settings) and `backend` (its Rust tokenizer), or None (none there, or
    unreadable)."""
    import json

    try:
        held = json.loads(path.read_text())
        if held.get("format") != SNAPSHOT_FORMAT:
            return None
        return TokenizerSnapshot(held, backend, load)
    except Exception:  # (unreadable: OSError, JSON's, a missing key, or tokenizers' own error)
        return None
