"""Reasoning output (`<think>...</think>`): split it from the content, whole or while streaming.

Reasoning models (DeepSeek-R1, Qwen3, ...) write their thoughts first, then the answer:

    <think>
    thoughts
    </think>

    answer

The API returns the thoughts as `reasoning_content` and the answer as `content`. `started=True` says the
prompt already opened `<think>` (DeepSeek-R1's template does), so the output begins inside the reasoning.

A grammar (JSON schema, tool calls) constrains the content only, so the engine must know where it begins
(motet/engine/guided.py): after `</think>` when the reasoning is open, else from the output's first token.
Which one is decided by the first token(s): `ReasoningOpening` says which tokens may still open `<think>`.

Rules (shared by `split_reasoning` and `ReasoningStreamParser`, which agree for any split):
  - Without `started`, the output enters reasoning only if it begins with optional whitespace and
    `<think>`; otherwise all of it is content, verbatim, and there is no reasoning (None).
  - The reasoning is the text up to `</think>` (or to the end when it never comes; the content is then
    ""), stripped of surrounding whitespace - the newlines Qwen3's template puts after `<think>` and
    before `</think>` - and None when that leaves nothing.
  - The content after `</think>` has its leading whitespace stripped (Qwen3's "\\n\\n").
"""

from __future__ import annotations

REASONING_START = "<think>"
REASONING_END = "</think>"


def _enter(text: str, started: bool) -> int | None:
    """Offset where the reasoning text begins, or None if the output has no reasoning."""
    if started:
        return 0
    head = text.lstrip()
    if head.startswith(REASONING_START):
        return len(text) - len(head) + len(REASONING_START)
    return None


def split_reasoning(text: str, started: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a complete output."""
    begin = _enter(text, started)
    if begin is None:
        return None, text
    end = text.find(REASONING_END, begin)
    if end < 0:
        return text[begin:].strip() or None, ""
    return text[begin:end].strip() or None, text[end + len(REASONING_END) :].lstrip()


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt already opened the reasoning (its output starts inside it: `started`)."""
    return prompt_text.rstrip().endswith(REASONING_START)


def reasoning_ended(text: str, started: bool = False) -> bool:
    """Whether the output so far is past its reasoning: `</think>` came, or (without `started`) the
    output has shown it does not open with `<think>`."""
    if not started:
        head = text.lstrip()
        if not head.startswith(REASONING_START):
            return not REASONING_START.startswith(head)  # undecided while it may still become <think>
    return REASONING_END in text[_enter(text, started) :]


class ReasoningOpening:
    """Which tokens continue `<think>` at the start of an output, from each token's decoded bytes (computed
    once per tokenizer): the engine's mask lets an output open its reasoning while it is undecided.

    `progress` is how many bytes of `<think>` the output has written so far (0 at its start). A token
    continues it when its bytes are the tag's next bytes, or the tag's rest followed by more (the tag then
    complete: `advance` returns `len(TAG)`). Leading whitespace does not count: an output opens its
    reasoning only with `<think>` itself, as the models that reason write it.
    """

    TAG = REASONING_START.encode()

    def __init__(self, decoded_vocab: list[bytes]):
        self._vocab = decoded_vocab
        # The tag's bytes are all different, so a token's first byte names the one progress it continues.
        where = {byte: k for k, byte in enumerate(self.TAG)}
        self._tokens: list[list[int]] = [[] for _ in self.TAG]
        for token, text in enumerate(decoded_vocab):
            k = where.get(text[0]) if text else None
            if k is not None and self.advance(k, token) is not None:
                self._tokens[k].append(token)

    def advance(self, progress: int, token: int) -> int | None:
        """The progress after `token`; None when the token does not continue `<think>`."""
        text = self._vocab[token] if 0 <= token < len(self._vocab) else b""
        rest = self.TAG[progress:]
        if not text:
            return None
        if rest.startswith(text):
            return progress + len(text)
        return len(self.TAG) if text.startswith(rest) else None

    def tokens(self, progress: int) -> list[int]:
        """The tokens that continue `<think>` from `progress` (< len(TAG))."""
        return self._tokens[progress]


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStreamParser:
    """Incremental `split_reasoning`: `feed(delta)` and `finish()` return (reasoning, content) deltas.

    Holds back only what is still undecided: leading whitespace or a partial `<think>` at the start, a
    partial `</think>`, and whitespace that the stripping rules may drop.
    """

    def __init__(self, started: bool = False):
        # "start": undecided whether the output opens <think>; "reasoning"; "content" (after </think>);
        # "plain" (no reasoning: content verbatim).
        self._state = "reasoning" if started else "start"
        self._buf = ""
        self._reasoning_started = False
        self._pending_ws = ""  # trailing reasoning whitespace, released only if reasoning follows

    @property
    def reasoning_ended(self) -> bool:
        return self._state in ("content", "plain")

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._process(final=False)

    def finish(self) -> tuple[str, str]:
        return self._process(final=True)

    def _process(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(REASONING_START):
                self._state = "reasoning"
                self._buf = head[len(REASONING_START) :]
            elif final or not REASONING_START.startswith(head):
                self._state = "plain"
            else:
                return "", ""  # only whitespace or a partial <think> so far
        if self._state == "reasoning":
            end = self._buf.find(REASONING_END)
            if end >= 0:
                reasoning.append(self._reasoning(self._buf[:end]))
                self._state = "content"
                self._buf = self._buf[end + len(REASONING_END) :]
            else:
                keep = 0 if final else _partial_tag_len(self._buf, REASONING_END)
                reasoning.append(self._reasoning(self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
        if self._state == "content":
            self._buf = self._buf.lstrip()
            if self._buf:
                self._state = "plain"  # leading whitespace is gone: the rest passes through
        if self._state == "plain":
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)

    def _reasoning(self, text: str) -> str:
        """Reasoning text to emit so that the deltas add up to the stripped reasoning."""
        if not self._reasoning_started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return ""
        out = self._pending_ws + body
        self._pending_ws = text[len(body) :]
        self._reasoning_started = True
        return out
