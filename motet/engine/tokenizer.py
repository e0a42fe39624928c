"""Tokenizer loading and chat-template rendering (Hugging Face fast tokenizers, local files only)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from motet.engine.request_checks import MAX_PROMPT_CHARS
from motet.engine.template_worker import template_worker
from motet.models.declaration import ModelLoadError


class Tokenizer:
    """A thin front over the HF tokenizer: plain encode/decode and chat rendering with clear errors."""

    def __init__(self, hf: PreTrainedTokenizerBase):
        self.hf = hf
        self.vocab_size = len(hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        max_chars: int | None = None,
        **template_kwargs,
    ) -> str:
        """The chat as prompt text. `chat_template`: a request's own template instead of the model's, rendered
        within bounds in a helper process (motet/engine/template_worker.py) that returns at most `max_chars`
        + 1 characters; `template_kwargs` (continue_final_message, tools, ...) go to `apply_chat_template`."""
        kwargs = {"add_generation_prompt": add_generation_prompt, **template_kwargs}
        if chat_template is not None:
            worker = template_worker(self.hf.name_or_path)
            try:
                return worker.render(messages, chat_template, kwargs, max_chars or MAX_PROMPT_CHARS)
            except ValueError as e:
                raise ValueError(
                    f"messages could not be rendered with the request's chat_template: {e}"
                ) from None
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use the completions API instead")
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # jinja errors carry the template's own message
            raise ValueError(f"messages could not be rendered with the chat template: {e}") from None

    def encode_chat(self, messages: list[dict], **kw) -> list[int]:
        # The template writes the special tokens itself: do not add BOS again.
        return self.hf.encode(self.render_chat(messages, **kw), add_special_tokens=False)

    # Pass-throughs the detokenizer and grammar backends use.
    def __getattr__(self, name):
        return getattr(self.hf, name)

    def __len__(self) -> int:
        return len(self.hf)


# The files AutoTokenizer may open in a model directory: each must be a regular file where it is there (a FIFO
# would block the start-up for ever, inside the tokenizers library).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)  # fmt: skip


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.exists() and not path.is_file():
            raise ModelLoadError(f"{path}: not a regular file")
    try:
        hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{model_dir}: could not load the tokenizer ({e})") from None
    return Tokenizer(hf)
