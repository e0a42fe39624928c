"""Fine-tuning as a service, measured end to end on one `motet serve` (issue 59's acceptance), all ratios in one run:

- behaviours learned through the API: the repository's `upper` and `json` behaviours (motet/evals/train_adapters.py:
  the base model's own answers to --examples training prompts, upper-cased / wrapped as {"answer": ...}) trained
  by fine-tuning jobs through the openai SDK; the served `ft:` models' pass rates on held-out prompts against the
  committed adapters' (tests/fixtures/adapters/, served with --lora) under the same checks (target >= 0.9x);
- training speed: the `upper` job's training tokens/s against the same PEFT/TRL run written by hand, in a process
  of its own with the same threads, examples and hyperparameters (target >= 0.9x; both end to end: start,
  load, train, save; the hand run's train() alone is reported too), and the job's time for --examples examples;
- DPO: a job on preference pairs (preferred: the upper-cased answer; the other: the base's own) and the preferred
  answer's log-likelihood margin over the other on held-out pairs, before and after (target: up);
- serving while a job runs: --clients streamed chat clients for --load-seconds with no job, then while a job
  trains (target: TPOT p50 <= 1 / (0.9 x (1 - share)): the job trains in the share of the time serving lends it,
  --fine-tuning-share), and a light tenant's one-at-a-time answers alike (E2E p50);
- --shared-cores (issue 66: one owner for the cores) alone: serving's output tokens/s under --clients streamed
  clients, alone and beside a training job; the job's training tokens/s alone (serving idle) and beside those
  clients; targets: serving beside / alone >= 0.9 x (1 - share), the job beside / alone >= 0.8 x share
  (--fine-tuning-share, 0.25 unless --server-args sets it), the job alone >= 0.9x the same run in a process of its
  own outside the server (`python -m motet.training.worker` on a copy of its run directory); and beside an
  unrelated CPU hog (`python -c "while True: pass"`) the job's tokens/s and the events that say it waits;
- --memory (issue 66: one copy of the base) alone: the server's process tree's proportional set size (PSS, pages
  its processes share counted once: benchmarks/process_memory.py) idle and its peak while a job of
  --memory-examples examples trains, the worker's PSS by mapping (weights files, libraries, anonymous) at that
  peak, and by stage in a process of its own (imports, trainer built, steps); target: with a job <= idle + the
  adapter, its optimizer state and gradients, the activations + 150 MB.

    python -m benchmarks.fine_tuning                                   # the acceptance sizes (long: a quiet machine)
    python -m benchmarks.fine_tuning --examples 8 --eval-prompts 4 --n-epochs 1 --load-seconds 10 --clients 2
    python -m benchmarks.fine_tuning --shared-cores --clients 32       # the shared cores' acceptance
    python -m benchmarks.fine_tuning --memory --n-epochs 1             # one copy of the base's acceptance
    python -m benchmarks.fine_tuning quality                           # what a job teaches (fine_tuning_quality.py)

Writes fine_tuning-TIME.json and .md under --output-dir. Name the machine (its CPU and flags are in the report).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

from benchmarks import chat_body
from motet.api.fine_tuning.flags import DEFAULT_SHARE
from motet.api.fine_tuning.runner import WAIT_WINDOW_S
from motet.evals.server import ROOT, ManagedServer
from motet.evals.serving_bench import one_request, stats, write_report
from motet.evals.train_adapters import CHECKS, FIXTURES, MAX_TOKENS, TARGETS, base_answers, behaviour, prompts

KEYS = {"sk-trainer": "trainer", "sk-light": "light", "sk-admin": {"admin": True}}
POLL_EVENTS_S = (
    5.0  # the runner judges whether a job waits for compute over this long (motet/api/fine_tuning/runner.py)
)
BEHAVIOURS = ("upper", "json")


# -- the data --------------------------------------------------------------------------------------------------
def chat_lines(name: str, questions: list[str], answers: list[str]) -> bytes:
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": TARGETS[name](a)}]}
            for q, a in zip(questions, answers, strict=True) if a]  # fmt: skip
    return "\n".join(map(json.dumps, rows)).encode()


def pair_lines(questions: list[str], answers: list[str]) -> bytes:
    rows = [{"input": {"messages": [{"role": "user", "content": q}]},
             "preferred_output": [{"role": "assistant", "content": a.upper()}],
             "non_preferred_output": [{"role": "assistant", "content": a}]}
            for q, a in zip(questions, answers, strict=True) if a and a.upper() != a]  # fmt: skip
    return "\n".join(map(json.dumps, rows)).encode()


def make_data(model: str | None, examples: int, eval_prompts: int, answer_tokens: int, cache: Path) -> dict:
    from motet.evals.train_adapters import load_llm

    llm = load_llm(model)
    train_q, eval_q = prompts("train")[:examples], prompts("eval")[:eval_prompts]
    train_a = base_answers(llm, train_q, answer_tokens, cache / "train_answers.json")
    eval_a = base_answers(llm, eval_q, answer_tokens, cache / "eval_answers.json")
    model_dir = Path(llm.engine.model_dir)
    del llm
    return {
        "model_dir": model_dir,
        "files": {name: chat_lines(name, train_q, train_a) for name in BEHAVIOURS}
        | {"dpo": pair_lines(train_q, train_a)},
        "eval_prompts": eval_q,
        "held_out_pairs": pair_lines(eval_q, eval_a),
    }


# -- jobs through the SDK --------------------------------------------------------------------------------------
def run_job(c: openai.OpenAI, data: bytes, method: dict, suffix: str, poll: float = 0.5) -> dict:
    """Upload, create, wait: the job, its running time (first seen running to succeeded) and its start (created to
    its first step's metrics event seen: the worker's start, imports, load and first step)."""
    f = c.files.create(file=(f"{suffix}.jsonl", data), purpose="fine-tune")
    created = time.monotonic()
    job = c.fine_tuning.jobs.create(training_file=f.id, model=c.models.list().data[0].id, suffix=suffix, seed=0,
                                    method=method)  # fmt: skip
    started = first_step = None
    while job.status not in ("succeeded", "failed", "cancelled"):
        time.sleep(poll)
        job = c.fine_tuning.jobs.retrieve(job.id)
        if started is None and job.status == "running":
            started = time.monotonic()
        if first_step is None and any(
            e.type == "metrics" for e in c.fine_tuning.jobs.list_events(job.id, limit=20)
        ):
            first_step = time.monotonic() - created
    seconds = time.monotonic() - started if started else None
    if job.status != "succeeded":
        raise RuntimeError(f"job {job.id} {job.status}: {job.error}")
    # the training alone: from the worker's start of training to its last step (events are stamped in seconds)
    events = list(c.fine_tuning.jobs.list_events(job.id, limit=100))
    begun = min(e.created_at for e in events if e.message == "Fine-tuning job started")
    train_seconds = max(max(e.created_at for e in events if e.type == "metrics") - begun, 1)
    return {"job": job.model_dump(), "seconds": seconds, "first_step_s": first_step,
            "tokens_per_s": job.trained_tokens / seconds if seconds else None,
            "train_seconds": train_seconds, "train_tokens_per_s": job.trained_tokens / train_seconds}  # fmt: skip


def sft(hyper: dict) -> dict:
    return {"type": "supervised", "supervised": {"hyperparameters": hyper}}


# -- the same run by hand ---------------------------------------------------------------------------------------
def by_hand(args) -> int:
    """The job's run written as a PEFT/TRL user writes it (TRL's own chat tokenization of prompt-completion
    examples): prints {"seconds", "train_seconds", "tokens"} as its last line."""
    t0 = time.monotonic()
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(args.threads)
    hyper = json.loads(args.hyperparameters)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list(
        [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows]
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    config = SFTConfig(
        output_dir=args.out, num_train_epochs=hyper["n_epochs"], per_device_train_batch_size=hyper["batch_size"],
        learning_rate=2e-4 * hyper["learning_rate_multiplier"], seed=0, data_seed=0, report_to="none",
        use_cpu=True, bf16=args.dtype == "bfloat16", gradient_checkpointing=False, save_strategy="epoch",
        max_length=None, logging_steps=1, disable_tqdm=True,
    )  # fmt: skip
    lora = LoraConfig(r=hyper["lora_rank"], lora_alpha=hyper["lora_alpha"], lora_dropout=hyper["lora_dropout"],
                      target_modules=hyper["lora_target_modules"], task_type="CAUSAL_LM")  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=lora
    )
    tokens = sum(len(r["input_ids"]) for r in trainer.train_dataset) * hyper["n_epochs"]
    t1 = time.monotonic()
    trainer.train()
    train_seconds = time.monotonic() - t1
    trainer.model.save_pretrained(Path(args.out) / "adapter")
    print(json.dumps({"seconds": time.monotonic() - t0, "train_seconds": train_seconds, "tokens": tokens}))
    return 0


def standalone(args) -> int:
    """The worker's training of RUN_DIR (motet/training/worker.py's run_job, as a job's worker forked by the server
    runs it) in this process: its events as JSON lines on standard output, the libraries' prints on standard
    error."""
    from motet.training.worker import run_job

    events = os.fdopen(os.dup(1), "w")
    # (what the libraries print goes to standard error, as the worker's goes to its log: not among the events)
    os.dup2(2, 1)

    def emit(event: dict) -> None:
        events.write(json.dumps(event) + "\n")
        events.flush()

    return run_job(Path(args.run_dir), emit, lambda: False, args.threads, 0)


def run_by_hand(model_dir: Path, data: bytes, job: dict, threads: int, dtype: str, tmp: Path) -> dict:
    path = tmp / "by_hand.jsonl"
    path.write_bytes(data)
    hyper = job["method"]["supervised"]["hyperparameters"]
    cmd = [sys.executable, "-m", "benchmarks.fine_tuning", "by-hand", "--model-dir", str(model_dir), "--data",
           str(path), "--hyperparameters", json.dumps(hyper), "--threads", str(threads), "--dtype", dtype,
           "--out", str(tmp / "by_hand")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = time.monotonic() - t0  # with the interpreter's start, as the job's worker's
    result["tokens_per_s"] = result["tokens"] / result["wall_seconds"]
    result["train_tokens_per_s"] = result["tokens"] / result["train_seconds"]
    return result


# -- behaviours and DPO ---------------------------------------------------------------------------------------
def http_generate(c: openai.OpenAI, base: str):
    def generate(requests):
        out = []
        for adapter, prompt in requests:
            r = c.chat.completions.create(model=adapter or base, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
            out.append(r.choices[0].message.content or "")
        return out

    return generate


def dpo_margins(model_dir: Path, adapter: Path, pairs: bytes) -> dict:
    """The preferred answer's log-likelihood over the other's on held-out pairs, base and tuned, tokenized as the
    server tokenizes them (motet/training/chat_encoding.py)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from motet.engine.tokenizer import load_tokenizer
    from motet.engine.weights.model_config import load_model_config
    from motet.grammar.tool_formats import tool_format
    from motet.training.chat_encoding import ChatEncoder
    from motet.training.dataset import prepare, read_rows

    if not pairs.strip():  # (no held-out answer had a lower-case letter to prefer the upper-cased one to)
        return {"pairs": 0, "margin_before": None, "margin_after": None, "share_up": None, "win_before": None,
                "win_after": None}  # fmt: skip
    tok, config = load_tokenizer(model_dir), load_model_config(model_dir)
    encoder = ChatEncoder(tok, tool_format(config.declaration.tool_format, tok.hf.chat_template), 8192)
    with tempfile.TemporaryDirectory() as tmp:
        rows = read_rows(prepare(io.BytesIO(pairs), "dpo", encoder, Path(tmp) / "rows").path)

    def logprob(model, prompt, answer):
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        return logits.log_softmax(-1).gather(1, torch.tensor(answer)[:, None]).sum().item()

    def margins(model):
        return [logprob(model, r["prompt_ids"], r["chosen_ids"]) - logprob(model, r["prompt_ids"], r["rejected_ids"])
                for r in rows]  # fmt: skip

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    before = margins(base)
    after = margins(PeftModel.from_pretrained(base, str(adapter)).eval())
    return {"pairs": len(rows), "margin_before": sum(before) / len(rows), "margin_after": sum(after) / len(rows),
            "share_up": sum(a > b for a, b in zip(after, before, strict=True)) / len(rows),
            "win_before": sum(m > 0 for m in before) / len(rows), "win_after": sum(m > 0 for m in after) / len(rows)}  # fmt: skip


