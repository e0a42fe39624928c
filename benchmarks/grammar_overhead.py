"""What structured output costs: 32 concurrent JSON-schema requests vs 32 unconstrained ones of equal
output length, on the offline engine, in one process.

1. constrained: each request has a JSON schema (greedy, the engine's defaults); record its output length;
2. unconstrained: the same prompts, each forced to the same length (ignore_eos, max_tokens = that length);
3. constrained with jump-forward: how many steps it saves, and what it does to the time.

Reports throughput (output tokens/s) and the ratio, the bitmask time per step (filled on a side thread
while the forward pass runs: how long it took, and how long the step still waited for it), the time to
apply the masks, and jump-forward's tokens and steps. Writes JSON and Markdown.

    python -m benchmarks.grammar_overhead --requests 32
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from benchmarks import write_report
from motet.engine.llm import LLM
from motet.engine.outputs import RequestOutputs
from motet.engine.sampling_params import SamplingParams
from motet.grammar.specs import JsonSchemaSpec

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "format": "email"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["name", "age", "email", "tags"],
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "year": {"type": "integer"},
            "genre": {"enum": ["drama", "comedy", "action", "documentary"]},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title", "year", "genre", "rating"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "country": {"type": "string"},
            "population": {"type": "integer"},
            "landmarks": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        },
        "required": ["city", "country", "population", "landmarks"],
    },
]
TOPICS = ["a person", "a movie", "a city"]


def run(llm: LLM, prompts, params) -> dict:
    engine, answers = llm.engine, RequestOutputs()
    before = engine.stats().grammar
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    outs, steps = {}, 0
    t0 = time.perf_counter()
    while engine.has_unfinished():
        steps += 1
        for o in answers.step(engine):
            if o.finished:
                outs[o.request_id] = o
    seconds = time.perf_counter() - t0
    lengths = [len(outs[i].token_ids) for i in ids]
    stats = engine.stats().grammar
    delta = {f.name: getattr(stats, f.name) - getattr(before, f.name) for f in dataclasses.fields(stats)}
    per_step = {k: delta[k] / max(1, delta["steps"]) * 1e3 for k in ("fill_s", "wait_s", "apply_s")}
    return {
        "seconds": seconds,
        "steps": steps,
        "output_tokens": sum(lengths),
        "tokens_per_s": sum(lengths) / seconds,
        "lengths": lengths,
        "finish_reasons": [outs[i].finish_reason for i in ids],
        "texts": [outs[i].text for i in ids],
        "grammar": delta,
        "ms_per_constrained_step": {k.replace("_s", "_ms"): v for k, v in per_step.items()},
    }


def markdown(r: dict) -> str:
    c, u, j = r["constrained"], r["unconstrained"], r["constrained_jump_forward"]
    ms = c["ms_per_constrained_step"]
    lines = [
        f"# Structured-output overhead ({r['requests']} concurrent requests, {r['dtype']})",
        "",
        "| run | output tokens | steps | seconds | tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, x in (
        ("JSON schema", c),
        ("unconstrained, same lengths", u),
        ("JSON schema, with jump-forward", j),
    ):
        lines.append(
            f"| {name} | {x['output_tokens']} | {x['steps']} | {x['seconds']:.2f} | {x['tokens_per_s']:.1f} |"
        )
    lines += [
        "",
        f"- constrained / unconstrained throughput: **{r['ratio']:.1%}** (target >= 90%)",
        f"- bitmask per constrained step: filled in {ms['fill_ms']:.2f} ms on a side thread during the forward "
        f"pass, of which the step waited {ms['wait_ms']:.2f} ms; applying the masks took {ms['apply_ms']:.2f} ms",
        f"- jump-forward (`--jump-forward`): {j['grammar']['jump_forward_tokens']} of {j['output_tokens']} tokens "
        f"appended without sampling, {c['steps'] - j['steps']} fewer steps; it took "
        f"{j['seconds'] / c['seconds']:.2f}x the time of the run without it",
        f"- valid JSON (finished with stop): {r['valid']}/{r['requests']}",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--out", type=Path, default=Path("reports/grammar_overhead"))
    args = ap.parse_args(argv)

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(64, args.requests), num_threads=args.threads)
    tok = llm.tokenizer
    prompts, specs = [], []
    for i in range(args.requests):
        k = i % len(SCHEMAS)
        ask = f"Describe {TOPICS[k]} (example {i}) as JSON with fields {', '.join(SCHEMAS[k]['properties'])}."
        prompts.append(tok.encode_chat([{"role": "user", "content": ask}]))
        specs.append(JsonSchemaSpec(SCHEMAS[k]))
    for spec in specs[: len(SCHEMAS)]:
        llm.engine.compile_grammar(spec)  # compile outside the timed runs (the server caches them too)
    run(llm, prompts[:2], [SamplingParams(temperature=0, max_tokens=4)] * 2)  # warm-up

    def best(params, jump_forward=True):  # the faster of --repeats runs: this machine is noisy
        llm.engine.config.jump_forward = jump_forward
        return min((run(llm, prompts, params) for _ in range(args.repeats)), key=lambda r: r["seconds"])

    json_params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, grammar=s) for s in specs]
    constrained = best(json_params, jump_forward=False)  # the engine's default
    same_length = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in constrained["lengths"]
    ]
    unconstrained = best(same_length)
    jump = best(json_params, jump_forward=True)

    valid = 0
    for text, reason, k in zip(
        constrained["texts"], constrained["finish_reasons"], range(args.requests), strict=True
    ):
        if reason == "stop":
            import jsonschema

            jsonschema.validate(json.loads(text), SCHEMAS[k % len(SCHEMAS)])
            valid += 1
    report = {
        "requests": args.requests,
        "dtype": args.dtype,
        "constrained": constrained,
        "unconstrained": unconstrained,
        "constrained_jump_forward": jump,
        "ratio": constrained["tokens_per_s"] / unconstrained["tokens_per_s"],
        "valid": valid,
    }
    write_report(args.out, report, markdown(report), name="grammar_overhead")
    return report


if __name__ == "__main__":
    main()
