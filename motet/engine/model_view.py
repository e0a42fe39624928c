"""The served model as the API sees it: one frozen record, the same shape whether the engine runs in this process
or on Ray replicas (as vLLM V1's EngineClient answers `get_tokenizer` / `get_model_config` either way).

It is the API's only source of the tokenizer, chat-template rendering, the model's family (its declaration:
tool-call and reasoning formats), and the limits a route reads back (the context length, the adapters' rank
and count caps). `ModelView.of_engine` builds it from a loaded engine (motet/actors/executor.py, once, on the
engine's thread); `ModelView.from_files` from what a replica is built from, the engine configuration and the
model's directory, reading the model's config and tokenizer without its weights (the Ray ingress,
motet/cluster/cluster_system.py).

Threads: every field is set once; the tokenizer is a Hugging Face fast tokenizer used read-only (encode,
decode, apply_chat_template; nothing here sets its truncation or padding, which would mutate it), so any
thread may call the view's methods, several at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from motet.engine.config import EngineConfig, context_length
from motet.engine.request_checks import check_text_length
from motet.engine.tokenizer import Tokenizer, load_tokenizer
from motet.engine.weights.model_config import load_model_config
from motet.lora.peft_format import TARGET_MODULES
from motet.models.config import ModelConfig
from motet.models.declaration import Architecture


@dataclass(frozen=True)
class AdapterCapacity:
    """How many adapters one engine's pool holds (for the operator's ready line)."""

    pool_bytes: int
    small: int  # rank-8 q_proj/v_proj adapters
    large: int  # rank-16 adapters on every module


@dataclass(frozen=True)
class ModelView:
    model_dir: Path
    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int  # the longest sequence served (prompt and completion)
    max_lora_rank: int  # higher-rank adapters are refused
    max_loras: int | None  # distinct adapters among the running requests; None: memory decides
    # Where and how the model runs, as the operator's ready line says it: the device ("cpu", "cuda:0"; behind
    # --replicas, each replica's as configured), the dtype of the weights, the KV block size, the sequences
    # one step runs, the compute threads.
    device: str
    dtype: str
    block_size: int
    max_num_seqs: int
    num_threads: int | None
    adapter_capacity: AdapterCapacity | None = None  # None behind --replicas: each replica has its own pool

    @classmethod
    def of_engine(cls, engine) -> ModelView:
        """A loaded LLMEngine's view (its runner says the device and dtype, its adapter manager the pool)."""
        config, runner, manager = engine.config, engine.runner, engine.adapters
        big = manager.layout.adapter_elements(16, TARGET_MODULES) * manager.pool.elem_bytes
        capacity = AdapterCapacity(manager.pool.capacity_bytes, manager.capacity(), manager.capacity(big))
        return cls(
            **_configured(config),
            model_dir=Path(engine.model_dir),
            tokenizer=engine.tokenizer,
            model_config=engine.model_config,
            max_model_len=engine.max_model_len,
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            adapter_capacity=capacity,
        )

    @classmethod
    def from_files(cls, config: EngineConfig, model_dir: Path) -> ModelView:
        """The view of the engine `config` builds on `model_dir`, read from the model's files (its config and
        tokenizer, not its weights): what the Ray ingress knows of the replicas it routes to."""
        model_config = load_model_config(model_dir, config.tokenizer)
        return cls(
            **_configured(config),
            model_dir=Path(model_dir),
            tokenizer=load_tokenizer(config.tokenizer or model_dir),
            model_config=model_config,
            max_model_len=context_length(model_config, config.max_model_len),
            device=str(config.torch_device),
            dtype=str(config.torch_dtype).removeprefix("torch."),
        )

    @property
    def family(self) -> Architecture:
        """The model family's declaration (motet/models/): its tool-call and reasoning formats and the like."""
        return self.model_config.declaration

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.hf.chat_template

    def render_chat(self, messages: list[dict], **kwargs) -> str:
        """The chat as prompt text (motet/engine/tokenizer.py `render_chat`); ValueError if it cannot be."""
        return self.tokenizer.render_chat(messages, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def check_text(self, text: str, param: str = "prompt") -> None:
        """Text that could not fit the context window is refused unread (RequestError)."""
        check_text_length(text, self.max_model_len, param)


def _configured(config: EngineConfig) -> dict:
    """The view's fields the engine configuration alone says."""
    return dict(
        max_lora_rank=config.max_lora_rank,
        max_loras=config.max_loras,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        num_threads=config.num_threads,
    )
