"""One training run: TRL's SFTTrainer (supervised) or DPOTrainer (preference pairs) on a PEFT LoRA model of the
base checkpoint, over rows prepared by motet/training/dataset.py.

The run is TRL's, configured as a PEFT/TRL user would write it by hand (`trainer_args` and `lora_config` are the
whole difference): AdamW, a linear decay of the learning rate, no gradient checkpointing, a checkpoint at the end
of every epoch (adapter, optimizer, scheduler and random states: what `Trainer` resumes from), the validation
loss at the end of every epoch where there is a validation file. A run started again on the same directory goes
on from its last complete checkpoint (one cut short by a crash has no trainer_state.json, written last, and is
removed), and Trainer's resume makes it end where an uninterrupted run with the same seed ends.

`pause` (asked for while it runs) saves a checkpoint after the step in progress and stops; the run is resumed
by starting it again. What happens is told to `on_event` as plain dicts (motet/training/worker.py sends them to
the server; `motet fine-tune` draws a progress bar from them).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from motet.lora.peft_format import CONFIG_FILE, WEIGHTS_FILE, lora_tensors, safetensors_bytes
from motet.models.config import ModelConfig
from motet.training.dataset import read_rows
from motet.training.hyperparameters import Hyperparameters

CHECKPOINTS = "checkpoints"
ADAPTER = "adapter"
TRAIN_ROWS, VALID_ROWS = "train.jsonl", "valid.jsonl"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_COMPLETE = "trainer_state.json"  # Trainer writes it last: a checkpoint without it was cut short


@dataclass
class TrainingRun:
    """What a run needs: the base model's directory, the method ("supervised" or "dpo"), the resolved
    hyperparameters, the seed, the run's directory (its rows as TRAIN_ROWS / VALID_ROWS, its checkpoints, its
    adapter), the dtype of the base weights ("float32", "bfloat16") and a name for the base in the adapter's
    config."""

    model_dir: Path
    method: str
    hyperparameters: Hyperparameters
    seed: int
    run_dir: Path
    dtype: str = "float32"
    base_name: str = ""
    adapter_dir: Path | None = None  # where the trained adapter goes; None: ADAPTER in the run's directory
    init_adapter: Path | None = None  # an adapter to train on (a PEFT directory); None: a new one

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / CHECKPOINTS

    @property
    def adapter(self) -> Path:
        return self.adapter_dir or self.run_dir / ADAPTER

    def spec(self) -> dict:
        return {
            "model_dir": str(self.model_dir), "method": self.method, "seed": self.seed,
            "hyperparameters": self.hyperparameters.object(), "run_dir": str(self.run_dir), "dtype": self.dtype,
            "base_name": self.base_name, "adapter_dir": str(self.adapter_dir) if self.adapter_dir else None,
            "init_adapter": str(self.init_adapter) if self.init_adapter else None,
        }  # fmt: skip

    @classmethod
    def of(cls, spec: dict) -> TrainingRun:
        return cls(
            Path(spec["model_dir"]), spec["method"], Hyperparameters.of(spec["hyperparameters"]), spec["seed"],
            Path(spec["run_dir"]), spec["dtype"], spec.get("base_name", ""),
            Path(spec["adapter_dir"]) if spec.get("adapter_dir") else None,
            Path(spec["init_adapter"]) if spec.get("init_adapter") else None,
        )  # fmt: skip


def steps_per_epoch(examples: int, batch_size: int) -> int:
    return math.ceil(examples / batch_size)


def complete_checkpoints(checkpoints: Path) -> list[Path]:
    """The complete checkpoints, oldest first (incomplete ones, cut short by a crash, are removed)."""
    found = []
    for path in checkpoints.iterdir() if checkpoints.is_dir() else ():
        if (m := _CHECKPOINT.match(path.name)) and path.is_dir():
            if (path / _COMPLETE).is_file():
                found.append((int(m.group(1)), path))
            else:
                shutil.rmtree(path, ignore_errors=True)
    return [path for _, path in sorted(found)]


def last_checkpoint(checkpoints: Path) -> Path | None:
    """The newest complete checkpoint, the one a run goes on from (None: it starts over); nothing is removed."""
    found = [
        path
        for path in (checkpoints.iterdir() if checkpoints.is_dir() else ())
        if _CHECKPOINT.match(path.name) and (path / _COMPLETE).is_file()
    ]
    return max(found, key=checkpoint_step, default=None)


def checkpoint_step(path: Path) -> int:
    return int(_CHECKPOINT.match(path.name).group(1))


def lora_config(h: Hyperparameters):
    from peft import LoraConfig

    return LoraConfig(
        r=h.lora_rank, lora_alpha=h.lora_alpha, lora_dropout=h.lora_dropout,
        target_modules=list(h.lora_target_modules), task_type="CAUSAL_LM",
    )  # fmt: skip


def trainer_args(run: TrainingRun, has_validation: bool):
    """TRL's config for the run."""
    from trl import DPOConfig, SFTConfig

    h = run.hyperparameters
    common = dict(
        output_dir=str(run.checkpoints),
        num_train_epochs=h.n_epochs,
        per_device_train_batch_size=h.batch_size,
        per_device_eval_batch_size=h.batch_size,
        learning_rate=h.learning_rate,
        seed=run.seed,
        data_seed=run.seed,
        save_strategy="epoch",
        eval_strategy="epoch" if has_validation else "no",
        logging_strategy="steps",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        bf16=run.dtype == "bfloat16",
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        max_length=None,  # the examples were checked against the context length when prepared
    )
    if run.method == "dpo":
        return DPOConfig(**common, beta=h.beta)
    return SFTConfig(**common, packing=False)


