"""The real model on one GPU, against Hugging Face on the same GPU: greedy tokens (fp32, eager and CUDA
graphs), a mixed-adapter batch against HF + PEFT, and a JSON-schema request parsed and validated.

    python scripts/gpu/real_checks.py --model-dir DIR --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

DEVICE = os.environ.get("REAL_CHECKS_DEVICE", "cuda")
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List three primary colors:",
    "Explain what a CUDA graph is in one sentence.",
    "1, 2, 3, 4,",
]


def engine_greedy(model_dir: Path, ids: list[list[int]], new_tokens: int, graphs: bool, adapters=None):
    from motet.engine.llm import LLM
    from motet.engine.sampling_params import SamplingParams

    llm = LLM(str(model_dir), device=DEVICE, num_kv_blocks=512, max_lora_rank=16, compile_step=graphs)
    refs = {n: llm.engine.add_lora(n, p) for n, p in (adapters or {}).items()}
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    names = list(refs) + [None]
    order = {}
    for i, p in enumerate(ids):
        name = names[i % len(names)] if adapters else None
        order[engine.add_request(p, params, adapter=refs[name] if name else None)] = (i, name)
    out = [None] * len(ids)
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[order[o.request_id][0]] = o.token_ids
    return out, [order[k][1] for k in sorted(order, key=lambda k: order[k][0])], llm


def save(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_checks.json").write_text(json.dumps(report, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from motet.evals.lora_reference import peft_model, write_random_adapter

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tok = AutoTokenizer.from_pretrained(args.model_dir)

    def chat(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return tok.encode(
            tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )

    ids = [chat(p) for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).to(DEVICE).eval()
    n = args.new_tokens

    def hf_greedy(model, prompt):
        x = torch.tensor([prompt], device=DEVICE)
        with torch.no_grad():
            y = model.generate(
                x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id
            )
        return y[0, len(prompt) :].tolist()

    report = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "new_tokens": n,
        "prompts": len(ids),
    }
    ref = [hf_greedy(hf, p) for p in ids]
    for graphs in (False, True):
        got, _, _ = engine_greedy(args.model_dir, ids, n, graphs)
        key = "greedy_fp32_vs_hf_cuda_" + ("graphs" if graphs else "eager")
        report[key] = sum(g == r for g, r in zip(got, ref, strict=True))
        print(key, report[key], "/", len(ids), flush=True)
        save(args.out, report)
    report["sample_output"] = tok.decode(ref[0])

    # Mixed adapters: two random rank-8/16 adapters and the base model in one batch, vs HF + PEFT on CUDA.
    tmp = Path(tempfile.mkdtemp())
    from motet.models.config import ModelConfig

    base = ModelConfig.from_dir(args.model_dir)
    adapters = {f"a{r}": write_random_adapter(tmp / f"a{r}", base, r, seed=r) for r in (8, 16)}
    peft = peft_model(hf, adapters).to(DEVICE).eval()
    for graphs in (False, True):
        got, names, _ = engine_greedy(args.model_dir, ids, n, graphs, adapters)
        same = 0
        for prompt, g, name in zip(ids, got, names, strict=True):
            if name is None:
                with peft.disable_adapter():
                    r = hf_greedy(peft, prompt)
            else:
                peft.set_adapter(name)
                r = hf_greedy(peft, prompt)
            same += g == r
        key = "mixed_adapters_vs_peft_cuda_" + ("graphs" if graphs else "eager")
        report[key] = same
        print(key, same, "/", len(ids), flush=True)
        save(args.out, report)

    # A JSON-schema request: the output parses and validates.
    import jsonschema

    from motet.engine.llm import LLM
    from motet.engine.sampling_params import SamplingParams

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    }  # fmt: skip
    llm = LLM(str(args.model_dir), device=DEVICE, num_kv_blocks=512)
    prompt = chat("Describe a person as JSON with name, age and tags.")
    from motet.grammar.specs import JsonSchemaSpec

    sp = SamplingParams(temperature=0, max_tokens=200, grammar=JsonSchemaSpec(json.dumps(schema)))
    (out,) = llm.generate([prompt], sp)
    try:
        jsonschema.validate(json.loads(out.text), schema)
        report["json_schema_valid"] = True
    except Exception as e:  # noqa: BLE001
        report["json_schema_valid"] = f"{type(e).__name__}: {e}"
    report["json_schema_output"] = out.text
    print("json", report["json_schema_valid"], out.text, flush=True)
    save(args.out, report)


if __name__ == "__main__":
    main()
