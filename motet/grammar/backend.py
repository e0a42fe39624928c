"""The grammar backend interface, the tokenizer view the backends share, and bitmask helpers.

Bitmask layout (xgrammar's): int32 tensor `[batch, ceil(vocab_size / 32)]`, bit `t % 32` of word
`t // 32` set when token `t` is allowed. `vocab_size` is the model's logits width, which may differ
from the tokenizer's length; ids past the tokenizer are never allowed. The engine allocates one
bitmask for a batch, each constrained row's matcher fills its row, and `apply_bitmask` masks only
those rows of the logits.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
from abc import ABC, abstractmethod
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from motet.grammar.specs import GrammarError, GrammarSpec, reduced, short_error

if TYPE_CHECKING:
    from motet.grammar.specs import EbnfSpec, JsonSchemaSpec, RegexSpec, StructuralTagSpec


class Matcher(ABC):
    """The state of one sequence in a compiled grammar."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it.
        A stop token is accepted only where the grammar can end, and terminates the matcher."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (CPU int32)."""

    @classmethod
    def fill_many(cls, bitmask: torch.Tensor, items: list[tuple[Matcher, int]]) -> None:
        """Fill the rows of many unterminated matchers of this class, `items` holding (matcher, row) pairs: row by
        row here; a backend with a multi-threaded call of its own (xgrammar's, llguidance's) overrides it."""
        for m, row in items:
            m.fill_bitmask(bitmask, row)

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts the target model rejects)."""

    @abstractmethod
    def find_jump_forward_string(self) -> str:
        """The longest string the grammar forces from here ("" if none or unsupported)."""


class CompiledGrammar(ABC):
    """A spec compiled for one tokenizer; immutable and shared by all matchers."""

    backend: str

    @abstractmethod
    def matcher(self) -> Matcher: ...


class Backend(ABC):
    """Compiles specs for one tokenizer. `compile` reduces a spec to a kind the backends read (`specs.reduced`)
    and hands it to that kind's method, `compile_<kind>`; they raise GrammarError when they cannot compile it,
    by default (a kind the backend does not read) as unsupported."""

    name: str
    # What the kinds' methods may raise that means "this grammar does not compile" (GrammarError as unsupported).
    compile_errors: tuple[type[Exception], ...] = ()

    def __init__(self, tokenizer: GrammarTokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()  # (what `built_once` builds under)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        spec = reduced(spec)
        compile_kind = getattr(self, f"compile_{getattr(spec, 'kind', '')}", None)
        if compile_kind is None:
            raise GrammarError(f"unknown grammar spec {type(spec).__name__}")
        try:
            return compile_kind(spec)
        except GrammarError:
            raise
        except self.compile_errors as e:
            raise self.cannot_compile(spec, e) from e

    def cannot_compile(self, spec: GrammarSpec, error: BaseException | str) -> GrammarError:
        """The error of a spec the backend cannot compile (unsupported), with the first line of its own."""
        return GrammarError(
            f"{self.name} cannot compile this {spec.kind}: {short_error(error)}", "unsupported"
        )

    def compile_json_schema(self, spec: JsonSchemaSpec) -> CompiledGrammar:
        raise GrammarError(f"{self.name} does not support JSON-schema grammars", "unsupported")

    def compile_regex(self, spec: RegexSpec) -> CompiledGrammar:
        raise GrammarError(f"{self.name} does not support regex grammars", "unsupported")

    def compile_ebnf(self, spec: EbnfSpec) -> CompiledGrammar:
        raise GrammarError(f"{self.name} does not support EBNF grammars", "unsupported")

    def compile_structural_tag(self, spec: StructuralTagSpec) -> CompiledGrammar:
        raise GrammarError(f"{self.name} does not support structural-tag grammars", "unsupported")


def built_once(build):
    """A backend's property built on its first use, once however many threads ask at once (under the backend's
    `_lock`): a backend's view of its tokenizer takes seconds to build."""
    attr = f"_built_{build.__name__}"

    @functools.wraps(build)
    def get(self):
        with self._lock:
            if attr not in self.__dict__:
                self.__dict__[attr] = build(self)
            return self.__dict__[attr]

    return property(get)


