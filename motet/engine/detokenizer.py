"""Incremental detokenization and stop strings, for streaming output text."""

from __future__ import annotations

_CONTEXT = 5  # prompt tokens decoded with the first output tokens, for their leading space (vLLM: 5)


def raw_decoder(tokenizer):
    """The Rust tokenizer's own `decode(ids, skip_special_tokens=...)` where Hugging Face's `decode` returns exactly
    what it does (a fast tokenizer with no clean-up of tokenization spaces), else `tokenizer.decode`: the
    wrapper's argument handling costs ~5x the decode itself, twice per token of every streamed row."""
    backend = getattr(tokenizer, "_tokenizer", None)
    cleans = getattr(tokenizer, "clean_up_tokenization_spaces", True)
    if backend is None or not hasattr(backend, "decode") or cleans:
        return tokenizer.decode
    return backend.decode


class IncrementalDetokenizer:
    """Text deltas token by token, decoding only a small window (vLLM's prefix/read offsets).

    The window holds ids already emitted (context, so the next ones decode as they would in the full
    text) and ids not emitted yet. A delta is released only when the window's text does not end with
    U+FFFD, i.e. no multi-byte character is cut.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._raw = raw_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT:])  # the window: context, then unread ids
        self.read = len(self.ids)
        self._context_text = self._decode(self.ids)
        self._pieces: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._raw(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._emit(final=False)

    def peek(self, token_ids: list[int]) -> list[str]:
        """The deltas that pushing `token_ids` one by one would give, without pushing them (drafts)."""
        clone = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        clone.__dict__.update(self.__dict__, ids=list(self.ids), _pieces=[])
        return [clone.push(t) for t in token_ids]

    def flush(self) -> str:
        """Whatever is still held at the end (an incomplete character becomes U+FFFD)."""
        return self._emit(final=True) if self.read < len(self.ids) else ""

    def _emit(self, final: bool) -> str:
        text = self._decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""  # a character is cut: wait for its remaining bytes
        delta = text[len(self._context_text) :]
        self.ids = self.ids[self.read :]  # the ids just read are the next window's context
        self.read = len(self.ids)
        self._context_text = self._decode(self.ids)
        self._pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        return "".join(self._pieces)


class StopStringMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that may begin one.

    "First" is the stop that completes first in the stream (earliest end; on a tie the earliest start),
    so the result does not depend on how the text is split into deltas.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False):
        self.stops = [s for s in stops if s]
        self.include = include_stop_str_in_output
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the stream
        self._held = ""

    @property
    def reads_text(self) -> bool:
        """Whether the output's ending depends on its text (any stop string): its text is needed as it comes."""
        return bool(self.stops)

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, stopped?); after a stop, everything else is dropped."""
        if self.stopped:
            return "", True
        buf = self._held + delta
        hits = [(i + len(s), i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            end, start, self.matched = min(hits)
            self.stopped, self._held = True, ""
            return buf[: end if self.include else start], True
        keep = self._partial_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _partial_len(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        for n in range(min(len(buf), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def peek(self, token_ids: list[int]) -> list[str]:
        """The deltas that pushing `token_ids` one by one would give, without pushing them (drafts)."""
        clone = IncrementalDetokenizer.__new__(IncrementalDetokenizer)
        clone.__dict__.update(self.__dict__, ids=list(self.ids), _pieces=[])
        return [clone.push(t) for t in token_ids]

    def flush(self) -> str:
        """The held-back tail, at the end of a stream that hit no stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


class StopChain:
    """Stop matchers applied in turn, each one's released text feeding the next, as one matcher: the earliest
    stop ends the stream, and `matched` is its stop string (None when a stop of another kind ended it)."""

    reads_text = True  # (a chain holds a matcher of text besides the stop strings)

    def __init__(self, *matchers):
        self.matchers = matchers
        self.stopped = False
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        return self._through(delta, final=False), self.stopped

    def flush(self) -> str:
        return "" if self.stopped else self._through("", final=True)

    def _through(self, text: str, final: bool) -> str:
        for m in self.matchers:
            text, stopped = m.feed(text)
            if stopped:  # a later matcher may still cut the released text earlier; the rest of it ends here
                self.stopped, self.matched, final = True, m.matched, True
            elif final:
                text += m.flush()
        return text
