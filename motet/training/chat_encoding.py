"""Examples as the tokens a model is trained on, rendered exactly as serving renders a request.

The chat goes through the same steps as a chat completion's (motet/grammar/tool_prompt.py `template_messages`,
then the model's chat template through motet/engine/tokenizer.py): tools in the system prompt and calls written
in the served tool-call format where the template has no tool support of its own, tool results as tool turns.
So an adapter learns the prompt its requests will be served with, tool calls included.

The loss covers the assistant turns only, as TRL's prompt-completion examples do it: an assistant turn's tokens
are those of the chat up to and including it past the tokens of the chat before it with the generation prompt
(the common prefix of the two, as TRL's `common_prefix_length`), so a turn starts where serving's prompt ends.
A turn with weight 0 is context, not trained on. Preference pairs are tokenized as TRL's DPOTrainer tokenizes
conversational pairs: the prompt, and each answer past the prompt's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from motet.grammar.tool_calls import ToolError
from motet.grammar.tool_formats import ToolFormat
from motet.grammar.tool_prompt import template_messages
from motet.training.data_format import ChatExample, DataError, PreferenceExample


@dataclass
class SupervisedTokens:
    """TRL's tokenized language-modeling example: the chat's tokens, 1 where the loss is taken."""

    input_ids: list[int]
    assistant_masks: list[int]

    @property
    def tokens(self) -> int:
        return len(self.input_ids)

    def record(self) -> dict:
        return {"input_ids": self.input_ids, "assistant_masks": self.assistant_masks}


@dataclass
class PairTokens:
    """TRL's tokenized preference example."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    @property
    def tokens(self) -> int:
        return len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)

    @property
    def longest(self) -> int:
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))

    def record(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids,
            "chosen_ids": self.chosen_ids,
            "rejected_ids": self.rejected_ids,
        }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ChatEncoder:
    """`tokenizer`: motet's (motet/engine/tokenizer.py); `tool_format`: the served tool-call format;
    `max_tokens`: the longest example (the served context length)."""

    def __init__(self, tokenizer, tool_format: ToolFormat, max_tokens: int):
        self.tokenizer, self.tool_format, self.max_tokens = tokenizer, tool_format, max_tokens
        self.chat_template = tokenizer.hf.chat_template

    def template_messages(self, messages: list[dict], tools, line: int) -> tuple[list[dict], dict]:
        try:
            return template_messages(messages, tools, self.tool_format, self.chat_template)
        except ToolError as e:
            raise DataError(str(e), line) from None

    def render(self, messages: list[dict], kwargs: dict, generation_prompt: bool, line: int) -> str:
        try:
            return self.tokenizer.render_chat(messages, add_generation_prompt=generation_prompt, **kwargs)
        except ValueError as e:
            raise DataError(str(e), line) from None

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.hf.encode(text, add_special_tokens=False)  # the template writes them

    def supervised(self, example: ChatExample) -> SupervisedTokens:
        messages, kwargs = self.template_messages(example.messages, example.tools, example.line)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(turns) != len(example.trained):  # (the rewrite keeps every assistant message, in order)
            raise DataError("the assistant messages could not be told apart after rendering", example.line)
        full = self.tokens(self.render(messages, kwargs, False, example.line))
        self._check_length(len(full), example.line)
        mask = [0] * len(full)
        for turn, trained in zip(turns, example.trained, strict=True):
            if not trained:
                continue
            prompt = self.tokens(self.render(messages[:turn], kwargs, True, example.line))
            upto = self.tokens(self.render(messages[: turn + 1], kwargs, False, example.line))
            start, end = common_prefix(prompt, upto), common_prefix(upto, full)
            mask[start:end] = [1] * max(0, end - start)
        if not any(mask):
            raise DataError("the chat template renders no assistant tokens to train on", example.line)
        return SupervisedTokens(full, mask)

    def pair(self, example: PreferenceExample) -> PairTokens:
        chats = []
        for answer in (example.preferred, example.non_preferred):
            messages, kwargs = self.template_messages(
                [*example.messages, answer], example.tools, example.line
            )
            chats.append(self.tokens(self.render(messages, kwargs, False, example.line)))
        prompt = self.tokens(self.render(messages[:-1], kwargs, True, example.line))
        n = min(common_prefix(prompt, chats[0]), common_prefix(prompt, chats[1]))
        tokens = PairTokens(prompt[:n], chats[0][n:], chats[1][n:])
        self._check_length(tokens.longest, example.line)
        if not tokens.chosen_ids or not tokens.rejected_ids:
            raise DataError("an answer renders to no tokens", example.line)
        return tokens

    def _check_length(self, n: int, line: int) -> None:
        if n > self.max_tokens:
            raise DataError(
                f"the example is {n} tokens long, more than the model's context length of {self.max_tokens} "
                "tokens: shorten it or split it",
                line,
            )
