"""A response's output items, built from the chat output's deltas, and the streaming events that build them.

motet/api/completions/chat_output.py already splits a choice's text into reasoning, content and tool calls, whole or
streamed; here its deltas become Responses output items (`reasoning`, `message` with one `output_text`
part, `function_call`) in the order the model wrote them, and each step is an event
(`response.output_item.added`, `response.output_text.delta`, `response.function_call_arguments.delta`,
..., `response.output_item.done`). A whole (non-streamed) response is built by the same code from the
whole text, so a client that accumulates the events gets exactly the stored response's output.
Events are returned without their `sequence_number`: the stream numbers what it sends.

`model_visible` is the other direction: items (a request's input, a stored output) reduced to what the model is
shown of them again, which is all a stored conversation keeps.
"""

from __future__ import annotations

import uuid


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None  # the item being written (the last of self.items)
        self._call_items: dict[int, dict] = {}  # the chat tool-call index -> its function_call item

    def feed(self, deltas: list[dict]) -> list[dict]:
        """The events for some chat deltas ({"reasoning_content"}, {"content"}, {"tool_calls"})."""
        events: list[dict] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
        return events

    def close(self, incomplete: bool = False) -> list[dict]:
        """The events that finish the item being written (the output ends)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        item["status"] = "incomplete" if incomplete else "completed"
        events: list[dict] = []
        if item["type"] == "function_call":
            events.append(
                _event("response.function_call_arguments.done", item, index, arguments=item["arguments"])
            )
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            done = {"text": part["text"]} | ({"logprobs": []} if kind == "output_text" else {})
            events.append(_event(f"response.{kind}.done", item, index, content_index=0, **done))
            events.append(_event("response.content_part.done", item, index, content_index=0, part=dict(part)))
        events.append({"type": "response.output_item.done", "output_index": index, "item": _copy(item)})
        return events

    # -- the three kinds of item ------------------------------------------------------------------------
    def _start(self, item: dict) -> list[dict]:
        events = self.close()
        self.items.append(item)
        self._open = item
        added = _copy(item) | ({"content": []} if "content" in item else {})
        return events + [
            {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": added}
        ]

    def _text(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        item = self._open
        if item is None or item["type"] != kind:
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress"}
            else:
                part = {"type": "reasoning_text", "text": ""}
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            events += self._start(item | {"content": [part]})
            item = self._open
            events.append(_event("response.content_part.added", item, len(self.items) - 1, content_index=0,
                                 part=dict(part)))  # fmt: skip
        item["content"][0]["text"] += text
        delta = {"delta": text} | ({"logprobs": []} if kind == "message" else {})
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append(_event(name, item, len(self.items) - 1, content_index=0, **delta))
        return events

    def _call(self, call: dict) -> list[dict]:
        fn = call.get("function") or {}
        if "id" in call:  # a new call
            item = {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": fn.get("name", ""),
                    "arguments": "", "status": "in_progress"}  # fmt: skip
            events = self._start(item)
            self._call_items[call["index"]] = item
        else:
            events = []
        fragment = fn.get("arguments") or ""
        if fragment:
            item = self._call_items[call["index"]]
            item["arguments"] += fragment
            index = self.items.index(item)
            events.append(_event("response.function_call_arguments.delta", item, index, delta=fragment))
        return events


# The fields motet/api/responses/request.py `to_messages` reads of each kind of item (and of a content part);
# reasoning items are never shown to the model again.
_VISIBLE_KEYS = {
    "message": ("type", "role", "content"),
    "function_call": ("type", "call_id", "name", "arguments"),
    "function_call_output": ("type", "call_id", "output"),
}
_VISIBLE_PART_KEYS = ("type", "text", "refusal")


def model_visible(items: list) -> list:
    """The items as the model sees them: what to_messages reads, nothing else. Reasoning items, ids,
    statuses, `encrypted_content`, `annotations` and `logprobs` are dropped, so a stored conversation is
    bounded by the text the model was shown. Items of kinds it does not know are kept whole (the request
    validation accepted them, so they mean something)."""
    out = []
    for item in items:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":
            continue
        if kind not in _VISIBLE_KEYS:
            out.append(item)
            continue
        kept = {key: item[key] for key in _VISIBLE_KEYS[kind] if key in item} | {"type": kind}
        for key in ("content", "output"):
            if isinstance(kept.get(key), list):
                kept[key] = [
                    {k: p[k] for k in _VISIBLE_PART_KEYS if k in p} if isinstance(p, dict) else p
                    for p in kept[key]
                ]
        out.append(kept)
    return out


def _event(kind: str, item: dict, index: int, **fields) -> dict:
    return {"type": kind, "item_id": item["id"], "output_index": index, **fields}


def _copy(item: dict) -> dict:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out