def _dpo_trainer_class():
    from trl import DPOTrainer

    class TokenizedDPOTrainer(DPOTrainer):
        """DPOTrainer on rows tokenized as serving renders them (motet/training/chat_encoding.py): TRL's own
        preparation renders with the tokenizer's template alone, without the served tool format."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            if "prompt_ids" in dataset.column_names:
                return dataset
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    return TokenizedDPOTrainer


def import_libraries() -> None:
    """Import what a run uses (torch, transformers' model and trainer, PEFT, TRL's trainers, datasets): done once
    by the fork server a local worker is forked from (motet/api/fine_tuning/workers.py), so a job starts in a
    fraction of a second and its worker shares these modules' pages with the others."""
    import torch  # noqa: F401
    from datasets import Dataset  # noqa: F401
    from peft import LoraConfig, PeftModel  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: F401
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: F401


def load_base(model_dir: Path, dtype: str):
    """The frozen base: the served model's weights as the server maps them (motet/training/shared_base.py), else
    (none to read) a copy of its own."""
    import torch
    from transformers import AutoModelForCausalLM

    from motet.training.shared_base import shared_base

    shared = shared_base(model_dir, dtype)
    if shared is not None:
        return shared
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))


def _callback(run: TrainingRun, per_epoch: int, tokens: int, on_event, pause_asked):
    from transformers import TrainerCallback

    class Report(TrainerCallback):
        """The run's events for `on_event`; a pause asked for saves after the step and stops."""

        paused = False
        saved: set[int] = set()  # a pause at an epoch's end saves the same step twice

        def on_train_begin(self, args, state, control, **kw):
            on_event({"type": "started", "step": state.global_step, "total_steps": state.max_steps,
                      "steps_per_epoch": per_epoch})  # fmt: skip

        def on_step_end(self, args, state, control, **kw):
            if pause_asked() and state.global_step < state.max_steps:
                self.paused = True
                control.should_save = True
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            trained = round(tokens * state.global_step / per_epoch)
            if "loss" in logs:
                on_event({"type": "step", "step": state.global_step, "total_steps": state.max_steps,
                          "train_loss": logs["loss"], "train_mean_token_accuracy": logs.get("mean_token_accuracy"),
                          "trained_tokens": trained})  # fmt: skip
            if "eval_loss" in logs:
                on_event({"type": "validation", "step": state.global_step, "valid_loss": logs["eval_loss"],
                          "valid_mean_token_accuracy": logs.get("eval_mean_token_accuracy")})  # fmt: skip

        def on_save(self, args, state, control, **kw):
            step = state.global_step
            if step in self.saved:
                return
            self.saved.add(step)
            epoch_end = step % per_epoch == 0 or step == state.max_steps
            path = run.checkpoints / f"checkpoint-{step}"
            tidy_adapter(path, run.base_name)
            on_event({"type": "checkpoint", "step": step, "epoch": math.ceil(step / per_epoch),
                      "epoch_end": epoch_end, "path": str(path),
                      "trained_tokens": round(tokens * step / per_epoch)})  # fmt: skip

    return Report()


def tidy_adapter(path: Path, base_name: str) -> None:
    """The adapter's config names the base model, not this machine's path to it; PEFT's empty model card goes."""
    config = path / CONFIG_FILE
    if config.is_file():
        config.write_text(_tidy_config(json.loads(config.read_text()), base_name))
    (path / "README.md").unlink(missing_ok=True)


def _tidy_config(values: dict, base_name: str) -> str:
    values["base_model_name_or_path"] = base_name or Path(values.get("base_model_name_or_path") or "").name
    return json.dumps(values, indent=2, sort_keys=True) + "\n"