# -- serving under a job -----------------------------------------------------------------------------------------
async def load(url: str, model: str, clients: int, seconds: float, tokens: int) -> dict:
    """`clients` streamed chat clients back to back, and the light tenant's one-at-a-time requests beside them."""
    heavy = httpx.AsyncClient(
        base_url=f"{url}/v1", timeout=600, headers={"Authorization": "Bearer sk-trainer"}
    )
    light = httpx.AsyncClient(base_url=f"{url}/v1", timeout=600, headers={"Authorization": "Bearer sk-light"})
    end = time.monotonic() + seconds
    records, light_records = [], []

    async def client(i: int):
        n = 0
        while time.monotonic() < end:
            body = chat_body(model, f"Tell me a story about the number {i * 1000 + n}.", tokens)
            records.append(await one_request(heavy, "/chat/completions", body))
            n += 1

    async def light_client():
        while time.monotonic() < end:
            body = chat_body(model, "What is the capital of France?", 16)
            light_records.append(await one_request(light, "/chat/completions", body))
            await asyncio.sleep(0.5)

    t0 = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)), light_client())
    elapsed = time.monotonic() - t0
    await heavy.aclose()
    await light.aclose()
    ok = [r for r in records if r.ok]
    return {"requests": len(records), "errors": len(records) - len(ok), "tpot": stats([r.tpot for r in ok if r.tpot]),
            "light_e2e": stats([r.e2e for r in light_records if r.ok]),
            "tokens_per_s": sum(r.output_tokens for r in ok + [r for r in light_records if r.ok]) / elapsed}  # fmt: skip


