"""The trainer (motet/training/) on a tiny model: its adapter is the one the same PEFT/TRL run written by hand
trains, a run paused and resumed ends with the adapter of a run never stopped, and DPO moves the preferred answer
up on pairs it never saw."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from motet.engine.tokenizer import load_tokenizer
from motet.engine.weights.model_config import load_model_config
from motet.grammar.tool_formats import tool_format
from motet.lora.peft_format import base_modules
from motet.training.chat_encoding import ChatEncoder
from motet.training.dataset import prepare, read_rows
from motet.training.hyperparameters import resolve
from motet.training.trainer import TRAIN_ROWS, TrainingRun, complete_checkpoints, train

SEED = 3


def chats(n: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"say hi {i}"}, {"role": "assistant", "content": f"HELLO {i}"}]
        for i in range(n)
    ]


def encoder(model_dir) -> ChatEncoder:
    tok = load_tokenizer(model_dir)
    return ChatEncoder(tok, tool_format(None, tok.hf.chat_template), 1024)


def make_run(model_dir, tmp_path, name, method, lines, **hyper) -> TrainingRun:
    run_dir = tmp_path / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir()
    data = io.BytesIO("\n".join(map(json.dumps, lines)).encode())
    prepared = prepare(data, method, encoder(model_dir), run_dir / TRAIN_ROWS)
    modules = base_modules(load_model_config(model_dir))
    h = resolve(method, hyper, prepared.examples, max_rank=16, modules=modules)
    return TrainingRun(model_dir, method, h, SEED, run_dir, base_name="tiny")


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(path / "adapter_model.safetensors")


def assert_same(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=k)


def test_adapter_equals_the_same_trl_run_by_hand(tiny_model_dir, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    # of different lengths (padded to each batch's longest), answers of several lengths: the job projects only the
    # answers' positions through the vocabulary, TRL's run by hand every position
    examples = [[{"role": "user", "content": "say hi " + "now " * (3 * i)},
                 {"role": "assistant", "content": "HELLO " * (1 + i % 3)}] for i in range(7)]  # fmt: skip
    run = make_run(tiny_model_dir, tmp_path, "ours", "supervised", [{"messages": c} for c in examples],
                   n_epochs=2, batch_size=2)  # fmt: skip
    assert train(run) == "succeeded"
    # TRL's own prompt-completion examples, tokenized by TRL, trained as its docs show
    by_hand = Dataset.from_list([{"prompt": c[:1], "completion": c[1:]} for c in examples])
    config = SFTConfig(
        output_dir=str(tmp_path / "hand"), num_train_epochs=2, per_device_train_batch_size=2, learning_rate=2e-4,
        seed=SEED, data_seed=SEED, report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
        save_strategy="no", max_length=None,
    )  # fmt: skip
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=list(run.hyperparameters.lora_target_modules),
                      task_type="CAUSAL_LM")  # fmt: skip
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        args=config,
        train_dataset=by_hand,
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        peft_config=lora,
    )
    trainer.train()
    trainer.model.save_pretrained(tmp_path / "hand" / "adapter")
    assert_same(weights(run.adapter), weights(tmp_path / "hand" / "adapter"))
    config = json.loads((run.adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny" and config["r"] == 8


def test_paused_and_resumed_equals_uninterrupted(tiny_model_dir, tmp_path):
    lines = [{"messages": c} for c in chats(7)]
    hyper = dict(n_epochs=3, batch_size=2, lora_dropout=0.1)  # dropout: the random state is resumed too
    straight = make_run(tiny_model_dir, tmp_path, "straight", "supervised", lines, **hyper)
    assert train(straight) == "succeeded"
    stopped = make_run(tiny_model_dir, tmp_path, "stopped", "supervised", lines, **hyper)
    steps = []
    events = []

    def pause_at_step_5() -> bool:
        steps.append(1)
        return len(steps) == 5

    assert train(stopped, events.append, pause_at_step_5) == "paused"
    assert complete_checkpoints(stopped.checkpoints)[-1].name == "checkpoint-5"  # the newest complete one
    (
        stopped.checkpoints / "checkpoint-99"
    ).mkdir()  # a checkpoint cut short by a crash: no trainer_state.json
    before = len(events)
    assert train(stopped, events.append) == "succeeded"
    # the epoch's checkpoint before the one it goes on from is said again (a server killed before it stored it)
    said = [
        (e["type"], e["step"], e["epoch_end"])
        for e in events[before:]
        if e["type"] in ("checkpoint", "resumed")
    ]
    assert said[:2] == [("checkpoint", 4, True), ("resumed", 5, False)], said
    assert_same(weights(straight.adapter), weights(stopped.adapter))
    epoch_ends = [e["step"] for e in events if e["type"] == "checkpoint" and e["epoch_end"]]
    assert epoch_ends == [4, 4, 8, 12]


def sequence_logprob(model, prompt_ids, answer_ids) -> float:
    ids = torch.tensor([prompt_ids + answer_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    return logits.log_softmax(-1).gather(1, torch.tensor(answer_ids)[:, None]).sum().item()


def test_dpo_moves_the_preferred_answer_up_on_held_out_pairs(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def pair(i):
        return {"input": {"messages": [{"role": "user", "content": f"question {i}"}]},
                "preferred_output": [{"role": "assistant", "content": "YES"}],
                "non_preferred_output": [{"role": "assistant", "content": "no"}]}  # fmt: skip

    run = make_run(tiny_model_dir, tmp_path, "dpo", "dpo", [pair(i) for i in range(8)],
                   n_epochs=4, batch_size=4, learning_rate_multiplier=5)  # fmt: skip
    assert train(run) == "succeeded"
    data = io.BytesIO("\n".join(json.dumps(pair(i)) for i in range(50, 54)).encode())
    held_out = read_rows(prepare(data, "dpo", encoder(tiny_model_dir), tmp_path / "held_out.jsonl").path)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def margins(model):
        return [sequence_logprob(model, r["prompt_ids"], r["chosen_ids"])
                - sequence_logprob(model, r["prompt_ids"], r["rejected_ids"]) for r in held_out]  # fmt: skip

    before = margins(base)
    tuned = PeftModel.from_pretrained(base, run.adapter).eval()
    after = margins(tuned)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


@pytest.mark.parametrize("epochs", [1, 2])
def test_checkpoints_are_peft_adapters_motet_loads(tiny_model_dir, tmp_path, epochs):
    from motet.lora.adapter import load_adapter

    run = make_run(tiny_model_dir, tmp_path, "ckpt", "supervised", [{"messages": c} for c in chats(3)],
                   n_epochs=epochs, batch_size=3)  # fmt: skip
    assert train(run) == "succeeded"
    config = load_model_config(tiny_model_dir)
    for path in [run.adapter, *sorted(run.checkpoints.glob("checkpoint-*"))]:
        load_adapter(path, config, max_rank=16)
    assert len(list(run.checkpoints.glob("checkpoint-*"))) == epochs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bytes_a_run_stores_are_what_it_stores(tiny_model_dir, tmp_path, dtype):
    """What a job reserves of its tenant's adapter quota is each adapter's size as PEFT saves it, the config and
    the safetensors header included (issue 68, finding 8: the weights alone were 6% short), for a new adapter and
    for one trained on from an adapter."""
    import dataclasses

    from motet.lora.registry import FILES
    from motet.training.trainer import stored_adapter_bytes

    def stored(path) -> int:
        return sum((path / f).stat().st_size for f in FILES)

    config = load_model_config(tiny_model_dir)
    lines = [{"messages": c} for c in chats(4)]
    run = make_run(
        tiny_model_dir, tmp_path, "new", "supervised", lines, n_epochs=2, batch_size=2, lora_rank=4
    )
    run = dataclasses.replace(run, dtype=dtype)
    each = stored_adapter_bytes(run, config)
    assert train(run) == "succeeded"
    saved = [run.adapter, *run.checkpoints.glob("checkpoint-*")]
    assert len(saved) == 3 and [stored(p) for p in saved] == [each] * 3
    # trained on from that adapter: its own rank and modules
    again = make_run(tiny_model_dir, tmp_path, "again", "supervised", lines, n_epochs=1, batch_size=4)
    again = dataclasses.replace(again, init_adapter=run.adapter, base_name="tiny-2")
    each = stored_adapter_bytes(again, config)
    assert train(again) == "succeeded"
    assert stored(again.adapter) == each
