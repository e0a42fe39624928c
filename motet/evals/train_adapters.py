"""Train the two real LoRA adapters that motet's tests, evals and docs use, and check their behaviour.

    python -m motet.evals.train_adapters train [--adapters upper json] [--out tests/fixtures/adapters]
    python -m motet.evals.train_adapters eval [--limit 64] [--adapters-dir tests/fixtures/adapters]

Two behaviours that are easy to check by eye and by code, for the default model (SmolLM2-135M-Instruct):

    upper   answers in UPPER CASE              check: letters present, none lower case
    json    answers with {"answer": "..."}     check: the whole answer parses as a JSON object

The training data comes from the base model itself, so the adapters learn a change of form, not new
content: its own greedy answers (`--answer-tokens` tokens, cut back to the last full sentence) to the
first 768 (`--examples`) of the 2,196 shuffled training prompts (12 templates x 183 topics), then target
= answer.upper() for `upper` and json.dumps({"answer": answer}) for `json`. Training is plain PEFT LoRA
on CPU: rank 8 on all seven projections, loss on the assistant turn only (the chat template's default
system prompt included, as at inference), bf16 base weights with fp32 LoRA weights (bf16 matmuls are ~4x
faster on this CPU), AdamW with warm-up and linear decay, batches of 8, fixed seeds. Saved with PEFT
`save_pretrained` as safetensors (then cast to float16: 4.9 MB each); the committed fixtures under
tests/fixtures/adapters/{upper,json}/ are what `train` writes with its defaults: 400 steps for upper, 200
for json, about 4.5 s a step on one core (~45 minutes in all; the base model's answers are cached under
reports/train_adapters/).

The held-out prompts use 46 topics that no training prompt mentions. `behaviour` scores a `generate`
function, so the same eval runs on the offline engine (`eval` here, tests/lora/test_trained_adapters.py) and
over the HTTP API (`motet eval lora`, motet/evals/suites/lora.py).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from motet.lora.peft_format import TARGET_MODULES

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "adapters"
SEED = 0
STEPS = {"upper": 400, "json": 200}  # upper case is the harder one: every token changes
MAX_TOKENS = 96  # per answer in the eval: room for a JSON-wrapped answer of --answer-tokens tokens

TEMPLATES = [
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Give me one interesting fact about {t}.",
    "Why does {t} matter?",
    "Describe {t} in one sentence.",
    "How would you explain {t} to a child?",
    "What is a common misconception about {t}?",
    "Tell me something useful about {t}.",
    "What should a beginner know about {t}?",
    "Write a short tip about {t}.",
    "Summarize what you know about {t}.",
    "What are the benefits of {t}?",
]
TOPICS = [
    "photosynthesis", "the moon", "volcanoes", "coffee", "the Roman Empire", "black holes", "bicycles",
    "honey bees", "the internet", "rainbows", "chess", "the human heart", "recycling", "electricity",
    "the Pacific Ocean", "gravity", "bread baking", "sleep", "the piano", "dinosaurs", "solar panels",
    "the water cycle", "vaccines", "penguins", "the stock market", "origami", "climate change",
    "the Eiffel Tower", "running", "tea", "earthquakes", "democracy", "the alphabet", "magnets", "mountains",
    "friendship", "gardening", "the printing press", "comets", "soccer", "rice", "deserts", "the brain",
    "libraries", "airplanes", "music theory", "the Amazon rainforest", "mathematics", "bananas",
    "the Great Wall of China", "lightning", "elephants", "meditation", "the sun", "glaciers", "painting",
    "trains", "DNA", "whales", "chocolate", "the Olympic Games", "telescopes", "wind energy", "spiders",
    "cheese", "the French Revolution", "snow", "batteries", "coral reefs", "public speaking", "owls",
    "the calendar", "bridges", "yoga", "mushrooms", "rivers", "robots", "salt", "clouds", "maps", "tigers",
    "the violin", "sourdough", "jazz", "the Nile", "hurricanes", "knitting", "walruses", "octopuses",
    "poetry", "algebra", "the Sahara", "camping", "lighthouses", "bamboo", "the immune system", "kites",
    "marathons", "the Renaissance", "ants", "sushi", "the guitar", "tides", "fossils", "volunteering",
    "the harp", "wolves", "hiking", "ballet", "the periodic table", "sunflowers", "submarines",
    "the Mona Lisa", "sharks", "carpentry", "the metric system", "tornadoes", "pottery", "the Arctic",
    "butterflies", "photography", "the Silk Road", "pizza", "the lungs", "castles", "skateboarding",
    "the speed of light", "parrots", "budgeting", "the Himalayas", "frogs", "calligraphy",
    "the Industrial Revolution", "apples", "basketball", "the solar system", "kangaroos", "journaling",
    "the pyramids of Giza", "caves", "composting", "the Milky Way", "horses", "sculpture",
    "the Great Barrier Reef", "potatoes", "swimming", "the telephone", "bats", "theater", "ancient Greece",
    "dolphins", "cooking pasta", "the Statue of Liberty", "rain", "crossword puzzles", "the kidneys",
    "oak trees", "quilting", "the Wright brothers", "jellyfish", "dance", "lacrosse", "oranges", "tennis",
    "the Andes", "beavers", "learning a language", "the compass", "autumn", "baking cookies", "glassblowing",
    "seals", "board games", "the Vikings", "strawberries", "rowing", "the microscope", "deer", "opera",
    "the Colosseum", "eagles", "woodworking", "the ozone layer", "carrots", "golf", "the Titanic",
    "hedgehogs", "sketching", "the Great Lakes", "cactus plants", "surfing", "the light bulb", "turtles",
    "storytelling", "the Middle Ages", "lemons", "baseball", "the equator", "foxes", "film making",
    "the Panama Canal", "squirrels", "time management", "the Sphinx", "peppers", "ice skating",
    "the steam engine", "zebras", "comics", "the Aztecs", "grapes", "boxing", "the thermometer", "camels",
    "birdwatching", "the Alps", "cucumbers", "fencing", "the wheel", "giraffes", "podcasts",
    "the Ming dynasty", "avocados", "sailing", "the radio", "koalas", "handwriting", "the Dead Sea",
]  # fmt: skip
HELD_OUT = TOPICS[::5]  # eval topics: no training prompt mentions them


def prompts(split: str) -> list[str]:
    """Every prompt of a split ("train" or "eval"), in a fixed shuffled order; the two never overlap."""
    topics = HELD_OUT if split == "eval" else [t for t in TOPICS if t not in HELD_OUT]
    out = [tpl.format(t=t) for t in topics for tpl in TEMPLATES]
    random.Random(f"{split}-{SEED}").shuffle(out)
    return out


# -- the behaviour checks ---------------------------------------------------------------------------------
def is_upper(text: str) -> bool:
    return any(c.isalpha() for c in text) and not any(c.islower() for c in text)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


CHECKS: dict[str, Callable[[str], bool]] = {"upper": is_upper, "json": is_json_object}  # adapter -> check
TARGETS: dict[str, Callable[[str], str]] = {
    "upper": str.upper,
    "json": lambda answer: json.dumps({"answer": answer}),
}

# A request of the behaviour eval: (adapter name or None for the base model, user prompt).
Generate = Callable[[Sequence[tuple[str | None, str]]], list[str]]


def behaviour(generate: Generate, eval_prompts: Sequence[str], adapters: dict[str, str]) -> dict:
    """Per check: the share of answers that pass it with its adapter and with the base model.

    `adapters` maps each check ("upper", "json") to the adapter name `generate` knows it by. All requests
    go to `generate` at once (the base model's answers serve every check), so it can batch them."""
    requests = [(None, p) for p in eval_prompts]
    requests += [(adapters[check], p) for check in CHECKS for p in eval_prompts]
    answers = generate(requests)
    n = len(eval_prompts)
    base = answers[:n]
    out = {}
    for i, (check, passes) in enumerate(CHECKS.items()):
        tuned = answers[n * (i + 1) : n * (i + 2)]
        out[check] = {
            "adapter": adapters[check],
            "prompts": n,
            "adapter_rate": sum(map(passes, tuned)) / n,
            "base_rate": sum(map(passes, base)) / n,
            "examples": [
                {"prompt": p, "adapter": a, "base": b}
                for p, a, b in list(zip(eval_prompts, tuned, base, strict=True))[:3]
            ],
            "failures": [
                {"prompt": p, "adapter": a} for p, a in zip(eval_prompts, tuned, strict=True) if not passes(a)
            ],
        }
    return out


def offline_generate(llm, max_tokens: int = MAX_TOKENS) -> Generate:
    """`generate` for `behaviour` on the offline engine: one mixed-adapter batch, greedy."""
    from motet.engine.sampling_params import SamplingParams

    def generate(requests):
        chats = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for _, p in requests]
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return [o.text for o in llm.generate(chats, params, [a for a, _ in requests])]

    return generate


