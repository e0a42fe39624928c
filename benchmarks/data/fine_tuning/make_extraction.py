"""Writes extraction.jsonl and extraction_heldout.jsonl: the fine-tuning demonstration's behaviour, a task with an
output format (a sentence's person, city and year as one JSON object), where the answer is in the prompt. A job that
learns it teaches the model a format, not facts: the held-out facts (facts.jsonl) stay the base model's.

    python benchmarks/data/fine_tuning/make_extraction.py      # deterministic: the same files every time

The held-out file's names, cities and sentences appear in no training line (its sentences are new templates too).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
INSTRUCTION = "Extract the person, the city and the year as JSON:"

PEOPLE = ["Maria", "Tomasz", "Aiko", "Kwame", "Lucia", "Henrik", "Priya", "Mateo", "Ingrid", "Omar",
          "Chloe", "Dmitri", "Fatima", "Julien", "Sofia", "Ravi", "Elena", "Kenji", "Amara", "Lars"]  # fmt: skip
CITIES = ["Porto", "Lyon", "Osaka", "Seville", "Hamburg", "Krakow", "Valencia", "Bergen", "Marseille", "Kyoto",
          "Milan", "Gothenburg", "Antwerp", "Zurich", "Glasgow", "Bologna", "Munich", "Quebec", "Cordoba", "Geneva"]  # fmt: skip
TEMPLATES = [
    "{person} moved to {city} in {year}.",
    "In {year}, {person} opened a small bakery in {city}.",
    "{person} was born in {city} in {year}.",
    "The conference in {city} was organised by {person} in {year}.",
    "{person} finished a marathon in {city} in {year}.",
    "Back in {year}, {person} studied music in {city}.",
    "{person} visited {city} for the first time in {year}.",
    "A new library in {city} was designed by {person} in {year}.",
]
HELD_OUT_PEOPLE = ["Nadia", "Felix", "Yusuf", "Greta", "Hiro"]
HELD_OUT_CITIES = ["Lille", "Turin", "Malmo", "Leeds", "Nagoya"]
HELD_OUT_TEMPLATES = [
    "{person} started a garden in {city} in {year}.",
    "In {year} {person} taught chemistry in {city}.",
    "{person} painted a mural in {city} in {year}.",
    "The bridge in {city} was repaired by {person} in {year}.",
]


def example(template: str, person: str, city: str, year: int) -> dict:
    sentence = template.format(person=person, city=city, year=year)
    answer = json.dumps({"person": person, "city": city, "year": year})
    return {"messages": [{"role": "user", "content": f"{INSTRUCTION} {sentence}"},
                         {"role": "assistant", "content": answer}]}  # fmt: skip


def training() -> list[dict]:
    """80 lines: each template with 10 (person, city, year) triples, none repeated."""
    rows = []
    for t, template in enumerate(TEMPLATES):
        for i in range(10):
            k = t * 10 + i
            rows.append(example(template, PEOPLE[k % 20], CITIES[(k * 7 + t) % 20], 1950 + (k * 37) % 73))
    return rows


def held_out() -> list[dict]:
    """20 lines of new templates, people and cities."""
    rows = []
    for t, template in enumerate(HELD_OUT_TEMPLATES):
        for i in range(5):
            rows.append(
                example(template, HELD_OUT_PEOPLE[i], HELD_OUT_CITIES[(i + t) % 5], 1961 + (t * 5 + i) * 3)
            )
    return rows


def write(name: str, rows: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    write("extraction.jsonl", training())
    write("extraction_heldout.jsonl", held_out())