def stored_adapter_bytes(run: TrainingRun, base: ModelConfig) -> int:
    """The bytes of each adapter the run stores (each epoch's checkpoint and its model: the same two files), as
    PEFT saves them and `tidy_adapter` leaves them: the config PEFT writes of the run's LoRA config (or of the
    adapter it trains on), and the weights file of its tensors (safetensors' header included)."""
    from peft import LoraConfig
    from safetensors import safe_open

    if run.init_adapter is None:
        h = run.hyperparameters
        config = lora_config(h)
        tensors = lora_tensors(base, h.lora_target_modules, h.lora_rank)
    else:  # its own tensors, trained in float32 (PEFT's dtype for a trainable adapter)
        config = LoraConfig.from_pretrained(str(run.init_adapter))
        with safe_open(run.init_adapter / WEIGHTS_FILE, framework="pt") as f:
            tensors = {k: ("F32", f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (no iterator)
    config.inference_mode = True  # as PEFT's save_pretrained writes it
    values = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    values["base_model_name_or_path"] = values["base_model_name_or_path"] or str(run.model_dir)
    return len(_tidy_config(values, run.base_name).encode()) + safetensors_bytes(tensors)


def train(
    run: TrainingRun,
    on_event: Callable[[dict], None] = lambda e: None,
    pause_asked: Callable[[], bool] = bool,
) -> str:
    """Train (or go on from the last checkpoint); "succeeded" (the adapter is in `run.adapter`) or "paused"."""
    from datasets.utils.logging import disable_progress_bar
    from transformers.utils import logging as hf_logging

    disable_progress_bar()  # (datasets' and transformers' bars: the events say how far it is)
    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*gradient_checkpointing", FutureWarning)  # TRL's default's name
        return _train(run, on_event, pause_asked)


def _train(run: TrainingRun, on_event, pause_asked) -> str:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTTrainer

    train_rows = read_rows(run.run_dir / TRAIN_ROWS)
    valid_path = run.run_dir / VALID_ROWS
    valid = Dataset.from_list(read_rows(valid_path)) if valid_path.is_file() else None
    tokens = sum(_row_tokens(row) for row in train_rows)
    per_epoch = steps_per_epoch(len(train_rows), run.hyperparameters.batch_size)
    tokenizer = AutoTokenizer.from_pretrained(str(run.model_dir), local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    report = _callback(run, per_epoch, tokens, on_event, pause_asked)
    model, peft_config = load_base(run.model_dir, run.dtype), lora_config(run.hyperparameters)
    if run.init_adapter is not None:  # an adapter trained on: its own rank and modules
        from peft import PeftModel

        model, peft_config = PeftModel.from_pretrained(model, str(run.init_adapter), is_trainable=True), None
    trainer_class = _dpo_trainer_class() if run.method == "dpo" else SFTTrainer
    trainer = trainer_class(
        model=model,
        args=trainer_args(run, valid is not None),
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=valid,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[report],
    )
    trainer.remove_callback(PrinterCallback)  # (its prints: the events say it)
    saved = complete_checkpoints(run.checkpoints)
    resume = saved.pop() if saved else None
    for path in saved:  # said again: the server may have stopped before it stored them (it ignores repeats)
        step = checkpoint_step(path)
        on_event({"type": "checkpoint", "step": step, "epoch": math.ceil(step / per_epoch),
                  "epoch_end": step % per_epoch == 0, "path": str(path),
                  "trained_tokens": round(tokens * step / per_epoch)})  # fmt: skip
    if resume is not None:  # (an epoch's checkpoint the server may not have stored before it stopped)
        step = checkpoint_step(resume)
        on_event({"type": "resumed", "step": step, "path": str(resume), "epoch": math.ceil(step / per_epoch),
                  "epoch_end": step % per_epoch == 0})  # fmt: skip
    with completions_scored_only():
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    (run.checkpoints / "README.md").unlink(missing_ok=True)
    if report.paused:
        return "paused"
    trainer.model.save_pretrained(str(run.adapter), safe_serialization=True)
    tidy_adapter(run.adapter, run.base_name)
    on_event({"type": "succeeded", "step": trainer.state.global_step, "path": str(run.adapter),
              "trained_tokens": tokens * run.hyperparameters.n_epochs})  # fmt: skip
    return "succeeded"


@contextlib.contextmanager
def completions_scored_only():
    """TRL's fused LM head (SFT's loss) projects only the positions that have a label (the completion's) on a
    Triton device, and every position elsewhere: compilers for other devices (Neuron) would see new tile shapes at
    each batch. On an eager CPU the prompt's positions, most of a chat example's, are wasted work: three vocabulary
    products each (forward, recomputed in backward, the input's gradient), about a fifth of a step of the default
    model. The choice is TRL's `_use_triton` as read by trl.trainer.utils (the kernels' own choice is another name,
    untouched); where that name is gone (another TRL) the run scores every position, as before."""
    from trl.trainer import utils as trl_utils

    original = getattr(trl_utils, "_use_triton", None)
    if original is None:
        yield
        return
    trl_utils._use_triton = lambda device: True
    try:
        yield
    finally:
        trl_utils._use_triton = original


def _row_tokens(row: dict) -> int:
    return sum(len(v) for k, v in row.items() if k.endswith("_ids"))
