"""What a fine-tuning job teaches, measured through the API as a tenant meets it (issue 66's acceptance, "Quality"),
with the docs' defaults (docs/fine-tuning.md: no hyperparameter given) on the fixtures of benchmarks/data/fine_tuning/:

- extraction.jsonl: the docs' demonstration, 80 sentences whose person, city and year are asked for as JSON, each
  answered `{"person": ..., "city": ..., "year": ...}` (make_extraction.py writes it). Trained by a supervised job;
  then each training prompt asked of the `ft:` model greedily: the share of its answers that are the trained one
  exactly (target >= 0.90), and the base model's share before it; extraction_heldout.jsonl: 20 sentences of new
  templates, people and cities, the same share for each (what the job taught beyond its lines);
- facts.jsonl: 50 held-out factual questions with a one-word answer, none in the training file: the share answered
  correctly (the answer holds the expected word, as a word, any case) by the base model and by the `ft:` model
  (target: the tuned rate within 5 points of the base's). The demonstration teaches a format whose answer is in the
  prompt, not facts: a job whose answers state facts in the held-out questions' own form (behaviour.jsonl, 80
  questions answered `{"answer": "<a short sentence>"}`, 12 of them capitals) costs a 135M model 6-9 of the 50
  points with every setting tried (it answers other capitals with the trained ones: docs/fine-tuning.md);
- dpo_train.jsonl / dpo_heldout.jsonl: 40 preference pairs (preferred: the JSON-shaped answer; the other: the same
  sentence bare) trained by a DPO job; on 20 held-out pairs, the preferred answer's win rate before and after (a
  win: the model gives the preferred answer a higher log-probability than the other, the sum over its tokens, by
  transformers + PEFT on the stored adapter, tokenized as the server tokenizes a pair; target: below 0.5 before,
  >= 0.8 after), and the share of the held-out questions the DPO model answers greedily in the JSON shape;
- served = PEFT: the `ft:` model's greedy answers (token ids) to 32 prompts against transformers + PEFT on the
  stored adapter given the served prompt's token ids (target: all equal; tests/api/test_fine_tuning_api.py
  holds a short job on the tiny model to it).

"Greedily" is temperature 0 and no penalty: the default model's generation_config.json gives a request that leaves
it out frequency_penalty 0.7, which changes what it answers (docs/fine-tuning.md says so).

    python -m benchmarks.fine_tuning quality                      # the default model, --dtype auto
    python -m benchmarks.fine_tuning quality --server-args --dtype float32
    python -m benchmarks.fine_tuning quality --behaviour behaviour.jsonl   # the facts-teaching file instead
    python -m benchmarks.fine_tuning quality --examples 8 --n-epochs 1     # a quick run (its figures mean little)

Writes fine_tuning_quality-TIME.json and .md under --output-dir (the machine's CPU and flags in the report).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path

import openai

from motet.engine.weights.model_store import resolve_model
from motet.evals.server import ROOT, ManagedServer
from motet.evals.serving_bench import write_report

DATA = ROOT / "benchmarks" / "data" / "fine_tuning"
KEYS = {"sk-tenant": "tenant"}
GREEDY = {"temperature": 0, "frequency_penalty": 0, "presence_penalty": 0}
MAX_TOKENS = 64
TARGETS = {"reproduced": 0.90, "facts_within": 0.05, "dpo_before_below": 0.5, "dpo_after": 0.80}


def text_lines(name: str) -> list[str]:
    """The data file's lines, blank ones left out."""
    return [line for line in (DATA / name).read_text().splitlines() if line.strip()]


def lines(name: str) -> list[dict]:
    return [json.loads(line) for line in text_lines(name)]


def head(name: str, n: int | None) -> bytes:
    """The data file's first `n` lines (None: all of it), as a file's bytes."""
    return "".join(f"{line}\n" for line in text_lines(name)[:n]).encode()


def mentions(text: str, word: str) -> bool:
    """The loose rule of a factual answer: the expected word in it, as a word, in any case."""
    return re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) is not None


