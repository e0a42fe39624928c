"""Reasoning output: the formats models write their thoughts in, split from the content, whole or streamed.

Reasoning models write their thoughts first, then the answer. The API returns the thoughts as
`reasoning_content` and the answer as `content`. The formats, by vLLM's `--reasoning-parser` names:

- `think` / `qwen3` (Qwen3, QwQ, and any model whose template uses `<think>`): `<think>\\nthoughts\\n</think>\\n\\n
  answer`. Qwen3's thinking-mode templates of the 2507 releases (and DeepSeek-R1's newer ones) open `<think>` in
  the prompt: `started` then says the output begins inside the reasoning.
- `deepseek_r1` (DeepSeek-R1 and its distills): the same tags, but the output always begins inside the reasoning,
  whether or not it writes `<think>` itself (R1 often does not): thoughts up to `</think>`, all reasoning when
  it never comes.
- `granite` (Granite 3.2's thinking mode): `Here is my thought process:` thoughts `Here is my response:` answer
  ("Here's" for "Here is" too, as quantized models write it).
- `openai_gptoss` / `gpt_oss` (GPT-OSS's harmony channels, motet/grammar/harmony.py): the `analysis` channel is
  the reasoning, `final` and preamble `commentary` the content; a message to a recipient (a tool call) is passed
  on to the content as written, for the tool-call parser (`--tool-call-parser openai`) to read.

A grammar (JSON schema, tool calls) constrains the content only, so the engine must know where it begins
(motet/engine/guided.py): after the reasoning's end (`ends`) when the output reasons, else from the output's first
token. Which one is decided by the first token(s): `ReasoningOpening` says which tokens may still open it.

Rules of the tag formats (shared by `ReasoningFormat.split` and its stream parser, which agree for any split):
  - Without `started`, the output enters reasoning only if it begins with optional whitespace and one of
    `starts`; otherwise all of it is content, verbatim, and there is no reasoning (None). With `started` it
    begins inside the reasoning; an opening tag it writes first anyway (after optional whitespace) is skipped.
  - The reasoning is the text up to the first of `ends` (or to the end when none comes; the content is then
    ""), stripped of surrounding whitespace - the newlines Qwen3's template puts after `<think>` and
    before `</think>` - and None when that leaves nothing.
  - The content after the end has its leading whitespace stripped (Qwen3's "\\n\\n").
"""

from __future__ import annotations

from dataclasses import dataclass

from motet.grammar.harmony import CHANNEL, FINAL_HEADER, HarmonyReader, Pieces
from motet.grammar.stream_text import Stripped, earliest, partial_marker_len

REASONING_START = "<think>"
REASONING_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """A model's reasoning markup (module docstring): what opens and ends it."""

    name: str
    starts: tuple[str, ...]  # what opens the reasoning at an output's start
    ends: tuple[str, ...]  # what ends it; the content (and a grammar) begins after
    always_started: bool = False  # the output begins inside the reasoning, whatever the prompt
    keeps_special_tokens: bool = False  # its markers are special tokens the output's text must keep

    def started(self, prompt_text: str) -> bool:
        """Whether an output of this rendered prompt begins inside the reasoning (the template opened it)."""
        tail = prompt_text.rstrip()
        return self.always_started or any(tail.endswith(tag) for tag in self.starts)

    def _enter(self, text: str, started: bool) -> int | None:
        """Offset where the reasoning text begins, or None if the output has no reasoning."""
        started = started or self.always_started
        head = text.lstrip()
        for tag in self.starts:
            if head.startswith(tag):
                return len(text) - len(head) + len(tag)
        return 0 if started else None

    def split(self, text: str, started: bool = False) -> tuple[str | None, str]:
        """(reasoning or None, content) of a complete output."""
        begin = self._enter(text, started)
        if begin is None:
            return None, text
        hit = earliest(text, self.ends, begin)
        if hit is None:
            return text[begin:].strip() or None, ""
        end, tag = hit
        return text[begin:end].strip() or None, text[end + len(tag) :].lstrip()

    def ended(self, text: str, started: bool = False) -> bool:
        """Whether the output so far is past its reasoning: an end came, or (without `started`) the output has
        shown it opens with none of `starts`."""
        head = text.lstrip()
        undecided = any(tag.startswith(head) and tag != head for tag in self.starts)
        begin = self._enter(text, started)
        if begin is None:
            return not undecided
        if (started or self.always_started) and undecided:
            return False
        return earliest(text, self.ends, begin) is not None

    def stream_parser(self, started: bool = False):
        """A parser with `feed(delta)` and `finish()` giving (reasoning, content) deltas that add up to `split`."""
        return ReasoningStreamParser(started or self.always_started, self)


