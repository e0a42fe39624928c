"""Output items and streaming events against the openai SDK's own types and its stream accumulator: every
event validates as one of the SDK's `ResponseStreamEvent` models, the SDK's accumulation of the events is
the output built from the whole text, and reasoning, text and function calls come out in the order the model
wrote them (no model needed: api.completions.chat_output splits a known text)."""

from __future__ import annotations

import random

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from motet.api.completions.chat_output import ChatOutput
from motet.api.responses.items import OutputItems

EVENT = TypeAdapter(ResponseStreamEvent)
TEXT = (
    "<think>The user wants the weather.</think>Let me check. "
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def response(items: list[dict], status: str = "completed") -> dict:
    return {"id": "resp_1", "object": "response", "created_at": 0, "model": "m", "status": status, "output": items,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}  # fmt: skip


def build(pieces: list[str], finish_reason: str = "stop") -> tuple[list[dict], list[dict]]:
    """(items, events) for the text arriving in `pieces`, as the streaming route builds them."""
    output, items = ChatOutput(reasoning=True, tools=True), OutputItems()
    events = []
    for piece in pieces:
        events += items.feed(output.feed(piece))
    deltas, _ = output.finish(finish_reason)
    events += items.feed(deltas) + items.close(incomplete=finish_reason == "length")
    return items.items, events


def without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]


def chunks(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("seed", range(5))
def test_events_are_the_sdks_and_accumulate_to_the_whole_output(seed):
    whole, _ = build([TEXT])
    items, events = build(chunks(TEXT, random.Random(seed)))
    assert without_ids(items) == without_ids(whole)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "The user wants the weather."
    assert items[1]["content"][0]["text"].strip() == "Let me check."
    assert [(i["name"], i["arguments"]) for i in items[2:]] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", "{}"),
    ]

    state = ResponseStreamState(input_tools=omit, text_format=omit)  # the SDK's own accumulator
    sequence = [{"type": "response.created", "response": response([], "in_progress")}, *events,
                {"type": "response.completed", "response": response(items)}]  # fmt: skip
    for n, event in enumerate(sequence):
        parsed = EVENT.validate_python(event | {"sequence_number": n})
        state.handle_event(parsed)
    final = state._completed_response
    assert final is not None and [i.model_dump(exclude_none=True) for i in final.output] == [
        Response.model_validate(response(items)).output[k].model_dump(exclude_none=True)
        for k in range(len(items))
    ]
    snapshot_text = [p.text for item in state._ResponseStreamState__current_snapshot.output if item.type == "message"
                     for p in item.content]  # fmt: skip
    assert snapshot_text == [items[1]["content"][0]["text"]]  # built from the deltas alone


def test_a_cut_off_output_ends_its_item_incomplete():
    items, events = build(['{"a": [1, 2'], finish_reason="length")
    assert [i["status"] for i in items] == ["incomplete"]
    assert events[-1]["type"] == "response.output_item.done" and events[-1]["item"]["status"] == "incomplete"
    Response.model_validate(response(items, "incomplete"))
