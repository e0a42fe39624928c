"""What the streaming tests share: a stream parser fed its output in pieces, and the ways of cutting an output."""

from __future__ import annotations

import itertools
import random

from motet.grammar.tool_call_parser import ContentDelta, ToolCallArguments, ToolCallStart


def collect(events) -> tuple[str, list[tuple[str, str]]]:
    """Fold stream events into (content, [(name, arguments)]), checking their order as we go."""
    content, calls = [], []
    for ev in events:
        if isinstance(ev, ContentDelta):
            assert ev.text
            content.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            assert ev.index == len(calls)
            calls.append([ev.name, ""])
        else:
            assert isinstance(ev, ToolCallArguments) and ev.fragment
            assert ev.index == len(calls) - 1
            calls[-1][1] += ev.fragment
    return "".join(content), [tuple(c) for c in calls]


def pieces(text: str, cuts: list[int]) -> list[str]:
    """`text` cut at `cuts` (in any order, repeats allowed): the deltas a stream parser is fed, in order."""
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def feed_calls(parser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """A tool-call stream parser fed `text` cut at `cuts`, then finished: its events folded by `collect`."""
    events = []
    for delta in pieces(text, cuts):
        events += parser.feed(delta)
    return collect(events + parser.finish())


def feed_reasoning(parser, text: str, cuts: list[int]) -> tuple[str, str]:
    """A reasoning stream parser fed `text` cut at `cuts`, then finished: its (reasoning, content) deltas joined."""
    deltas = [parser.feed(delta) for delta in pieces(text, cuts)]
    deltas.append(parser.finish())
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def every_split(text: str, draws: int):
    """Ways to cut `text`: not at all, at every character, at each single place, then `draws` random sets of up
    to 12 cuts (seeded by the text)."""
    yield []
    yield list(range(1, len(text)))
    for i in range(len(text) + 1):
        yield [i]
    rng = random.Random(text)
    for _ in range(draws):
        yield rng.sample(range(len(text) + 1), rng.randint(1, min(12, len(text) + 1)))
