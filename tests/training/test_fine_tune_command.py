"""`motet fine-tune` (motet/api/fine_tune_command.py): the adapter it writes is one motet serves as PEFT computes it,
a bad line or flag exits 2 with one line naming it, and a run started again goes on from its last checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from motet.api.cli import main
from motet.engine.llm import LLM
from motet.engine.sampling_params import SamplingParams

QUESTIONS = ["What is a comet?", "Why is the sky blue?", "What do bees make?", "Name a planet."]


def write_chats(path, answers=None) -> None:
    answers = answers or [q.upper() for q in QUESTIONS]
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in zip(QUESTIONS, answers, strict=True)]  # fmt: skip
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")


def peft_greedy(model_dir, adapter, prompt_ids: list[int], n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(prompt_ids) :].tolist()


def served_greedy(model_dir, adapter, n: int) -> tuple[list[int], list[int]]:
    """The adapter's greedy tokens on the offline engine (the engine `motet serve --lora` runs), and the prompt."""
    with LLM(str(model_dir), dtype="float32", num_threads=1) as llm:
        llm.add_lora("tuned", adapter)
        prompt = llm.tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[0]}])
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        (out,) = llm.generate([prompt], params, ["tuned"])
    return list(out.token_ids), prompt


def train_and_check(model_dir, tmp_path, *flags: str) -> None:
    data, out = tmp_path / "train.jsonl", tmp_path / "adapter"
    write_chats(data)
    args = ["fine-tune", str(data), "--model", str(model_dir), "--out", str(out), "--dtype", "float32",
            "--threads", "1", "--learning-rate-multiplier", "10", *flags]  # fmt: skip
    assert main(args) == 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    served, prompt = served_greedy(model_dir, out, 8)
    assert served == peft_greedy(model_dir, out, prompt, 8)


def test_the_adapter_is_served_as_peft_computes_it(tiny_model_dir, tmp_path):
    train_and_check(tiny_model_dir, tmp_path, "--n-epochs", "2", "--batch-size", "2")
    assert sorted(p.name for p in (tmp_path / "adapter" / "checkpoints").iterdir()) == [
        "checkpoint-2",
        "checkpoint-4",
    ]


def test_a_run_started_again_goes_on_from_its_last_checkpoint(tiny_model_dir, tmp_path, capsys):
    data, out = tmp_path / "train.jsonl", tmp_path / "adapter"
    write_chats(data)
    args = ["fine-tune", str(data), "--model", str(tiny_model_dir), "--out", str(out), "--n-epochs", "1",
            "--batch-size", "4", "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    assert main(args) == 0
    assert "going on from the checkpoint of step 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "flags", "says"),
    [
        (
            '{"messages": [{"role": "user", "content": "hi"}]}',
            (),
            "train.jsonl: Line 2: no assistant message",
        ),
        ("{oops", (), "train.jsonl: Line 2: the line is not valid JSON"),
        (None, ("--n-epochs", "0"), "argument --n-epochs"),
        (None, ("--lora-target-modules", "lm_head"), "--lora-target-modules: lora_target_modules: 'lm_head'"),
        (None, ("--beta", "0.5"), "--beta is DPO's"),
        (None, ("--method", "dpo"), "Line 1: a chat: DPO reads preference pairs"),
        (
            '{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "x"}]}',
            (),
            "train.jsonl: Line 2: the line holds invalid Unicode (a lone surrogate escape) at messages[0].content",
        ),
    ],
)
def test_a_bad_line_or_flag_exits_2_naming_it(tiny_model_dir, tmp_path, capsys, line, flags, says):
    data = tmp_path / "train.jsonl"
    write_chats(data)
    if line is not None:
        data.write_text(data.read_text().splitlines()[0] + "\n" + line + "\n")
    assert main(["fine-tune", str(data), "--model", str(tiny_model_dir), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "train-adapter" / "run.json").exists()


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("{tmp}",), "motet fine-tune: error: argument FILE: {tmp}: not a regular file (a directory)"),
        (
            ("{data}", "--validation", "{tmp}"),
            "argument --validation: {tmp}: not a regular file (a directory)",
        ),
        (("{tmp}/none.jsonl",), "argument FILE: {tmp}/none.jsonl: No such file or directory"),
        (("{data}", "--out", "{data}"), "argument --out: {data}: not a directory (a regular file)"),
        (("{data}", "--out", "{data}/x"), "argument --out: {data}/x: Not a directory"),
        (("{data}",), "motet: error: {tmp}/train-adapter: File exists"),  # the default DIR, taken by a file
    ],
)
def test_a_path_that_cannot_be_read_or_written_exits_2_naming_it(
    tiny_model_dir, tmp_path, capsys, flags, says
):
    """argparse's convention, as for any bad flag: `prog: error: ...` in one line and exit code 2, never a
    traceback (FILE a directory, --out a file or under one were an OSError out of open() or mkdir())."""
    data = tmp_path / "train.jsonl"
    write_chats(data)
    (tmp_path / "train-adapter").write_text("a file")
    args = [f.format(tmp=tmp_path, data=data) for f in flags]
    assert main(["fine-tune", *args, "--model", str(tiny_model_dir), "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(("motet fine-tune: error: ", "motet: error: ")), err
    assert says.format(tmp=tmp_path, data=data) in err[0], err


@pytest.mark.slow
def test_the_default_model_learns_a_short_job_served_as_peft_computes_it(default_model_dir, tmp_path):
    train_and_check(default_model_dir, tmp_path, "--n-epochs", "1", "--batch-size", "2")