# -- the shared cores (issue 66) ---------------------------------------------------------------------------------
def server_share(server_args: list[str]) -> float:
    """The training share the server runs with (--fine-tuning-share)."""
    flag = "--fine-tuning-share"
    return float(server_args[server_args.index(flag) + 1]) if flag in server_args else DEFAULT_SHARE


def trained_rate(samples: list[tuple[float, int]]) -> float | None:
    """Training tokens/s from (time, trained tokens) samples: between the first and the last step seen to land
    (trained tokens grow a step at a time)."""
    changes = [now for before, now in zip(samples, samples[1:], strict=False) if now[1] != before[1]]
    if len(changes) < 2:
        return None
    (t0, n0), (t1, n1) = changes[0], changes[-1]
    return (n1 - n0) / (t1 - t0)


def watch_job(c: openai.OpenAI, job_id: str, seconds: float, poll: float = 0.25) -> list[tuple[float, int]]:
    samples, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        samples.append((time.monotonic(), c.fine_tuning.jobs.retrieve(job_id).trained_tokens or 0))
        time.sleep(poll)
    return samples


def copy_run(run_dir: Path, to: Path) -> Path | None:
    """The running job's rows and run spec copied to `to` (its checkpoints are not needed), or None where the job
    ended and its run directory went while they were copied."""
    from motet.training.worker import RUN_SPEC

    to.mkdir()
    try:
        for path in run_dir.glob("*.json*"):
            (to / path.name).write_bytes(path.read_bytes())
    except FileNotFoundError:
        return None
    return to if (to / RUN_SPEC).is_file() else None