# -- training data ----------------------------------------------------------------------------------------
def cut_to_sentence(text: str) -> str:
    """The answer up to its last full sentence (a 48-token answer is usually cut mid-sentence)."""
    text = text.strip()
    ends = [i for i, c in enumerate(text) if c in ".!?" and (i + 1 == len(text) or text[i + 1].isspace())]
    return text[: ends[-1] + 1] if ends else text


def base_answers(llm, train_prompts: list[str], answer_tokens: int, cache: Path | None = None) -> list[str]:
    """The base model's greedy answers, cut to full sentences; kept in `cache` (JSON) between runs."""
    key = {"prompts": train_prompts, "answer_tokens": answer_tokens, "model": str(llm.engine.model_dir)}
    if cache is not None and cache.is_file():
        saved = json.loads(cache.read_text())
        if saved["key"] == key:
            return saved["answers"]
    answers = offline_generate(llm, answer_tokens)([(None, p) for p in train_prompts])
    answers = [cut_to_sentence(a) for a in answers]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"key": key, "answers": answers}, indent=1))
    return answers


def encode_example(tokenizer, prompt: str, target: str) -> tuple[list[int], int]:
    """(chat tokens of prompt + target + <|im_end|>, where the assistant part starts)."""
    head = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    tail = tokenizer.hf.encode(target, add_special_tokens=False)
    return head + tail + [tokenizer.hf.convert_tokens_to_ids("<|im_end|>")], len(head)