class _Harmony(ReasoningFormat):
    """GPT-OSS's channels (motet/grammar/harmony.py): reasoning is the `analysis` bodies joined by "\\n"; content
    the other bodies and the text outside messages, joined by "\\n", with each message to a recipient written
    whole (header, `<|message|>`, body and end marker) for the tool-call parser. For the engine it begins inside
    its reasoning and constrains the answer: the text after `<|channel|>final<|message|>` (as vLLM does)."""

    def split(self, text: str, started: bool = False) -> tuple[str | None, str]:
        parser = self.stream_parser()
        r1, c1 = parser.feed(text)
        r2, c2 = parser.finish()
        return (r1 + r2) or None, c1 + c2

    def ended(self, text: str, started: bool = False) -> bool:
        return FINAL_HEADER in text

    def stream_parser(self, started: bool = False):
        return _HarmonyStream()


class _HarmonyStream:
    def __init__(self):
        self._reader = HarmonyReader()
        self._reasoning, self._content = Pieces(), Pieces()
        self._route: str | None = None  # the open message's: "reasoning", "content" or "raw"; "top" outside
        self.reasoning_ended = False

    def feed(self, delta: str) -> tuple[str, str]:
        return self._apply(self._reader.feed(delta))

    def finish(self) -> tuple[str, str]:
        return self._apply(self._reader.finish())

    def _apply(self, events) -> tuple[str, str]:
        reasoning, content = [], []
        for kind, value in events:
            if kind == "text":
                if self._route != "top":
                    self._content.start()
                    self._route = "top"
                content.append(self._content.add(value))
            elif kind == "open":
                if value.recipient is not None:
                    self._route = "raw"
                elif value.channel == "analysis":
                    self._route = "reasoning"
                else:
                    self._route = "content"
                    self.reasoning_ended = self.reasoning_ended or value.channel == "final"
                (self._reasoning if self._route == "reasoning" else self._content).start()
                if self._route == "raw":
                    content.append(self._content.add(value.text + "<|message|>"))
            elif kind == "body":
                if self._route == "reasoning":
                    reasoning.append(self._reasoning.add(value))
                else:
                    content.append(self._content.add(value))
            else:  # close
                if self._route == "raw":
                    content.append(self._content.add(value))
                self._route = None
        return "".join(reasoning), "".join(content)


THINK = ReasoningFormat("think", (REASONING_START,), (REASONING_END,))
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", (REASONING_START,), (REASONING_END,), always_started=True)
GRANITE = ReasoningFormat(
    "granite",
    ("Here is my thought process:", "Here's my thought process:"),
    ("Here is my response:", "Here's my response:"),
)
HARMONY = _Harmony("openai_gptoss", (), (FINAL_HEADER,), always_started=True, keeps_special_tokens=True)

