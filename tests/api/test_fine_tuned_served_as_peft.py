"""The served `ft:` model is the adapter its job stored, as transformers + PEFT compute it (issue 66): a short job on
the tiny model through the openai SDK (4 steps), then 8 prompts (4 trained, 4 not) answered greedily by the server
and by PEFT on the stored adapter from the served prompt's token ids, token for token; and the served prompt is the
one the job trained on (motet/training/chat_encoding.py renders a training example's prompt as serving renders a
request). benchmarks/fine_tuning_quality.py checks the same on the real default model."""

from __future__ import annotations

import io
import json

import torch

from benchmarks.fine_tuning_quality import GREEDY, MAX_TOKENS, lines
from motet.engine.tokenizer import load_tokenizer
from motet.engine.weights.model_config import load_model_config
from motet.grammar.tool_formats import tool_format
from motet.training.chat_encoding import ChatEncoder
from motet.training.data_format import read_examples
from tests.api.test_fine_tuning_api import client, jsonl, upload, wait
from tests.live_server import keys_file, tiny_server

TRAINED = 8  # examples: 4 steps at batch 2
MAX_LEN = 1024  # tiny_server's --max-model-len


def test_the_served_ft_model_answers_as_peft_on_its_stored_adapter(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    behaviour, facts = lines("behaviour.jsonl"), lines("facts.jsonl")
    keys_file(tmp_path, {"k": "team"})
    server = tiny_server(tiny_model_dir, tmp_path, "--dtype", "float32")
    try:
        c = client(server, "k")
        job = c.fine_tuning.jobs.create(
            training_file=upload(c, jsonl(behaviour[:TRAINED])).id, model="tiny", seed=1,
            hyperparameters={"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 4},
        )  # fmt: skip
        job = wait(c, job.id)
        assert job.status == "succeeded", job.error
        prompts = [ex["messages"][:-1] for ex in behaviour[:4]]
        prompts += [[{"role": "user", "content": f["question"]}] for f in facts[:4]]
        served = []
        for messages in prompts:
            r = c.chat.completions.with_raw_response.create(
                model=job.fine_tuned_model, messages=messages, max_tokens=MAX_TOKENS,
                extra_body={"return_token_ids": True}, **GREEDY,
            )  # fmt: skip
            body = json.loads(r.text)
            served.append((body["prompt_token_ids"], body["choices"][0]["token_ids"]))
    finally:
        server.stop()
    tok, config = load_tokenizer(tiny_model_dir), load_model_config(tiny_model_dir)
    encoder = ChatEncoder(tok, tool_format(config.declaration.tool_format, tok.hf.chat_template), MAX_LEN)
    trained = list(read_examples(io.BytesIO(jsonl(behaviour[:TRAINED])), "supervised", 1 << 20, 100))
    # the training render's prompt, as served
    for example, (prompt, _) in zip(trained[:4], served[:4], strict=True):
        tokens = encoder.supervised(example)
        assert tokens.input_ids[: tokens.assistant_masks.index(1)] == prompt
    adapter = tmp_path / "data" / "adapters" / "team" / job.fine_tuned_model
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(base, str(adapter)).eval()
    eos = base.generation_config.eos_token_id  # (the tiny model's: a list of one)
    pad = eos[0] if isinstance(eos, list) else eos
    for messages, (prompt, answer) in zip(prompts, served, strict=True):
        with torch.no_grad():
            out = peft.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                eos_token_id=eos, pad_token_id=pad)  # fmt: skip
        assert answer == out[0, len(prompt) :].tolist(), messages