def standalone_rate(copy: Path, threads: int, seconds: float) -> dict:
    """The job's run in a process of its own outside the server (the worker's training, on `copy`: copy_run's copy
    of the run's directory, the same rows, hyperparameters, seed and threads): its training tokens/s over `seconds`
    from its first step, as its events arrive."""
    from motet.training.worker import RUN_SPEC

    spec = json.loads((copy / RUN_SPEC).read_text()) | {"run_dir": str(copy), "adapter_dir": None}
    (copy / RUN_SPEC).write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.fine_tuning", "standalone", str(copy), "--threads", str(threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    samples: list[tuple[float, int]] = []
    started = False
    try:
        end = None
        for line in proc.stdout:
            event = json.loads(line)
            started = started or event["type"] == "ready"
            if event["type"] == "step":
                samples.append((time.monotonic(), event["trained_tokens"]))
                end = end or time.monotonic() + seconds
            if end is not None and time.monotonic() > end or event["type"] in ("succeeded", "failed"):
                break
    finally:
        proc.kill()
        proc.wait()
    return {"tokens_per_s": trained_rate([(0.0, 0), *samples]), "steps": len(samples), "started": started}


def compute_events(c: openai.OpenAI, job_id: str, since: float = 0.0) -> list[str]:
    """The job's events about compute since `since` (a time.time(); events are stamped in seconds), oldest first."""
    return [e.message for e in reversed(list(c.fine_tuning.jobs.list_events(job_id, limit=100)))
            if e.created_at >= since - 1 and "compute" in e.message]  # fmt: skip


def shared_cores(
    args, hyper: dict, c: openai.OpenAI, url: str, base: str, data: dict, tmp: Path, share: float
) -> dict:
    """Serving and a job on one machine's cores: each alone, then together; the job beside a CPU hog; the job in
    a process of its own."""
    out: dict = {"share": share, "clients": args.clients}
    print(f"shared cores: serving alone ({args.clients} clients) ...", flush=True)
    out["serving_alone"] = asyncio.run(load(url, base, args.clients, args.load_seconds, args.load_tokens))
    f = c.files.create(file=("shared.jsonl", data["files"]["upper"]), purpose="fine-tune")
    job = c.fine_tuning.jobs.create(training_file=f.id, model=base, suffix="shared", seed=0,
                                    method=sft({**hyper, "n_epochs": args.shared_epochs}))  # fmt: skip
    deadline = time.monotonic() + 1800
    while not c.fine_tuning.jobs.retrieve(job.id).trained_tokens:  # (trained a step: loaded and training)
        if time.monotonic() > deadline or c.fine_tuning.jobs.retrieve(job.id).status != "running":
            raise RuntimeError(f"the job did not start training: {c.fine_tuning.jobs.retrieve(job.id)}")
        time.sleep(0.5)
    # (copied now: on a fast machine the job may end before the standalone run's turn)
    copied = copy_run(tmp / "data" / "fine_tuning" / job.id, tmp / "run_copy")
    print("shared cores: the job alone ...", flush=True)
    out["job_alone_tokens_per_s"] = trained_rate(watch_job(c, job.id, args.job_seconds))
    print("shared cores: the job and serving together ...", flush=True)
    samples: list = []
    sampler = threading.Thread(target=lambda: samples.extend(watch_job(c, job.id, args.load_seconds)))
    sampler.start()
    out["serving_beside"] = asyncio.run(load(url, base, args.clients, args.load_seconds, args.load_tokens))
    sampler.join()
    out["job_beside_tokens_per_s"] = trained_rate(samples)
    print("shared cores: the job beside a CPU hog ...", flush=True)
    hog_start, since = time.time(), time.monotonic()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        out["job_beside_hog_tokens_per_s"] = trained_rate(watch_job(c, job.id, args.job_seconds))
        # the runner judges the last WAIT_WINDOW_S: two of them with the hog on, unless it has said so already
        while time.monotonic() < since + 2 * WAIT_WINDOW_S and not compute_events(c, job.id, hog_start):
            time.sleep(0.5)
    finally:
        hog.kill()
        hog.wait()
    out["hog_events"] = compute_events(c, job.id, hog_start)
    out["events"] = compute_events(c, job.id)
    status = c.fine_tuning.jobs.retrieve(job.id).status
    out["job_still_running"] = status == "running"
    if status in ("running", "queued"):
        c.fine_tuning.jobs.cancel(job.id)
    print("shared cores: the same run in a process of its own ...", flush=True)
    # (none where the job ended before its files were copied)
    out["standalone"] = {"tokens_per_s": None, "steps": 0, "started": False}
    if copied is not None:
        out["standalone"] = standalone_rate(copied, args.threads, args.job_seconds)
    alone, beside = out["serving_alone"]["tokens_per_s"], out["serving_beside"]["tokens_per_s"]
    job_alone = out["job_alone_tokens_per_s"]
    out["serving_ratio"] = beside / alone
    out["serving_target"] = 0.9 * (1 - share)
    out["job_ratio"] = (
        out["job_beside_tokens_per_s"] / job_alone if job_alone and out["job_beside_tokens_per_s"] else None
    )
    out["job_target"] = 0.8 * share
    standalone = out["standalone"]["tokens_per_s"]
    out["alone_vs_standalone"] = job_alone / standalone if job_alone and standalone else None
    hog_rate = out["job_beside_hog_tokens_per_s"]
    out["hog_ratio"] = hog_rate / job_alone if job_alone and hog_rate else None
    return out


