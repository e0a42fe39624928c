"""A model's chat template rendered as Hugging Face's `apply_chat_template(..., tokenize=False)` renders it, with
jinja2 alone: the serving path of a warm start imports no transformers (issue 65: a second of every start), and
this is all it asked of it for a prompt.

transformers 5's rendering (transformers/utils/chat_template_utils.py `render_jinja_template` and
`_cached_compile_jinja_template`, tokenization_utils_base.py `apply_chat_template`): messages as plain JSON data
with None-valued keys dropped and the reasoning's names aliased, the special tokens' strings as variables under
the caller's, one ImmutableSandboxedEnvironment with trim_blocks / lstrip_blocks, loopcontrols, its `tojson`,
`raise_exception`, `strftime_now`, `dict` and underscore-refusing `namespace`, and `continue_final_message`'s
tag cut. tests/engine/test_tokenizer_loading.py holds it to transformers' own on the tests' templates and chats.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' _REASONING_FIELDS
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@functools.lru_cache(maxsize=16)
def compiled(template: str):
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    class Generation(jinja2.ext.Extension):  # `{% generation %}`: rendered as its body (no mask is asked for)
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


def plain(value: Any) -> Any:
    """transformers' `_plain_template_data`: JSON types only, anything else an inert placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(conversation: list) -> list[dict]:
    """transformers' `_normalize_chat_messages` then `_alias_reasoning_fields` (on plain data)."""
    out = []
    for message in plain(conversation):
        if not isinstance(message, dict):
            raise TypeError(
                f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}."
            )
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(
    template: str,
    conversation: list,
    special_tokens: dict,
    tools: list | None = None,
    documents: list | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **kwargs,
) -> str:
    """One conversation as `apply_chat_template(conversation, tokenize=False, ...)` renders it with `template`;
    `special_tokens`: the tokenizer's special_tokens_map (the caller's kwargs override it)."""
    if isinstance(conversation, (list, tuple)) and not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when "
            "you want the model to continue the final message, and add_generation_prompt when you want to add a "
            "header that will prompt it to start a new assistant message instead."
        )
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                                 "and a docstring suitable for auto-conversion to a schema.")  # fmt: skip
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = _messages(conversation)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        if (final := chat[-1].get(field)) is None:
            raise ValueError(
                f'continue_final_message is set but the final message has no "{field}" to continue!'
            )
        fields = [field]
        if field in REASONING_FIELDS:
            fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in template for f in fields):
            raise ValueError(
                f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template'
            )
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + CONTINUE_TAG
                    break
            else:
                raise ValueError(
                    "continue_final_message is set but we could not find any text to continue in the final message!"
                )
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + CONTINUE_TAG
    text = compiled(template).render(
        messages=chat,
        tools=plain(tools),
        documents=plain(documents),
        add_generation_prompt=add_generation_prompt,
        **plain({**special_tokens, **kwargs}),
    )
    if continue_final_message:
        if final.strip() not in text or CONTINUE_TAG.strip() not in text:
            raise ValueError(
                "continue_final_message is set but the final message does not appear in the chat after applying "
                "the chat template! This can happen if the chat template deletes portions of the final message. "
                "Please verify the chat template and final message in your chat to ensure they are compatible."
                f"Final message to continue: {final.strip()}\nRendered chat:\n{text}"
            )
        at = text.rindex(CONTINUE_TAG.strip())
        text = text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
    return text