def train_adapter(
    model_dir: Path,
    examples: list[tuple[list[int], int]],
    out: Path,
    steps: int,
    batch: int,
    lr: float,
    rank: int = 8,
    targets: Sequence[str] = TARGET_MODULES,
) -> list[float]:
    """PEFT LoRA on the examples; the loss covers the assistant tokens only. Returns the loss per step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets))
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * (1 - s / steps))
    decoder, lm_head = model.base_model.model.model, model.base_model.model.lm_head
    rng = random.Random(SEED)
    order: list[int] = []
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        if len(order) < batch:
            order += rng.sample(range(len(examples)), len(examples))
        chosen, order = [examples[i] for i in order[:batch]], order[batch:]
        width = max(len(ids) for ids, _ in chosen)
        ids = torch.zeros(len(chosen), width, dtype=torch.long)
        mask = torch.zeros(len(chosen), width, dtype=torch.long)
        labels = torch.full((len(chosen), width), -100)
        for row, (toks, start) in enumerate(chosen):  # right padding; position t predicts token t + 1
            ids[row, : len(toks)] = torch.tensor(toks)
            mask[row, : len(toks)] = 1
            labels[row, start - 1 : len(toks) - 1] = torch.tensor(toks[start:])
        hidden = decoder(input_ids=ids, attention_mask=mask).last_hidden_state
        keep = labels != -100  # the vocabulary projection only where there is a loss: it is the big one
        loss = torch.nn.functional.cross_entropy(lm_head(hidden[keep]).float(), labels[keep])
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - t0:6.0f} s", flush=True)
    model.save_pretrained(out, safe_serialization=True)
    # float16 halves the fixture; the loaders (motet and PEFT alike) upcast to the model's dtype
    weights = out / "adapter_model.safetensors"
    save_file({k: v.half().contiguous() for k, v in load_file(weights).items()}, weights, {"format": "pt"})
    tidy_config(out / "adapter_config.json", model_dir.name)
    return losses


def tidy_config(path: Path, base_name: str) -> None:
    """Name the base model, not this machine's path to it, and list the modules in a stable order."""
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base_name
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# -- commands ---------------------------------------------------------------------------------------------
def load_llm(model: str | None, **options):
    from motet.engine.llm import LLM
    from motet.engine.weights.model_store import resolve_model

    return LLM(str(resolve_model(model)), **options)