# vLLM's --reasoning-parser names for these formats (`think`: motet's own, the first)
REASONING_FORMATS = {
    "think": THINK,
    "qwen3": THINK,
    "deepseek_r1": DEEPSEEK_R1,
    "granite": GRANITE,
    "openai_gptoss": HARMONY,
    "gpt_oss": HARMONY,
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The format named by --reasoning-parser (None or "none": no reasoning parser)."""
    if name is None or name == "none":
        return None
    try:
        return REASONING_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; one of none, {', '.join(REASONING_FORMATS)}"
        ) from None


def template_reasoning(chat_template: str | None) -> str | None:
    """The reasoning parser a chat template shows its model writes by markup no other model uses: GPT-OSS's
    analysis channel, Granite 3.2's thought process; None otherwise (`<think>` is too common a word in templates
    to turn reasoning on by itself: Qwen3's declaration names it, others take the flag)."""
    template = chat_template or ""
    if CHANNEL in template and "analysis" in template:
        return "openai_gptoss"
    if "Here is my thought process:" in template:
        return "granite"
    return None


class ReasoningOpening:
    """Which tokens continue a format's opening tags at the start of an output, from each token's decoded bytes
    (computed once per tokenizer and format): the engine's mask lets an output open its reasoning while it is
    undecided.

    `written` is the bytes of an opening tag the output has written so far (b"" at its start). A token
    continues it when its bytes are a tag's next bytes, or a tag's rest followed by more (the tag then complete:
    `advance` returns the whole tag, and `complete` says so). Leading whitespace does not count: an output opens
    its reasoning only with the tag itself, as the models that reason write it.
    """

    def __init__(
        self, decoded_vocab: list[bytes], tags: tuple[str, ...] = (REASONING_START,), exact: bool = False
    ):
        """`exact`: a token continues a tag only with the tag's own next bytes, never past its end (an end tag
        forced by the engine: what follows it is the grammar's)."""
        self._vocab = decoded_vocab
        self.exact = exact
        self.tags = tuple(tag.encode() for tag in tags)
        self._by_first: dict[int, list[int]] = {}  # a tag's byte -> the tokens whose first byte it is
        firsts = {byte for tag in self.tags for byte in tag}
        for token, text in enumerate(decoded_vocab):
            if text and text[0] in firsts:
                self._by_first.setdefault(text[0], []).append(token)
        self._tokens: dict[bytes, list[int]] = {}

    def complete(self, written: bytes) -> bool:
        return written in self.tags

    def advance(self, written: bytes, token: int) -> bytes | None:
        """What is written of a tag after `token`; None when the token continues none."""
        text = self._vocab[token] if 0 <= token < len(self._vocab) else b""
        if not text:
            return None
        for tag in self.tags:
            if not tag.startswith(written) or tag == written:
                continue
            rest = tag[len(written) :]
            if rest.startswith(text):
                return written + text
            if text.startswith(rest) and not (self.exact and text != rest):
                return tag
        return None

    def tokens(self, written: bytes) -> list[int]:
        """The tokens that continue an opening tag from `written` (no tag complete yet)."""
        if written not in self._tokens:
            firsts = {tag[len(written)] for tag in self.tags if tag.startswith(written) and tag != written}
            candidates = [t for byte in sorted(firsts) for t in self._by_first.get(byte, [])]
            self._tokens[written] = [t for t in candidates if self.advance(written, t) is not None]
        return self._tokens[written]


class ReasoningStreamParser:
    """Incremental `ReasoningFormat.split` (the tag formats): `feed(delta)` and `finish()` return (reasoning,
    content) deltas.

    Holds back only what is still undecided: leading whitespace or a partial opening tag at the start, a
    partial end tag, and whitespace that the stripping rules may drop.
    """

    def __init__(self, started: bool = False, fmt: ReasoningFormat = THINK):
        self._fmt = fmt
        self._started = started
        # "start": undecided whether the output opens with a tag; "reasoning"; "content" (after the end);
        # "plain" (no reasoning: content verbatim).
        self._state = "start"
        self._buf = ""
        self._reasoning = Stripped()  # trailing reasoning whitespace released only if reasoning follows

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
        starts, ends = self._fmt.starts, self._fmt.ends
        if self._state == "start":
            head = self._buf.lstrip()
            tag = next((t for t in starts if head.startswith(t)), None)
            if tag is not None:
                self._state = "reasoning"
                self._buf = head[len(tag) :]
            elif final or not any(t.startswith(head) for t in starts):
                self._state = "reasoning" if self._started else "plain"
            else:
                return "", ""  # only whitespace or a partial opening tag so far
        if self._state == "reasoning":
            hit = earliest(self._buf, ends)
            if hit is not None:
                end, tag = hit
                reasoning.append(self._reasoning.add(self._buf[:end]))
                self._state = "content"
                self._buf = self._buf[end + len(tag) :]
            else:
                keep = 0 if final else partial_marker_len(self._buf, ends)
                reasoning.append(self._reasoning.add(self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
        if self._state == "content":
            self._buf = self._buf.lstrip()
            if self._buf:
                self._state = "plain"  # leading whitespace is gone: the rest passes through
        if self._state == "plain":
            content.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(content)
