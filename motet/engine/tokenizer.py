"""Tokenizer loading and chat-template rendering (Hugging Face fast tokenizers, local files only).

A model directory's tokenizer is the class transformers' AutoTokenizer picks for it. Picking it reads the model's
config through its family's config class, whose import pulls in most of transformers' modelling code and
torch.distributed (seconds of every start), to name a class that only the directory's files decide: the class
picked is remembered under the motet cache (`tokenizer_class_memo`), keyed by those files and transformers' and
tokenizers' versions, and a later start loads the directory with that class directly, as AutoTokenizer would.
Where that class answers serving with its Rust tokenizer's answers (most fast tokenizers), a snapshot of it is kept
beside the memo (motet/engine/tokenizer_snapshot.py), and a later start serves from it without importing
transformers at all (issue 65: a second or two of every warm start)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from motet.engine.request_checks import MAX_PROMPT_CHARS
from motet.engine.template_worker import template_worker
from motet.engine.tokenizer_snapshot import TokenizerSnapshot, read_snapshot, snapshot_of
from motet.models.declaration import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class Tokenizer:
    """A thin front over the HF tokenizer: plain encode/decode and chat rendering with clear errors. `hf`: the
    transformers tokenizer, or its snapshot (TokenizerSnapshot: the same answers to what serving asks of it);
    `transformers()`: the transformers tokenizer itself (loaded then, where `hf` is a snapshot)."""

    def __init__(self, hf: PreTrainedTokenizerBase | TokenizerSnapshot):
        self.hf = hf
        self.vocab_size = len(hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        max_chars: int | None = None,
        **template_kwargs,
    ) -> str:
        """The chat as prompt text. `chat_template`: a request's own template instead of the model's, rendered
        within bounds in a helper process (motet/engine/template_worker.py) that returns at most `max_chars`
        + 1 characters; `template_kwargs` (continue_final_message, tools, ...) go to `apply_chat_template`."""
        kwargs = {"add_generation_prompt": add_generation_prompt, **template_kwargs}
        if chat_template is not None:
            worker = template_worker(self.hf.name_or_path)
            try:
                return worker.render(messages, chat_template, kwargs, max_chars or MAX_PROMPT_CHARS)
            except ValueError as e:
                raise ValueError(
                    f"messages could not be rendered with the request's chat_template: {e}"
                ) from None
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use the completions API instead")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # jinja errors carry the template's own message
            raise ValueError(f"messages could not be rendered with the chat template: {e}") from None

    def encode_chat(self, messages: list[dict], **kw) -> list[int]:
        # The template writes the special tokens itself: do not add BOS again.
        return self.hf.encode(self.render_chat(messages, **kw), add_special_tokens=False)

    def transformers(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer (the grammar backends' libraries read one)."""
        return self.hf.transformers() if isinstance(self.hf, TokenizerSnapshot) else self.hf

    # Pass-throughs the detokenizer and grammar backends use.
    def __getattr__(self, name):
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return len(self.hf)


# The files AutoTokenizer may open in a model directory: each must be a regular file where it is there (a FIFO
# would block the start-up for ever, inside the tokenizers library).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)  # fmt: skip


_early: dict[Path, Future] = {}  # model directory -> its tokenizer, loading since `load_tokenizer_early`
_early_lock = threading.Lock()


def load_tokenizer_early(model_dir: str | Path) -> None:
    """Begin loading `model_dir`'s tokenizer from its snapshot, where one is kept, in a thread of its own, for the
    `load_tokenizer` that follows: a start's first work, so that the Rust tokenizer's build (off the GIL; a second
    or more for a 262k vocabulary) runs beside the imports (issue 65). (Without a snapshot, `load_tokenizer` loads
    it through transformers as always: never one thread importing transformers while another imports torch.)"""
    key, done = Path(model_dir).resolve(), Future()
    with _early_lock:
        if key in _early:
            return
        _early[key] = done

    def load() -> None:
        try:
            done.set_result(_load_tokenizer(model_dir, snapshot_only=True))
        except BaseException as e:
            done.set_exception(e)

    threading.Thread(target=load, name="motet-tokenizer", daemon=True).start()


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """`model_dir`'s tokenizer (the one `load_tokenizer_early` began loading, where it did); ModelLoadError where
    it does not load."""
    with _early_lock:
        early = _early.pop(Path(model_dir).resolve(), None)
    loaded = early.result() if early is not None else None
    return loaded if loaded is not None else _load_tokenizer(model_dir)