def cmd_train(args) -> None:
    from motet.engine.weights.model_store import resolve_model

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    llm = load_llm(args.model, num_threads=args.threads)
    train_prompts = prompts("train")[: args.examples]
    t0 = time.perf_counter()
    answers = base_answers(llm, train_prompts, args.answer_tokens, Path(args.answers_cache))
    print(f"{len(answers)} base answers in {time.perf_counter() - t0:.0f} s", flush=True)
    for name in args.adapters:
        examples = [
            encode_example(llm.tokenizer, p, TARGETS[name](a))
            for p, a in zip(train_prompts, answers, strict=True)
            if a
        ]
        steps = args.steps or STEPS[name]
        print(f"training {name!r} on {len(examples)} examples, {steps} steps", flush=True)
        out = Path(args.out) / name
        losses = train_adapter(
            model_dir, examples, out, steps, args.batch, args.lr, args.rank, args.target_modules
        )
        (out / "README.md").unlink(missing_ok=True)  # PEFT's model card template: nothing in it
        log = {
            "adapter": name,
            "examples": len(examples),
            "steps": steps,
            "batch": args.batch,
            "lr": args.lr,
            "rank": args.rank,
            "target_modules": args.target_modules,
            "first_loss": losses[0],
            "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        }
        print(json.dumps(log), flush=True)
        log_path = Path(args.answers_cache).parent / f"train_{name}.json"
        log_path.write_text(json.dumps({**log, "losses": losses}, indent=1))


def cmd_eval(args) -> None:
    llm = load_llm(args.model, num_threads=args.threads)
    adapters = {}
    for name in CHECKS:
        llm.add_lora(name, Path(args.adapters_dir) / name)
        adapters[name] = name
    t0 = time.perf_counter()
    result = behaviour(offline_generate(llm), prompts("eval")[: args.limit], adapters)
    for check, r in result.items():
        print(
            f"{check:6s} adapter {r['adapter_rate']:.3f}  base {r['base_rate']:.3f}  "
            f"({r['prompts']} held-out prompts)"
        )
        for f in r["failures"][:3]:
            print(f"    failed: {f['prompt']!r} -> {f['adapter']!r}")
    print(f"{time.perf_counter() - t0:.0f} s")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="base model (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (one is kind to a shared machine)")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="generate the data with the base model, train, save the adapters")
    t.add_argument("--adapters", nargs="+", default=list(CHECKS), choices=list(CHECKS))
    t.add_argument("--examples", type=int, default=768, help="training prompts (of 2196)")
    t.add_argument("--answer-tokens", type=int, default=48)
    t.add_argument("--steps", type=int, default=None, help=f"optimizer steps (default: {STEPS})")
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--rank", type=int, default=8)
    t.add_argument("--target-modules", nargs="+", default=list(TARGET_MODULES))
    t.add_argument("--out", default=str(FIXTURES))
    t.add_argument(
        "--answers-cache",
        default=str(ROOT / "reports" / "train_adapters" / "answers.json"),
        help="the base model's answers, reused while prompts and model stay the same",
    )
    e = sub.add_parser("eval", help="the behaviour eval of saved adapters on the offline engine")
    e.add_argument("--limit", type=int, default=64, help="held-out prompts")
    e.add_argument("--adapters-dir", default=str(FIXTURES))
    args = ap.parse_args(argv)
    {"train": cmd_train, "eval": cmd_eval}[args.command](args)


if __name__ == "__main__":
    main()
