"""`vllm serve`'s flags, as `motet serve` reads them: what a vLLM user's command line needs to run here.

`motet serve MODEL` (the positional model of `vllm serve`), `--lora-modules` (motet's `--lora`),
`--enable-lora` (accepted: adapters are always on), `--api-key` (one key, beside `--api-keys`),
`--gpu-memory-utilization` (the KV cache sized from a share of the memory: motet/engine/worker/memory.py),
`--trust-request-chat-template`, `--tool-call-parser` (the model's tool-call format: motet/grammar/tool_formats/)
and `--enable-auto-tool-choice` (accepted: `tool_choice: "auto"` is always on). `--served-model-name`, `--max-loras`, `--max-lora-rank`,
`--max-cpu-loras`, `--max-model-len`, `--max-num-seqs`, `--max-num-batched-tokens`, `--block-size`,
`--dtype`, `--host` and `--port` are motet's own flags under vLLM's names already.
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from motet import json_input
from motet.flag_types import number

if TYPE_CHECKING:
    from motet.api.auth import Authenticator

log = logging.getLogger("motet.server")


def add_vllm_serve_args(p: argparse.ArgumentParser) -> None:
    from motet.engine.config import CUDA_GPU_MEMORY_UTILIZATION

    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (the same as --model)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action=_LoraModules,
        dest="lora",
        metavar="NAME=PATH",
        help='vLLM\'s form of --lora: NAME=PATH or {"name": NAME, "path": PATH}, one or more',
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="accepted for vLLM's command lines: LoRA adapters are always on in motet",
    )
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="vLLM's single API key: every request needs 'Authorization: Bearer KEY' (tenant 'default', which "
        "also reads /metrics); with --api-keys, one more key beside that file's (default: none)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=number(0, 1, above=True),
        default=None,
        help="size the KV cache so that the weights, a step's activations, the LoRA slots and the KV cache take "
        "this share of the device's memory (on CUDA its total memory, as vLLM; on CPU the host memory available "
        f"at start-up); wins over --kv-cache-memory-gb, and --num-kv-blocks over both (default: "
        f"{CUDA_GPU_MEMORY_UTILIZATION:g} on CUDA unless --kv-cache-memory-gb is given; on CPU "
        "--kv-cache-memory-gb's size)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        type=tool_call_parser,
        metavar="NAME",
        help="how the model writes tool calls, by vLLM's names: hermes (<tool_call>{...}</tool_call>: Qwen2.5/3, "
        'Hermes), mistral ([TOOL_CALLS][{...}]), llama3_json / llama4_json ({"name": ..., "parameters": ...}), '
        "pythonic / llama4_pythonic ([f(a=1)]: parsed, not constrained), phi4_mini_json (functools[{...}]), "
        "granite (<|tool_call|>[{...}]), openai (GPT-OSS's harmony commentary channel) (default: the model "
        "family's, e.g. openai for GPT-OSS; else the chat template's markers: [TOOL_CALLS], <|python_tag|>, "
        "<|channel|>, <|/tool|> or functools, <|tool_call|>; else hermes)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: tool_choice 'auto' is always on in motet",
    )
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat template (chat_template, chat_template_kwargs.chat_template) "
        "and the data it reads; rendered in a helper process within time, memory and length bounds "
        "(default: refused with 400, as vLLM does)",
    )


def tool_call_parser(name: str) -> str:
    """`--tool-call-parser`: one of vLLM's parser names motet knows (motet/grammar/tool_formats/), checked as the flag
    is parsed (the formats are imported only then: `motet serve --help` does not wait for them)."""
    from motet.grammar.tool_formats import TOOL_FORMATS

    if name not in TOOL_FORMATS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {name!r} (choose from {', '.join(repr(n) for n in TOOL_FORMATS)})"
        )
    return name


class _LoraModules(argparse.Action):
    """Each --lora-modules item, in vLLM's forms, as a --lora NAME=PATH item."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        for value in values:
            items.append(_lora_module(value, option_string))
        setattr(namespace, self.dest, items)


def _lora_module(value: str, flag: str) -> str:
    if not value.lstrip().startswith("{"):
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentError(None, f"{flag} {value!r}: expected NAME=PATH or a JSON object")
        return value
    try:
        spec = json_input.loads(value)
    except ValueError as e:
        raise argparse.ArgumentError(None, f"{flag} {value[:80]!r}: {e}") from None
    known = {"name", "path", "base_model_name"}
    if not isinstance(spec, dict) or not {"name", "path"} <= set(spec) or not set(spec) <= known:
        raise argparse.ArgumentError(
            None, f'{flag} {value[:80]!r}: expected {{"name": NAME, "path": PATH}} (and base_model_name)'
        )
    if not all(isinstance(spec[k], str) and spec[k] for k in spec):
        raise argparse.ArgumentError(None, f"{flag} {value[:80]!r}: name and path must be non-empty strings")
    return f"{spec['name']}={spec['path']}"  # base_model_name: motet serves one base model, --model


def served_model(args, default: str) -> str:
    """The model flag: `motet serve MODEL` or --model (not two different ones)."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return args.model
    if args.model not in (default, tag):
        raise ValueError(f"the model is given twice: {tag!r} and --model {args.model!r}; give it once")
    return tag


def authenticator(args) -> Authenticator:
    """--api-keys FILE and vLLM's --api-key KEY together: the file's keys and that one, which speaks for
    tenant 'default' (the tenant of a server without keys) and reads /metrics."""
    from motet.api.auth import DEFAULT_TENANT, Authenticator, Principal  # (the API's modules: once serving)

    key = getattr(args, "api_key", None)
    if key is None:
        return Authenticator.from_file(args.api_keys)
    key = key.strip()
    if not key:
        raise ValueError("--api-key: the key is empty")
    auth = Authenticator.from_file(args.api_keys) if args.api_keys else Authenticator()
    if key in auth.keys:
        raise ValueError("--api-key: that key is also in --api-keys; give it once")
    auth.add(key, Principal(DEFAULT_TENANT, admin=True))
    log.info("authentication is on: --api-key speaks for tenant %r and reads /metrics", DEFAULT_TENANT)
    return auth
