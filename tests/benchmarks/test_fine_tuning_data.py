"""The fine-tuning quality benchmark's files (benchmarks/data/fine_tuning/): the demonstration is what its script
writes, a task whose answer is in its prompt, held out from its held-out lines and from the facts asked after it,
and every file reads as the API reads a job's file."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from benchmarks.fine_tuning_quality import DATA, lines
from motet.training.data_format import read_examples


def make_extraction():
    spec = importlib.util.spec_from_file_location("make_extraction", DATA / "make_extraction.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demonstration_files_are_what_their_script_writes():
    make = make_extraction()
    assert lines("extraction.jsonl") == make.training()
    assert lines("extraction_heldout.jsonl") == make.held_out()


@pytest.mark.parametrize("name", ["extraction.jsonl", "extraction_heldout.jsonl"])
def test_each_answer_is_the_prompts_person_city_and_year(name):
    for example in lines(name):
        prompt, answer = example["messages"][0]["content"], json.loads(example["messages"][1]["content"])
        sentence = prompt.split(":", 1)[1]
        assert list(answer) == ["person", "city", "year"]
        for value in answer.values():
            assert re.search(rf"\b{re.escape(str(value))}\b", sentence), (value, sentence)


def test_held_out_lines_share_no_prompt_person_or_city_with_training():
    training = lines("extraction.jsonl")
    prompts = {ex["messages"][0]["content"] for ex in training}
    words = {
        str(v) for ex in training for k, v in json.loads(ex["messages"][1]["content"]).items() if k != "year"
    }
    for ex in lines("extraction_heldout.jsonl"):
        answer = json.loads(ex["messages"][1]["content"])
        assert ex["messages"][0]["content"] not in prompts
        assert answer["person"] not in words and answer["city"] not in words
    asked = {
        ex["messages"][0]["content"] for name in ("extraction.jsonl", "behaviour.jsonl") for ex in lines(name)
    }
    assert not asked & {f["question"] for f in lines("facts.jsonl")}


@pytest.mark.parametrize(
    ("name", "method", "count"),
    [
        ("extraction.jsonl", "supervised", 80),
        ("extraction_heldout.jsonl", "supervised", 20),
        ("behaviour.jsonl", "supervised", 80),
        ("dpo_train.jsonl", "dpo", 40),
        ("dpo_heldout.jsonl", "dpo", 20),
    ],
)
def test_each_file_reads_as_a_jobs_file(name, method, count):
    with (DATA / name).open("rb") as f:
        assert len(list(read_examples(f, method, 1 << 20, 1000))) == count
