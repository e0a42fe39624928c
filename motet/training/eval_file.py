"""A fine-tuning job's eval file: chat examples (the supervised format) whose last assistant message is the answer
the tuned model should give to the conversation before it.

`eval_rows` checks the file as a training file is checked (line-numbered DataErrors) and keeps, a row an example,
the prompt (the messages before the last assistant message, and the tools), the expected answer (its text and
tool calls) and how many tokens to let the model answer with (the answer's own, and a few more: an answer that
goes on past it is not the same answer). `same_answer` compares a chat completion's message with it: the text
(leading and trailing whitespace aside), and each tool call's name and arguments as JSON values.
"""

from __future__ import annotations

import json
from typing import BinaryIO

from motet.grammar.tool_prompt import decoded_json
from motet.training.data_format import DataError, read_examples

EVAL_ROWS = "eval_rows.jsonl"  # in a job's run directory
MAX_EXAMPLES = 200  # an eval file's examples: each is two greedy requests (the tuned model's, the base's)
SLACK_TOKENS = 8


def eval_rows(source: BinaryIO, tokenizer, max_line_bytes: int) -> list[dict]:
    rows = []
    for example in read_examples(source, "supervised", max_line_bytes, MAX_EXAMPLES):
        last = max(i for i, m in enumerate(example.messages) if m["role"] == "assistant")
        answer = example.messages[last]
        if last != len(example.messages) - 1:
            raise DataError(
                "an eval example ends with the assistant message its answer is compared to", example.line
            )
        text = answer.get("content") or ""
        calls = _calls(answer)
        max_tokens = len(tokenizer.encode(text + json.dumps(calls) if calls else text)) + SLACK_TOKENS
        rows.append({"line": example.line, "messages": example.messages[:last],
                     "tools": [t.openai_dict() for t in example.tools], "text": text.strip(), "tool_calls": calls,
                     "max_tokens": max_tokens})  # fmt: skip
    return rows


def same_answer(row: dict, message: dict) -> bool:
    """Whether a chat completion's `message` gives the row's answer."""
    return (message.get("content") or "").strip() == row["text"] and _calls(message) == row["tool_calls"]


def _calls(message: dict) -> list[dict]:
    """A message's tool calls as {name, arguments}, the arguments as JSON values (the file may give them as a
    string of JSON or as an object, a served message as a string written its own way)."""
    return [
        {"name": c["function"]["name"], "arguments": decoded_json(c["function"].get("arguments"))}
        for c in message.get("tool_calls") or ()
    ]
