"""LoRA adapters over HTTP: do the trained adapters behave as trained, and does each request compute what
PEFT computes?

Two parts, both through the server's API (the adapters are uploaded with `POST /v1/adapters` under
unique names and deleted at the end):

- behaviour: the two trained fixture adapters (`--adapters-dir`, default tests/fixtures/adapters:
  `upper` answers in upper case, `json` with a JSON object; motet/evals/train_adapters.py trains them) answer
  held-out prompts (chat completions, greedy, `--concurrency` in flight), and so does the base model.
  Per check, the share of answers that pass it: with the adapter it should be near 1, with the base
  model near 0.
- agreement: `--random-adapters` random adapters (rank `--random-rank`, all seven modules) and the base
  model get one concurrent burst of mixed completions requests (token-id prompts, `max_tokens` 8,
  greedy, `logprobs` 1). Each request is then replayed in this process with HF transformers + PEFT
  (fp32) and that adapter alone: per adapter, the share of greedy tokens that agree and the largest
  |logprob difference| of the chosen and top tokens (up to the first disagreement, where the contexts
  still match), beside the largest |logprob change| the adapter makes over the base model (the scale the
  difference should be small against).

`--limit` caps the prompts of each part. The PEFT reference needs the served base model as a local HF
checkpoint (`--hf-model`, default: the model named by --model, or the default model).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import tempfile
import time
import uuid
from pathlib import Path

from motet.evals import report
from motet.evals.context import EvalContext, api_error
from motet.evals.train_adapters import CHECKS, FIXTURES, MAX_TOKENS, behaviour, prompts
from motet.flag_types import input_directory

NAME = "lora"
NEEDS_SERVER = True
FILES = ("adapter_config.json", "adapter_model.safetensors")
AGREEMENT_TOKENS = 8


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("lora options")
    g.add_argument(
        "--adapters-dir",
        type=input_directory,
        default=FIXTURES,
        help="the trained adapters: DIR/upper, DIR/json",
    )
    g.add_argument("--prompts", type=int, default=64, help="held-out prompts of the behaviour check")
    g.add_argument(
        "--max-tokens", type=int, default=MAX_TOKENS, help="completion budget of a behaviour answer"
    )
    g.add_argument("--random-adapters", type=int, default=4, help="random adapters of the agreement check")
    g.add_argument("--random-rank", type=int, default=16)
    g.add_argument("--random-scale", type=float, default=16.0, help="alpha / rank of the random adapters")
    g.add_argument("--agreement-prompts", type=int, default=40, help="requests of the agreement check")
    g.add_argument(
        "--hf-model", default=None, help="local HF checkpoint of the served base model (PEFT reference)"
    )
    g.add_argument(
        "--skip", nargs="+", choices=("behaviour", "agreement"), default=[], help="parts to leave out"
    )


# -- adapters over HTTP -----------------------------------------------------------------------------------
def upload(ctx: EvalContext, name: str, path: Path) -> None:
    import httpx

    parts = [("files", (f, (path / f).read_bytes(), "application/octet-stream")) for f in FILES]
    r = httpx.post(
        f"{ctx.base_url}/adapters", data={"name": name}, files=parts, headers=ctx.headers(), timeout=120
    )
    if r.status_code != 200:
        raise RuntimeError(f"uploading adapter {name!r} from {path} failed: {r.status_code} {r.text[:300]}")


def delete(ctx: EvalContext, name: str) -> None:
    import httpx

    with contextlib.suppress(httpx.HTTPError):  # best effort: the results do not depend on it
        httpx.delete(f"{ctx.base_url}/adapters/{name}", headers=ctx.headers(), timeout=60)


# -- part 1: behaviour ------------------------------------------------------------------------------------
def run_behaviour(ctx: EvalContext, tag: str) -> dict:
    names = {check: f"{tag}-{check}" for check in CHECKS}
    n = min(ctx.args.prompts, ctx.limit or ctx.args.prompts)
    errors: list[str] = []

    async def answer(client, adapter: str | None, prompt: str) -> str:
        try:
            r = await client.chat.completions.create(
                model=adapter or ctx.model,
                messages=[{"role": "user", "content": prompt}],
                temperature=0,
                max_tokens=ctx.args.max_tokens,
            )
            return r.choices[0].message.content or ""
        except Exception as e:  # scored as an answer that fails its check; the first errors are reported
            errors.append(f"{adapter or ctx.model}: {api_error(e)[1]}")
            return ""

    for check, name in names.items():
        upload(ctx, name, Path(ctx.args.adapters_dir) / check)
    try:
        generate = functools.partial(ctx.map_requests, "lora behaviour", answer)  # requests -> answers
        out = behaviour(generate, prompts("eval")[:n], names)
    finally:
        for name in names.values():
            delete(ctx, name)
    return {"checks": out, "errors": len(errors), "first_errors": errors[:5]}


# -- part 2: agreement with PEFT --------------------------------------------------------------------------
def agreement_prompts(tokenizer, n: int) -> list[list[int]]:
    """Chat-formatted token ids of held-out prompts (ids, so that both sides see exactly the same tokens)."""
    pool = prompts("eval")
    chats = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": pool[i % len(pool)]}], add_generation_prompt=True, tokenize=False
        )
        for i in range(n)
    ]
    return [tokenizer.encode(c, add_special_tokens=False) for c in chats]  # the template writes its specials


def peft_greedy(model, adapter: str | None, prompt: list[int], new_tokens: int, eos: list[int]):
    """HF + PEFT with `adapter` alone (None: adapters off): greedy tokens and each step's log-softmax.

    Also the log-softmax of the same tokens with adapters off, for the size of the adapter's effect."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        off = model.disable_adapter() if adapter is None else contextlib.nullcontext()
        with off:
            if adapter is not None:
                model.set_adapter(adapter)
            out = model.generate(
                ids,
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=eos or None,
                pad_token_id=eos[0] if eos else None,
                output_logits=True,  # the raw logits of each step, before any logits processor
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        lps = torch.log_softmax(torch.cat(out.logits).float(), -1)
        with model.disable_adapter():
            logits = model(out.sequences).logits[0, len(prompt) - 1 : -1]
        base = torch.log_softmax(logits.float(), -1)
    return tokens, lps, base


def compare(served: dict, tokens: list[int], lps, base, token_strings) -> dict:
    """One request: the served greedy tokens and logprobs against the PEFT reference's."""
    got = served["tokens"]
    want = [token_strings(t) for t in tokens]
    agree = 0
    for g, w in zip(got, want, strict=False):
        if g not in w:
            break
        agree += 1
    n = min(len(got), len(tokens), agree + 1)  # positions whose context is the same on both sides
    diffs, effect = [], 0.0
    for i in range(n):
        t = tokens[i]
        if got[i] in want[i]:  # the chosen token's logprob
            diffs.append(abs(served["logprobs"][i] - float(lps[i, t])))
            effect = max(effect, abs(float(lps[i, t]) - float(base[i, t])))
        top = served["top"][i]
        if top:  # the top-1 logprob (the same token when greedy agrees; here, its value)
            diffs.append(abs(max(top.values()) - float(lps[i].max())))
    return {
        "tokens": len(tokens),
        "served_tokens": len(got),
        "agreeing_tokens": agree,
        "identical": agree == len(tokens) == len(got),
        "max_abs_logprob_diff": max(diffs, default=None),
        "adapter_effect": effect,
        # teacher-forced: at some step the base model would have picked another token than the adapter
        "changes_greedy": any(int(base[i].argmax()) != t for i, t in enumerate(tokens)),
    }


def run_agreement(ctx: EvalContext, tag: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from motet.engine.weights.model_config import load_model_config
    from motet.engine.weights.model_store import resolve_model
    from motet.evals.lora_reference import peft_model, write_random_adapter

    model_dir = resolve_model(ctx.args.hf_model or ctx.model_path or ctx.model or None)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    k, rank = ctx.args.random_adapters, ctx.args.random_rank
    n = min(ctx.args.agreement_prompts, ctx.limit or ctx.args.agreement_prompts)
    tmp = tempfile.TemporaryDirectory(prefix="motet-lora-eval-")
    config = load_model_config(model_dir)
    paths = {}
    for i in range(k):
        alpha = ctx.args.random_scale * rank  # scale alpha/r: strong enough to change tokens
        path = write_random_adapter(Path(tmp.name) / str(i), config, rank, seed=1000 + i, alpha=alpha)
        paths[f"{tag}-random-{i}"] = path
    groups = [None, *paths]  # request j goes to groups[j % len(groups)]: the base model among the adapters
    requests = [(groups[j % len(groups)], p) for j, p in enumerate(agreement_prompts(tokenizer, n))]
    errors: list[str] = []

    async def complete(client, adapter: str | None, prompt: list[int]) -> dict | None:
        try:
            r = await client.completions.create(
                model=adapter or ctx.model,
                prompt=prompt,
                max_tokens=AGREEMENT_TOKENS,
                temperature=0,
                logprobs=1,
            )
        except Exception as e:  # left out of the comparison; the first errors are reported
            errors.append(f"{adapter or ctx.model}: {api_error(e)[1]}")
            return None
        lp = r.choices[0].logprobs
        return {"tokens": lp.tokens, "logprobs": lp.token_logprobs, "top": lp.top_logprobs}

    for name, path in paths.items():
        upload(ctx, name, path)
    try:
        served = ctx.map_requests("lora agreement", complete, requests)
    finally:
        for name in paths:
            delete(ctx, name)

    # The reference, in this process: one PeftModel holding every adapter, one adapter active at a time.
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = peft_model(base, paths)
    eos = list(load_model_config(model_dir).eos_token_ids)

    def token_strings(t: int) -> set[str]:  # a server may name a token by its text or its vocabulary entry
        return {tokenizer.decode([t]), tokenizer.convert_ids_to_tokens(t), f"token_id:{t}"}

    per_request = []
    bar = ctx.progress(len(requests), "lora PEFT reference")
    for (adapter, prompt), s in zip(requests, served, strict=True):
        if s is None:
            bar.update(1)
            continue
        tokens, lps, base_lps = peft_greedy(model, adapter, prompt, AGREEMENT_TOKENS, eos)
        per_request.append({"adapter": adapter or "base", **compare(s, tokens, lps, base_lps, token_strings)})
        bar.update(1)
    bar.close()
    tmp.cleanup()

    per_adapter = {}
    for group in groups:
        label = group or "base"
        rows = [r for r in per_request if r["adapter"] == label]
        diffs = [r["max_abs_logprob_diff"] for r in rows if r["max_abs_logprob_diff"] is not None]
        per_adapter[label.removeprefix(f"{tag}-")] = {
            "requests": len(rows),
            "identical_requests": sum(r["identical"] for r in rows) / len(rows) if rows else None,
            "token_agreement": report.rate(
                sum(r["agreeing_tokens"] for r in rows), sum(r["tokens"] for r in rows)
            ),
            "max_abs_logprob_diff": max(diffs, default=None),
            "adapter_effect": max((r["adapter_effect"] for r in rows), default=None) if group else None,
            "changes_greedy": report.rate(sum(r["changes_greedy"] for r in rows), len(rows))
            if group
            else None,
        }
    all_diffs = [
        a["max_abs_logprob_diff"] for a in per_adapter.values() if a["max_abs_logprob_diff"] is not None
    ]
    return {
        "requests": len(requests),
        "errors": len(errors),
        "first_errors": errors[:5],
        "random_adapters": k,
        "rank": rank,
        "scale": ctx.args.random_scale,
        "max_tokens": AGREEMENT_TOKENS,
        "token_agreement": report.rate(
            sum(r["agreeing_tokens"] for r in per_request), sum(r["tokens"] for r in per_request)
        ),
        "identical_requests": report.rate(sum(r["identical"] for r in per_request), len(per_request)),
        "max_abs_logprob_diff": max(all_diffs, default=None),
        "per_adapter": per_adapter,
    }


def run(ctx: EvalContext) -> dict:
    tag = f"lora-eval-{uuid.uuid4().hex[:8]}"  # unique adapter names: a shared server may hold others
    out: dict = {}
    t0 = time.perf_counter()
    if "behaviour" not in ctx.args.skip:
        out["behaviour"] = run_behaviour(ctx, tag)
        out["behaviour_seconds"] = time.perf_counter() - t0
    if "agreement" not in ctx.args.skip:
        t1 = time.perf_counter()
        out["agreement"] = run_agreement(ctx, tag)
        out["agreement_seconds"] = time.perf_counter() - t1
    return out


# -- the report -------------------------------------------------------------------------------------------
def markdown(results: dict) -> str:
    parts = []
    if b := results.get("behaviour"):
        rows = [
            [f"`{check}`", str(r["prompts"]), report.pct(r["adapter_rate"]), report.pct(r["base_rate"])]
            for check, r in b["checks"].items()
        ]
        parts += [
            "## Behaviour of the trained adapters",
            "",
            "Share of held-out answers that pass each check (`upper`: letters, none lower case; `json`: the "
            "answer parses as a JSON object), with the adapter and with the base model.",
            "",
            report.table(["check", "prompts", "with adapter", "base model"], rows),
            "",
        ]
        if b["errors"]:
            parts += [f"{b['errors']} requests failed, e.g. `{b['first_errors'][0]}`", ""]
        for check, r in b["checks"].items():
            if r["examples"]:
                ex = r["examples"][0]
                parts += [f"- `{check}` on *{ex['prompt']}*: {json.dumps(ex['adapter'][:160])}"]
        parts.append("")
    if a := results.get("agreement"):
        rows = [
            [
                name,
                str(r["requests"]),
                report.pct(r["identical_requests"]),
                report.pct(r["token_agreement"]),
                report.fmt(r["max_abs_logprob_diff"], ".1e"),
                report.fmt(r["adapter_effect"], ".2f"),
                report.pct(r["changes_greedy"]),
            ]
            for name, r in a["per_adapter"].items()
        ]
        parts += [
            "## Agreement with HF transformers + PEFT",
            "",
            f"{a['requests']} concurrent completions requests ({a['max_tokens']} greedy tokens, logprobs) "
            f"spread over {a['random_adapters']} random adapters (rank {a['rank']}, alpha/r "
            f"{report.fmt(a.get('scale'), 'g')}, all seven modules) and "
            f"the base model, each compared with PEFT running that adapter alone. Token agreement "
            f"{report.pct(a['token_agreement'])}, identical requests {report.pct(a['identical_requests'])}, "
            f"max |logprob diff| {report.fmt(a['max_abs_logprob_diff'], '.1e')}.",
            "",
            report.table(
                [
                    "adapter",
                    "requests",
                    "identical",
                    "tokens agree",
                    "max abs logprob diff",
                    "adapter effect",
                    "changes greedy",
                ],
                rows,
            ),
            "",
            *(
                [f"{a['errors']} requests failed and are left out, e.g. `{a['first_errors'][0]}`", ""]
                if a.get("errors")
                else []
            ),
            "*adapter effect*: the largest change the adapter makes to a chosen token's logprob over the base"
            " model (PEFT), the scale against which the difference is small; *changes greedy*: requests where,"
            " at some step, the base model would have picked another token than the adapter did.",
        ]
    return "\n".join(parts)


def plots(results: dict, out_dir: Path) -> list[Path]:
    plt = report.pyplot()
    out = []
    if b := results.get("behaviour"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        checks = list(b["checks"])
        report.grouped_bars(
            ax,
            [f"{c} ({b['checks'][c]['prompts']} prompts)" for c in checks],
            {
                "with adapter": [b["checks"][c]["adapter_rate"] for c in checks],
                "base model": [b["checks"][c]["base_rate"] for c in checks],
            },
            "share of answers passing the check",
            "Trained adapters: behaviour on held-out prompts",
            value_fmt=".2f",
            ylim=(0, 1.1),
        )
        out.append(report.save(fig, out_dir / "lora_behaviour.png"))
    if a := results.get("agreement"):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(a["per_adapter"])
        report.grouped_bars(
            ax,
            names,
            {
                "max |logprob diff| vs PEFT": [a["per_adapter"][n]["max_abs_logprob_diff"] for n in names],
                "adapter effect (vs base)": [a["per_adapter"][n]["adapter_effect"] for n in names],
            },
            "|logprob| (log scale)",
            f"Served logprobs vs HF+PEFT ({a['requests']} mixed requests)",
            value_fmt=".1e",
        )
        ax.set_yscale("log")
        out.append(report.save(fig, out_dir / "lora_agreement.png"))
    return out


def summary(results: dict) -> str:
    lines = []
    if b := results.get("behaviour"):
        for check, r in b["checks"].items():
            lines.append(
                f"{check}: {report.pct(r['adapter_rate'])} of {r['prompts']} answers pass with the adapter, "
                f"{report.pct(r['base_rate'])} with the base model"
            )
    if a := results.get("agreement"):
        lines.append(
            f"PEFT agreement over {a['requests']} mixed requests: tokens {report.pct(a['token_agreement'])}, "
            f"max |logprob diff| {report.fmt(a['max_abs_logprob_diff'], '.1e')}"
        )
    return "\n".join(lines)