def _load_tokenizer(model_dir: str | Path, snapshot_only: bool = False) -> Tokenizer | None:
    """The tokenizer (`snapshot_only`: from its snapshot, else None)."""
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.exists() and not path.is_file():
            raise ModelLoadError(f"{path}: not a regular file")
    try:
        hf = _load_hf(Path(model_dir), snapshot_only)
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: could not load the tokenizer ({e})") from None
    return None if hf is None else Tokenizer(hf)


MEMO_FORMAT = 2  # raised when what a memo holds changes
MEMOS_KEPT = 256  # the most recently written; older ones are removed as one is written (a memo is ~100 bytes)


def library_versions() -> list[str]:
    """transformers' and tokenizers' versions, read without importing them."""
    from importlib.metadata import version

    return [version("transformers"), version("tokenizers")]


def tokenizer_class_memo(model_dir: Path) -> Path:
    """Where the tokenizer class AutoTokenizer picked for `model_dir` is remembered: keyed by the directory, the
    files the pick reads (config.json and the tokenizer's: their sizes and modification times) and transformers'
    and tokenizers' versions, so that a changed file or another transformers picks again. Its snapshot, where one
    is kept, lies beside it (`snapshot_path`)."""
    from motet.engine.cache_root import cache_dir

    model_dir = model_dir.resolve()
    files = []
    for name in ("config.json", *TOKENIZER_FILES):
        with contextlib.suppress(OSError):
            st = (model_dir / name).stat()
            files.append([name, st.st_size, st.st_mtime_ns])
    key = json.dumps([MEMO_FORMAT, str(model_dir), library_versions(), files])
    return cache_dir() / "tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def snapshot_paths(memo: Path) -> tuple[Path, Path]:
    """Where a snapshot's settings and its Rust tokenizer lie, beside the memo."""
    return memo.with_suffix(".snapshot"), memo.with_suffix(".backend")


def _remembered_class(memo: Path):
    """The class a memo names, or None (none yet, or unreadable)."""
    try:
        named = json.loads(memo.read_text())
        cls = getattr(importlib.import_module(named["module"]), named["class"])
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) else None


def _write(path: Path, data: dict | str) -> None:
    """`data` at `path` (a dict as JSON), whole or not at all."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data if isinstance(data, str) else json.dumps(data))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _remember(memo: Path, hf) -> None:
    """Write the memo, and the tokenizer's snapshot where it answers as one (whole, or not at all: a cache that
    cannot be written is only slower)."""
    cls = type(hf)
    if not cls.__module__.startswith("transformers."):  # (a model's own code: always through AutoTokenizer)
        return
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        _write(memo, {"module": cls.__module__, "class": cls.__qualname__})
        _keep_snapshot(memo, hf)
        memos = sorted(memo.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in memos[MEMOS_KEPT:]:
            old.unlink(missing_ok=True)
            for path in snapshot_paths(old):
                path.unlink(missing_ok=True)


def _keep_snapshot(memo: Path, hf) -> None:
    held = snapshot_of(hf)
    if held is not None:
        settings, backend = snapshot_paths(memo)
        _write(backend, held[1])
        _write(settings, held[0])  # (last: settings name a backend that is there)


def _load_hf(
    model_dir: Path, snapshot_only: bool = False
) -> PreTrainedTokenizerBase | TokenizerSnapshot | None:
    """The directory's tokenizer as AutoTokenizer loads it: its snapshot where one is kept; else through the class
    AutoTokenizer picked before, where it is remembered (AutoTokenizer ends by calling that class's from_pretrained
    on the directory, as this does), keeping its snapshot where it was not kept yet."""
    memo = tokenizer_class_memo(model_dir)
    snapshot = read_snapshot(*snapshot_paths(memo), lambda: _load_transformers(model_dir, memo))
    if snapshot is not None or snapshot_only:
        return snapshot
    return _load_transformers(model_dir, memo, keep=True)


def _load_transformers(model_dir: Path, memo: Path, keep: bool = False) -> PreTrainedTokenizerBase:
    """The directory's transformers tokenizer (`keep`: its memo and snapshot written where they are not yet)."""
    cls = _remembered_class(memo)
    if cls is not None:
        hf = cls.from_pretrained(str(model_dir), local_files_only=True)
        if keep and cls.__module__.startswith("transformers."):
            with contextlib.suppress(OSError):
                _keep_snapshot(memo, hf)
        return hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    _remember(memo, hf)
    return hf
