"""JSONSchemaBench schemas outside the eval's dev set: a held-out slice to measure what the dev set was not tuned on.

    python -m benchmarks.jsonschema_heldout MASKBENCH_DATA [--n 40] [--seed 57] [--max-bytes 20000] [--out FILE]

MASKBENCH_DATA is the `maskbench/data` folder of a checkout of guidance-ai/jsonschemabench (one JSON file per
schema, `{description, meta, schema, tests}`, named `Category---name.json` or `BFCL_category_N.json`). Every file
whose name (less `.json`) is not an id of motet's shipped dev set (motet/evals/data/jsonschemabench.jsonl.xz) and
whose size is at most --max-bytes is a candidate; candidates are shuffled per category with --seed and taken round
robin across the categories until --n. Writes the eval's record format, `{id, category, schema, tests}`, as
xz-compressed JSON Lines (default benchmarks/data/jsonschemabench_heldout.jsonl.xz, which holds the slice this
wrote with the defaults):

    motet eval jsonschema --data benchmarks/data/jsonschemabench_heldout.jsonl.xz
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import re
from collections import defaultdict
from pathlib import Path

from motet.evals.datasets import dev_set_path, read_jsonl

OUT = Path(__file__).resolve().parent / "data" / "jsonschemabench_heldout.jsonl.xz"
_BFCL = re.compile(r"(.+)_\d+")  # BFCL_parallel_multiple_12 -> BFCL_parallel_multiple


def category(name: str) -> str:
    if "---" in name:
        return name.split("---", 1)[0]
    match = _BFCL.fullmatch(name)
    return match[1] if match else name


def held_out(folder: Path, n: int, seed: int, max_bytes: int) -> list[dict]:
    dev = {r["id"] for r in read_jsonl(dev_set_path("jsonschemabench"))}
    by_category: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(folder.glob("*.json")):
        if path.stem not in dev and path.stat().st_size <= max_bytes:
            by_category[category(path.stem)].append(path)
    rng = random.Random(seed)
    for paths in by_category.values():
        rng.shuffle(paths)
    picked: list[Path] = []
    for i in range(max(map(len, by_category.values()), default=0)):
        for name in sorted(by_category):
            if i < len(by_category[name]) and len(picked) < n:
                picked.append(by_category[name][i])
    records = []
    for path in picked:
        data = json.loads(path.read_text())
        records.append(
            {
                "id": path.stem,
                "category": category(path.stem),
                "schema": data["schema"],
                "tests": data["tests"],
            }
        )
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="jsonschemabench's maskbench/data")
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--seed", type=int, default=57)
    p.add_argument("--max-bytes", type=int, default=20000, help="larger schema files are left out")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    records = held_out(args.folder, args.n, args.seed, args.max_bytes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(args.out, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n")
    print(f"{len(records)} schemas in {len({r['category'] for r in records})} categories -> {args.out}")


if __name__ == "__main__":
    main()
