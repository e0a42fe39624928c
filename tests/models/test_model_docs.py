"""The README's model table and docs/models.md's family table in step with the code: every architecture the
registry declares (motet/models/) is a row of both tables, neither names one it lacks, every test file either page
cites exists, and each ✓ of the README's table is backed by a test file its column names that builds a tiny
checkpoint of that row's families, itself or through the test modules it imports (by their tests/tiny_models.py
name, whose transformers config says which architecture it is). A coarse check (a file, not a test function), but a family or a column can no longer be
claimed, or dropped, without a file that tests it."""

from __future__ import annotations

import re
from pathlib import Path

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from motet.models import SUPPORTED_ARCHITECTURES
from tests.tiny_models import CONFIGS

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MODELS_PAGE = (ROOT / "docs" / "models.md").read_text()
ARCHITECTURE = re.compile(r"`(\w+ForCausalLM)`")
TEST_FILE = re.compile(r"`?(tests/[\w/]+\.py)`?")


def table(text: str, header: str) -> tuple[list[str], list[list[str]]]:
    """The markdown table whose header row starts with `header`: its column names and its rows' cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    columns = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return columns, rows


def tiny_names(architecture: str) -> set[str]:
    """The tests/tiny_models.py names whose checkpoints are of `architecture` (transformers' mapping of the
    config's model_type)."""
    return {
        name
        for name, config in CONFIGS.items()
        if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type) == architecture
    }


def test_every_declared_architecture_is_one_row_of_each_table():
    for text, header in ((README, "| family"), (MODELS_PAGE, "| family")):
        _, rows = table(text, header)
        named = [a for row in rows for a in ARCHITECTURE.findall(row[0])]
        assert sorted(named) == sorted(SUPPORTED_ARCHITECTURES), header


def test_every_cited_test_file_exists():
    cited = set(TEST_FILE.findall(README)) | set(TEST_FILE.findall(MODELS_PAGE))
    assert cited, "the pages cite no test file"
    assert sorted(p for p in cited if not (ROOT / p).is_file()) == []


def legend() -> dict[str, list[str]]:
    """The README's list under its model table: each column's test files."""
    files: dict[str, list[str]] = {}
    for line in README.split("Each ✓ is a test", 1)[1].split("\n\n", 2)[1].split("\n- "):
        paths = TEST_FILE.findall(line)
        for column in re.findall(r"\*\*(.+?)\*\*", line):
            files[column] = paths
    return files


def with_fixtures(path: str) -> str:
    """A test file's text and that of the test modules it imports (where its checkpoints' tables live:
    test_quantized_families.py builds test_model_declarations.py's FAMILIES)."""
    text = (ROOT / path).read_text()
    imported = re.findall(r"^from (tests\.[\w.]+) import", text, re.M)
    return "\n".join([text, *((ROOT / f"{m.replace('.', '/')}.py").read_text() for m in imported)])


def test_each_check_mark_is_backed_by_a_test_file_of_its_column():
    columns, rows = table(README, "| family")
    files = legend()
    assert sorted(files) == sorted(columns[1:])
    sources = {p: with_fixtures(p) for paths in files.values() for p in paths}
    unbacked = []
    for row in rows:
        for column, cell in zip(columns[1:], row[1:], strict=True):
            if not cell.startswith("✓"):
                continue
            for architecture in ARCHITECTURE.findall(row[0]):
                names = tiny_names(architecture)
                assert names, f"no tiny checkpoint of {architecture} in tests/tiny_models.py"
                if not any(f'"{n}"' in sources[p] for p in files[column] for n in names):
                    unbacked.append(f"{architecture}: {column}")
    assert unbacked == []