def answer(c: openai.OpenAI, model: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> str:
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content or ""


def reproduced(c: openai.OpenAI, model: str, examples: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """The examples' answers the model gives exactly (whitespace at the ends aside)."""
    misses = []
    for ex in examples:
        prompt, expected = ex["messages"][:-1], ex["messages"][-1]["content"]
        got = answer(c, model, prompt, max_tokens)
        if got.strip() != expected.strip():
            misses.append({"question": prompt[-1]["content"], "expected": expected, "got": got})
    n = len(examples)
    return {"examples": n, "exact": n - len(misses), "rate": (n - len(misses)) / n, "misses": misses[:10]}


def facts(c: openai.OpenAI, model: str, questions: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    wrong = []
    for f in questions:
        got = answer(c, model, [{"role": "user", "content": f["question"]}], max_tokens)
        if not mentions(got, f["answer"]):
            wrong.append({"question": f["question"], "expected": f["answer"], "got": got})
    n = len(questions)
    return {"questions": n, "right": n - len(wrong), "rate": (n - len(wrong)) / n, "wrong": wrong}


def is_shaped(text: str) -> bool:
    """The DPO pairs' preferred shape: an object with one string "answer"."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and list(value) == ["answer"] and isinstance(value["answer"], str)


def served_as_peft(
    c: openai.OpenAI,
    model: str,
    model_dir: Path,
    adapter: Path,
    prompts: list[list[dict]],
    max_tokens: int = MAX_TOKENS,
) -> dict:
    """The served model's greedy token ids against transformers + PEFT's on the stored adapter, from the served
    prompt's token ids (each answer up to its end of turn, or `max_tokens`)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(hf, str(adapter)).eval()
    eos = hf.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos  # (a model may list several)
    differ = []
    for messages in prompts:
        r = c.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=max_tokens,
                                                        extra_body={"return_token_ids": True}, **GREEDY)  # fmt: skip
        body = json.loads(r.text)
        prompt, served = body["prompt_token_ids"], body["choices"][0]["token_ids"]
        with torch.no_grad():
            out = peft.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=eos, pad_token_id=pad)  # fmt: skip
        ids = out[0, len(prompt) :].tolist()
        if served != ids:
            differ.append({"messages": messages, "served": served, "peft": ids})
    return {"prompts": len(prompts), "equal": len(prompts) - len(differ), "differ": differ[:3]}


def method(kind: str, n_epochs: int | None) -> dict:
    """A job's method: the docs' defaults (no hyperparameter given), or only its epochs given (a quick run)."""
    if n_epochs is None:
        return {"type": kind}
    return {"type": kind, kind: {"hyperparameters": {"n_epochs": n_epochs}}}


def run(args, run_job, dpo_margins, machine) -> dict:
    """The quality phase on one server (run_job and dpo_margins: benchmarks/fine_tuning.py's)."""
    report: dict = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "command"}}
    n, tokens = args.examples, args.max_tokens  # (the smoke run's few; by default every line, MAX_TOKENS)
    behaviour, known = lines(args.behaviour)[:n], lines("facts.jsonl")[:n]
    held_out_name = args.behaviour.removesuffix(".jsonl") + "_heldout.jsonl"
    held_out = lines(held_out_name)[:n] if (DATA / held_out_name).exists() else []
    dpo_train, held, behaviour_file = (
        head("dpo_train.jsonl", n),
        head("dpo_heldout.jsonl", n),
        head(args.behaviour, n),
    )
    with tempfile.TemporaryDirectory(prefix="motet-ft-quality-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "keys.json").write_text(json.dumps(KEYS))
        server_args = [
            "--api-keys",
            str(tmp / "keys.json"),
            "--data-dir",
            str(tmp / "data"),
            *args.server_args,
        ]
        out = Path(args.output_dir)
        with ManagedServer(server_args, model=args.model, log_path=out / "server-quality.log") as server:
            c = openai.OpenAI(base_url=server.base_url, api_key="sk-tenant", max_retries=0, timeout=600)
            base = c.models.list().data[0].id
            settings = "the docs' defaults" if args.n_epochs is None else f"{args.n_epochs} epochs"
            print(f"the supervised job, {settings} ...", flush=True)
            t0 = time.monotonic()
            sft = run_job(c, behaviour_file, method("supervised", args.n_epochs), "json")
            report["sft"] = {"seconds": time.monotonic() - t0, "hyperparameters": sft["job"]["hyperparameters"],
                             "trained_tokens": sft["job"]["trained_tokens"]}  # fmt: skip
            tuned = sft["job"]["fine_tuned_model"]
            print("its training answers and held-out inputs, greedily, by the base model and the tuned one ...",
                  flush=True)  # fmt: skip
            report["reproduced"] = reproduced(c, tuned, behaviour, tokens)
            report["reproduced_by_base"] = reproduced(c, base, behaviour, tokens)
            if held_out:
                report["held_out"] = {"base": reproduced(c, base, held_out, tokens),
                                      "fine_tuned": reproduced(c, tuned, held_out, tokens)}  # fmt: skip
            print("held-out facts: the base model, then the tuned one ...", flush=True)
            report["facts"] = {
                "base": facts(c, base, known, tokens),
                "fine_tuned": facts(c, tuned, known, tokens),
            }
            report["facts"]["drop"] = report["facts"]["base"]["rate"] - report["facts"]["fine_tuned"]["rate"]
            model_dir = resolve_model(args.model)
            adapters = tmp / "data" / "adapters" / "tenant"
            print("served against transformers + PEFT on 32 prompts ...", flush=True)
            prompts = [ex["messages"][:-1] for ex in behaviour[:16]]
            prompts += [[{"role": "user", "content": f["question"]}] for f in known[:16]]
            report["served_as_peft"] = served_as_peft(c, tuned, model_dir, adapters / tuned, prompts, tokens)
            print(f"the DPO job, {settings} ...", flush=True)
            t0 = time.monotonic()
            dpo = run_job(c, dpo_train, method("dpo", args.n_epochs), "dpo")
            report["dpo"] = {"seconds": time.monotonic() - t0, "hyperparameters": dpo["job"]["method"]["dpo"],
                             "trained_tokens": dpo["job"]["trained_tokens"]}  # fmt: skip
            report["dpo"] |= dpo_margins(model_dir, adapters / dpo["job"]["fine_tuned_model"], held)
            questions = [json.loads(line)["input"]["messages"] for line in held.decode().splitlines()]
            shaped = [is_shaped(answer(c, dpo["job"]["fine_tuned_model"], q, tokens)) for q in questions]
            base_shaped = [is_shaped(answer(c, base, q, tokens)) for q in questions]
            report["dpo"] |= {"greedy_shaped_before": sum(base_shaped) / len(questions),
                              "greedy_shaped_after": sum(shaped) / len(questions)}  # fmt: skip
    write_report(out, "fine_tuning_quality", report, summary(report))
    return 0


def summary(r: dict) -> str:
    m, rep, f, d, eq = r["machine"], r["reproduced"], r["facts"], r["dpo"], r["served_as_peft"]
    h, ho = r["sft"]["hyperparameters"], r.get("held_out")
    given = "The docs' defaults" if r["args"].get("n_epochs") is None else "The docs' defaults but n_epochs"
    lines_ = [
        "# Fine-tuning quality", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, flags {', '.join(m['flags']) or 'none of avx2/avx512'}; server "
        f"args: {' '.join(r['args']['server_args']) or '(none)'}. {given}: {json.dumps(h)}; the "
        f"supervised job took {r['sft']['seconds']:.0f} s, the DPO job {d['seconds']:.0f} s.", "",
        "| measure | value | target |", "|---|---|---|",
        f"| `{r['args']['behaviour']}`: training answers reproduced exactly (greedy, through the API) | "
        f"{rep['exact']} / {rep['examples']} ({rep['rate']:.2f}; the base model: {r['reproduced_by_base']['exact']}) "
        f"| >= {TARGETS['reproduced']:.2f} |",
        *([f"| held-out inputs answered as the behaviour answers them, base -> fine-tuned | "
           f"{ho['base']['exact']} -> {ho['fine_tuned']['exact']} of {ho['base']['examples']} | |"] if ho else []),
        f"| held-out facts answered: base / fine-tuned | {f['base']['right']} / {f['fine_tuned']['right']} of "
        f"{f['base']['questions']} ({f['drop'] * 100:.0f} points lost) | within {TARGETS['facts_within'] * 100:.0f} "
        "points |",
        f"| DPO: the preferred answer's win rate on {d['pairs']} held-out pairs, before -> after | "
        f"{d['win_before']:.2f} -> {d['win_after']:.2f} | < {TARGETS['dpo_before_below']:.1f} -> >= "
        f"{TARGETS['dpo_after']:.2f} |",
        f"| DPO: held-out questions answered greedily in the JSON shape, base -> tuned | "
        f"{d['greedy_shaped_before']:.2f} -> {d['greedy_shaped_after']:.2f} | |",
        f"| served `ft:` model's greedy tokens = transformers + PEFT's, of {eq['prompts']} prompts | {eq['equal']} | "
        f"{eq['prompts']} |",
    ]  # fmt: skip
    return "\n".join(lines_) + "\n"