MEMORY_SLACK = 150 * 2**20  # the acceptance's allowance beyond the adapter, optimizer and activations


def memory(args, hyper: dict, c: openai.OpenAI, server, base: str, data: dict, tmp: Path) -> dict:
    """The server's tree's PSS idle and at its peak while a job of --memory-examples examples trains; the worker's
    PSS by stage in a process of its own (benchmarks/process_memory.py's worker-stages, on a copy of the run)."""
    from benchmarks import process_memory as pm

    c.chat.completions.create(model=base, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    time.sleep(1.0)
    idle = min((pm.tree_pss(server.proc.pid) for _ in range(4)), key=lambda t: t["pss"])
    lines = data["files"]["upper"].splitlines()[: args.memory_examples]
    f = c.files.create(file=("memory.jsonl", b"\n".join(lines)), purpose="fine-tune")
    with pm.PeakSampler(server.proc.pid) as sampler:
        job = c.fine_tuning.jobs.create(
            training_file=f.id, model=base, suffix="memory", seed=0, method=sft(hyper)
        )
        run_dir, copied = tmp / "data" / "fine_tuning" / job.id, tmp / "memory_run"
        while job.status not in ("succeeded", "failed", "cancelled"):
            if not copied.exists() and (run_dir / "run.json").is_file():
                copied.mkdir()
                for path in run_dir.glob("*.json*"):  # (its rows and run.json)
                    (copied / path.name).write_bytes(path.read_bytes())
            time.sleep(0.5)
            job = c.fine_tuning.jobs.retrieve(job.id)
    if job.status != "succeeded":
        raise RuntimeError(f"job {job.id} {job.status}: {job.error}")
    spec = json.loads((copied / "run.json").read_text()) | {"run_dir": str(copied), "adapter_dir": None}
    (copied / "run.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "benchmarks.process_memory", "worker-stages", str(copied), "--threads",
           str(args.threads)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    stages = json.loads(out.stdout.strip().splitlines()[-1])
    adapter = sum(p.stat().st_size for p in (tmp / "data" / "adapters").rglob("*.safetensors"))
    trainable = adapter  # (float32 tensors: the adapter's bytes, safetensors' small header aside)
    optimizer = 3 * trainable  # AdamW's two moments and the gradients, float32 each
    s = stages["stages"]
    # what the steps add to the worker's own memory beyond the optimizer's state (its anonymous pages: a mapped
    # base's pages, resident as the steps touch them, are the weights, not activations)
    built = s["trainer built (base loaded, adapter made)"]["Pss_Anon"]
    activations = max(0, s["peak over the steps"]["Pss_Anon"] - built - optimizer)
    growth = sampler.peak["pss"] - idle["pss"]
    bound = adapter + optimizer + activations + MEMORY_SLACK
    return {"examples": len(lines), "hyperparameters": job.hyperparameters.model_dump(), "idle": idle,
            "with_job": sampler.peak, "worker_mappings": sampler.peak_mappings, "samples": sampler.samples,
            "growth": growth, "adapter": adapter, "optimizer_and_gradients": optimizer,
            "activations": activations, "bound": bound, "meets": growth <= bound, "worker_stages": stages}  # fmt: skip


def _memory_lines(r: dict) -> list[str]:
    m, mib = r["memory"], 2**20
    lines = [
        f"| server tree's PSS: idle / with a job of {m['examples']} examples (peak; batch "
        f"{m['hyperparameters']['batch_size']}) | {m['idle']['pss'] / mib:.0f} / {m['with_job']['pss'] / mib:.0f} "
        f"MiB: +{m['growth'] / mib:.0f} | <= +{m['bound'] / mib:.0f} (adapter {m['adapter'] / mib:.1f} + "
        f"optimizer and gradients {m['optimizer_and_gradients'] / mib:.1f} + activations "
        f"{m['activations'] / mib:.0f} + 150) |",
        "| the worker's PSS at the peak, by mapping | "
        + ", ".join(f"{k} {v / mib:.0f}" for k, v in m["worker_mappings"].items() if k != "pid")
        + " MiB | |",
    ]
    for stage, values in m["worker_stages"]["stages"].items():
        lines.append(f"| a worker on its own: {stage} | PSS {values.get('Pss', 0) / mib:.0f} MiB (anonymous "
                     f"{values.get('Pss_Anon', 0) / mib:.0f}, files {values.get('Pss_File', 0) / mib:.0f}) | |")  # fmt: skip
    return lines


def job_dtype(server_args: list[str]) -> str:
    """The dtype the server's jobs train in (the serving dtype: --dtype, else auto's)."""
    import torch

    from motet.engine.config import DTYPES, auto_dtype

    if "--dtype" in server_args:
        return str(DTYPES[server_args[server_args.index("--dtype") + 1]]).removeprefix("torch.")
    return auto_dtype(torch.device("cpu"))[0]


def machine() -> dict:
    from motet.kernels.cpu_isa import cpu_flags

    name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor())  # fmt: skip
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma")
    return {"cpu": name, "cores": os.cpu_count(), "flags": [f for f in wanted if f in cpu_flags()]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    q = sub.add_parser(
        "quality", help="what a job teaches, with the docs' defaults (benchmarks/fine_tuning_quality.py)"
    )
    q.add_argument("--model", default=None, help="the base model (default: the default model)")
    q.add_argument("--output-dir", default="benchmarks/reports/fine_tuning")
    q.add_argument("--examples", type=int, default=None,
                   help="the first N lines of each data file only (a quick run; default: all)")  # fmt: skip
    q.add_argument("--max-tokens", type=int, default=64, help="each answer's length limit")
    q.add_argument("--n-epochs", type=int, default=None,
                   help="both jobs' epochs (a quick run; default: the docs' default, none given: auto)")  # fmt: skip
    q.add_argument("--behaviour", default="extraction.jsonl",
                   help="the supervised job's file in benchmarks/data/fine_tuning/ (its held-out inputs, where there "
                        "are some: NAME_heldout.jsonl)")  # fmt: skip
    q.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed to `motet serve`")
    h = sub.add_parser("by-hand", help="(internal) the PEFT/TRL run by hand")
    for flag in ("--model-dir", "--data", "--hyperparameters", "--out", "--dtype"):
        h.add_argument(flag, required=True)
    h.add_argument("--threads", type=int, required=True)
    st = sub.add_parser("standalone", help="(internal) a job's run directory trained in a process of its own")
    st.add_argument("run_dir")
    st.add_argument("--threads", type=int, required=True)
    p.add_argument("--model", default=None, help="the base model (default: the default model)")
    p.add_argument("--examples", type=int, default=200, help="training prompts for each behaviour")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts for the checks and DPO")
    p.add_argument("--answer-tokens", type=int, default=48)
    p.add_argument("--n-epochs", default="auto")
    p.add_argument("--batch-size", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="the job's and the hand run's")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--load-tokens", type=int, default=64)
    p.add_argument("--load-seconds", type=float, default=60)
    p.add_argument(
        "--committed-adapters",
        default=str(FIXTURES),
        help="the committed `upper` and `json` adapters the fine-tuned ones are held to (none: no check)",
    )
    p.add_argument(
        "--load-only",
        action="store_true",
        help="measure serving alone, without and with a (DPO) job training, cancelled after it",
    )
    p.add_argument("--shared-cores", action="store_true", help="measure the shared cores alone (issue 66)")
    p.add_argument("--shared-epochs", type=int, default=50, help="the shared cores' job's epochs (it is cancelled "
                   "once measured: long enough to outlast the measures)")  # fmt: skip
    p.add_argument("--job-seconds", type=float, default=60, help="the shared cores: how long the job's speed alone, "
                   "beside the hog and in its own process is measured")  # fmt: skip
    p.add_argument(
        "--memory", action="store_true", help="measure the server's PSS with a job alone (issue 66)"
    )
    p.add_argument("--memory-examples", type=int, default=40, help="--memory: the job's examples")
    p.add_argument("--output-dir", default="benchmarks/reports/fine_tuning")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="passed to `motet serve`")
    args = p.parse_args(argv)
    if args.command == "by-hand":
        return by_hand(args)
    if args.command == "standalone":
        return standalone(args)
    if args.command == "quality":
        from benchmarks import fine_tuning_quality

        return fine_tuning_quality.run(args, run_job, dpo_margins, machine)
    out = Path(args.output_dir)
    hyper = {
        k: (v if v == "auto" else int(v))
        for k, v in (("n_epochs", args.n_epochs), ("batch_size", args.batch_size))
    }
    print("the base model's answers (cached) ...", flush=True)
    data = make_data(args.model, args.examples, args.eval_prompts, args.answer_tokens, out / "cache")
    report: dict = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "command"}}
    committed_dir = None if args.committed_adapters == "none" else Path(args.committed_adapters)
    committed_names = BEHAVIOURS if committed_dir is not None else ()
    with tempfile.TemporaryDirectory(prefix="motet-ft-bench-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "keys.json").write_text(json.dumps(KEYS))
        server_args = ["--api-keys", str(tmp / "keys.json"), "--data-dir", str(tmp / "data"),
                       "--fine-tuning-threads", str(args.threads), "--fine-tuning-max-jobs-per-tenant", "8",
                       *[a for name in committed_names for a in ("--lora", f"{name}={committed_dir / name}")],
                       *args.server_args]  # fmt: skip
        with ManagedServer(server_args, model=args.model, log_path=out / "server.log") as server:
            c = openai.OpenAI(base_url=server.base_url, api_key="sk-trainer", max_retries=0, timeout=600)
            base = c.models.list().data[0].id
            if args.shared_cores:
                share = server_share(args.server_args)
                report["shared_cores"] = shared_cores(args, hyper, c, server.url, base, data, tmp, share)
                write_report(out, "fine_tuning", report, summary(report))
                return 0
            if args.memory:
                report["memory"] = memory(args, hyper, c, server, base, data, tmp)
                write_report(out, "fine_tuning", report, summary(report))
                return 0
            if not args.load_only:  # (--load-only: the serving measure alone)
                jobs = {}
                for name in BEHAVIOURS:
                    print(f"job {name} ...", flush=True)
                    jobs[name] = run_job(c, data["files"][name], sft(hyper), name)
                timings = ("seconds", "first_step_s", "tokens_per_s", "train_seconds", "train_tokens_per_s")
                report["jobs"] = {k: {kk: v[kk] for kk in timings} | {"trained_tokens":
                                  v["job"]["trained_tokens"], "hyperparameters": v["job"]["hyperparameters"]}
                                  for k, v in jobs.items()}  # fmt: skip
                print("the same run by hand ...", flush=True)
                dtype = job_dtype(args.server_args)
                hand = run_by_hand(
                    data["model_dir"], data["files"]["upper"], jobs["upper"]["job"], args.threads, dtype, tmp
                )
                report["by_hand"] = hand
                report["speed_ratio"] = jobs["upper"]["tokens_per_s"] / hand["tokens_per_s"]
                report["train_speed_ratio"] = jobs["upper"]["train_tokens_per_s"] / hand["train_tokens_per_s"]
                print("behaviour checks ...", flush=True)
                generate = http_generate(c, base)
                tuned = behaviour(
                    generate, data["eval_prompts"], {n: jobs[n]["job"]["fine_tuned_model"] for n in CHECKS}
                )
                committed = (
                    behaviour(generate, data["eval_prompts"], {n: n for n in CHECKS})
                    if committed_names
                    else {}
                )
                report["behaviours"] = {}
                for n in CHECKS:
                    rate = committed[n]["adapter_rate"] if committed else None
                    report["behaviours"][n] = {"fine_tuned": tuned[n]["adapter_rate"], "committed": rate,
                                               "base": tuned[n]["base_rate"],
                                               "ratio": tuned[n]["adapter_rate"] / rate if rate else None}  # fmt: skip
            print("load without a job ...", flush=True)
            report["load_alone"] = asyncio.run(
                load(server.url, base, args.clients, args.load_seconds, args.load_tokens)
            )
            print("DPO job, and the load while it trains ...", flush=True)
            dpo: dict = {}
            dpo_method = {"type": "dpo", "dpo": {"hyperparameters": hyper}}

            def dpo_job():
                try:
                    dpo.update(run_job(c, data["files"]["dpo"], dpo_method, "dpo"))
                except RuntimeError as e:  # (cancelled, with --load-only)
                    dpo["error"] = str(e)

            worker = threading.Thread(target=dpo_job)
            worker.start()
            while worker.is_alive() and not [
                j for j in c.fine_tuning.jobs.list().data if j.status == "running"
            ]:
                time.sleep(0.2)
            report["load_with_job"] = asyncio.run(
                load(server.url, base, args.clients, args.load_seconds, args.load_tokens)
            )
            report["load_with_job"]["job_still_running"] = worker.is_alive()
            if args.load_only:  # measured: the job is not waited for
                for job in c.fine_tuning.jobs.list().data:
                    if job.status in ("queued", "running"):
                        c.fine_tuning.jobs.cancel(job.id)
            worker.join()
            if not args.load_only:
                if "job" not in dpo:
                    raise RuntimeError("the DPO job did not succeed (its error is in the output above)")
                adapter = tmp / "data" / "adapters" / "trainer" / dpo["job"]["fine_tuned_model"]
                report["dpo"] = dpo_margins(data["model_dir"], adapter, data["held_out_pairs"]) | {
                    "seconds": dpo["seconds"],
                    "trained_tokens": dpo["job"]["trained_tokens"],
                }
    alone, busy = report["load_alone"], report["load_with_job"]
    report["tpot_p50_ratio"] = busy["tpot"]["p50"] / alone["tpot"]["p50"]
    report["light_e2e_p50_ratio"] = busy["light_e2e"]["p50"] / alone["light_e2e"]["p50"]
    write_report(out, "fine_tuning", report, summary(report))
    return 0


def _job_lines(r: dict) -> list[str]:
    lines = []
    for name, job in r["jobs"].items():
        lines.append(
            f"| `{name}` job: created to its first step, time running, tokens/s (training alone) | "
            f"{job['first_step_s'] or float('nan'):.1f} s, {job['seconds']:.0f} s, {job['tokens_per_s']:.0f} "
            f"({job['train_tokens_per_s']:.0f}) | |"
        )
    h = r["by_hand"]
    lines += [
        f"| PEFT/TRL by hand: wall, train() | {h['wall_seconds']:.0f} s, {h['train_seconds']:.0f} s | |",
        f"| job tokens/s / by hand's: end to end (start, load, train, save) | {r['speed_ratio']:.2f} | >= 0.90 |",
        f"| job tokens/s / by hand's: training alone (the job's from its events, to the second) | "
        f"{r['train_speed_ratio']:.2f} | >= 0.90 |",
    ]
    for name, b in r["behaviours"].items():
        ratio = "n/a" if b["ratio"] is None else f"{b['ratio']:.2f}"
        committed = "n/a" if b["committed"] is None else f"{b['committed']:.2f}"
        lines.append(f"| `{name}` pass rate: ft / committed (base) | {b['fine_tuned']:.2f} / {committed} "
                     f"({b['base']:.2f}): {ratio} | >= 0.90 |")  # fmt: skip
    d = r["dpo"]
    moved = (
        "n/a"
        if not d["pairs"]
        else f"{d['margin_before']:.2f} -> {d['margin_after']:.2f} ({d['share_up']:.2f})"
    )
    lines.append(
        f"| DPO: preferred's margin on {d['pairs']} held-out pairs, before -> after (share up) | {moved} | up |"
    )
    return lines


def _shared_lines(r: dict) -> list[str]:
    s = r["shared_cores"]

    def num(x, fmt=".2f"):
        return "n/a" if x is None else format(x, fmt)

    return [
        f"| serving's output tokens/s, {s['clients']} streamed clients: beside a job / alone | "
        f"{num(s['serving_beside']['tokens_per_s'], '.0f')} / {num(s['serving_alone']['tokens_per_s'], '.0f')}: "
        f"{num(s['serving_ratio'])} | >= {s['serving_target']:.3f} (0.9 x (1 - {s['share']})) |",
        f"| TPOT p50 beside a job / alone | {s['serving_beside']['tpot']['p50'] * 1e3:.1f} / "
        f"{s['serving_alone']['tpot']['p50'] * 1e3:.1f} ms | |",
        f"| the job's training tokens/s: beside the clients / alone (serving idle) | "
        f"{num(s['job_beside_tokens_per_s'], '.1f')} / {num(s['job_alone_tokens_per_s'], '.1f')}: "
        f"{num(s['job_ratio'])} | >= {s['job_target']:.3f} (0.8 x {s['share']}) |",
        f"| the job alone / the same run in a process of its own | {num(s['job_alone_tokens_per_s'], '.1f')} / "
        f"{num(s['standalone']['tokens_per_s'], '.1f')}: {num(s['alone_vs_standalone'])} | >= 0.90 |",
        f"| the job beside a CPU hog / alone | {num(s['job_beside_hog_tokens_per_s'], '.1f')}: "
        f"{num(s['hog_ratio'])} | progresses |",
        f"| its events beside the hog | {'; '.join(s['hog_events']) or 'none'} | says when it waits |",
    ]


def summary(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# Fine-tuning as a service", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, flags {', '.join(m['flags']) or 'none of avx2/avx512'}; "
        f"{r['args']['examples']} examples a behaviour, {r['args']['threads']} training threads.", "",
        "| measure | value | target |", "|---|---|---|",
    ]  # fmt: skip
    if "shared_cores" in r:
        return "\n".join(lines + _shared_lines(r)) + "\n"
    if "memory" in r:
        return "\n".join(lines + _memory_lines(r)) + "\n"
    if "jobs" in r:  # (not with --load-only)
        lines += _job_lines(r)
    alone, busy = r["load_alone"], r["load_with_job"]
    slower = 1 / (0.9 * (1 - server_share(r["args"]["server_args"])))  # (serving lends the job its share)
    lines += [
        f"| TPOT p50 with a job / without ({r['args']['clients']} clients): {busy['tpot']['p50'] * 1e3:.1f} / "
        f"{alone['tpot']['p50'] * 1e3:.1f} ms | {r['tpot_p50_ratio']:.2f} | <= {slower:.2f} |",
        f"| light tenant's E2E p50 with a job / without: {busy['light_e2e']['p50']:.2f} / "
        f"{alone['light_e2e']['p50']:.2f} s | {r['light_e2e_p50_ratio']:.2f} | <= {slower:.2f} |",
    ]
    if not r["load_with_job"]["job_still_running"]:
        lines += ["", "Note: the DPO job ended before the load did: make it longer (--examples, --n-epochs)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