class GrammarTokenizer:
    """What the backends need of a Hugging Face tokenizer, computed once.

    Special tokens (`<|im_start|>`, ...) are made unreachable: they decode to text that could
    otherwise appear inside a JSON string. Stop tokens (default: eos) end a grammar.
    """

    def __init__(self, tokenizer, vocab_size: int | None = None, stop_token_ids: list[int] | None = None):
        import xgrammar as xgr

        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.vocab_size = vocab_size or max(len(vocab), max(vocab.values()) + 1)
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise ValueError("tokenizer has no eos token: pass stop_token_ids")
            stop_token_ids = [tokenizer.eos_token_id]
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        special = set(tokenizer.all_special_ids)
        special |= {i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special}
        self.special_token_ids = sorted(special | set(self.stop_token_ids))

        # Let xgrammar detect the vocab's encoding (byte-level BPE, SentencePiece byte fallback, ...),
        # then rebuild it with special tokens blanked ("" marks a token as special in xgrammar).
        detected = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        encoded = [""] * self.vocab_size
        for token, i in vocab.items():
            if i < self.vocab_size and i not in special:
                encoded[i] = token
        self.xgr_info = xgr.TokenizerInfo(
            encoded,
            detected.vocab_type,
            vocab_size=self.vocab_size,
            stop_token_ids=self.stop_token_ids,
            add_prefix_space=detected.add_prefix_space,
        )
        # Each token's bytes as it appears in decoded text (b"" for special / unused ids).
        self.decoded_vocab: list[bytes] = [bytes(b) for b in self.xgr_info.decoded_vocab]

    @cached_property
    def key(self) -> str:
        """Identity for cache keys: two tokenizers with the same key mask identically."""
        h = hashlib.sha256()
        h.update(repr((self.vocab_size, self.stop_token_ids)).encode())
        for b in self.decoded_vocab:
            h.update(len(b).to_bytes(4, "little") + b)
        return h.hexdigest()[:16]


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask with every token allowed."""
    return torch.full((batch_size, math.ceil(vocab_size / 32)), -1, dtype=torch.int32)


def set_token_bits(bitmask: torch.Tensor, row: int, token_ids: list[int], clear: bool = False) -> None:
    """Allow `token_ids` in `bitmask[row]` (after disallowing everything if `clear`)."""
    if clear:
        bitmask[row].zero_()
    for t in token_ids:
        word = (int(bitmask[row, t // 32]) & 0xFFFFFFFF) | (1 << (t % 32))
        bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # as signed int32


def bitmask_allows(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def allowed_token_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """The ids whose bits are set in `bitmask[row]` (for tests and debugging)."""
    bits = np.unpackbits(bitmask[row].contiguous().numpy().view(np.uint8), bitorder="little")
    return torch.from_numpy(np.flatnonzero(bits[:vocab_size]))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set disallowed tokens' logits to -inf in place, on `rows` only (None: every row).

    `logits[r]` is masked by `bitmask[r]`; rows not listed are left untouched. Logits wider than
    the bitmask (padded vocab) are masked to -inf past its end. Works on CPU and CUDA.
    """
    import xgrammar as xgr

    if rows is not None:
        rows = [int(r) for r in rows]
        if not rows:
            return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    width = min(logits.shape[-1], bitmask.shape[-1] * 32)
    if logits.dtype == torch.float32 or logits.is_cuda:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
    else:  # xgrammar's CPU kernel takes float32 only: mask a float32 copy (exact for bf16/fp16)
        idx = list(range(logits.shape[0])) if rows is None else rows
        tmp = logits[idx].float()
        xgr.apply_token_bitmask_inplace(tmp, bitmask[idx], vocab_size=width)
        logits[idx] = tmp.to(logits.dtype)
    if logits.shape[-1] > width:
        logits[slice(None) if rows is None else rows, width:] = float("-inf")
