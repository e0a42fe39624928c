"""The manual's examples mean what they say: the tenants page's `--api-keys` file is one `motet serve` loads; the
Python page's example prints what the page shows."""

from __future__ import annotations

import json
import re

import pytest

from motet.api.auth import Authenticator
from tests.live_server import ROOT


def test_the_tenants_pages_keys_file_loads_as_it_says():
    page = (ROOT / "docs" / "tenants.md").read_text()
    keys = json.loads(re.search(r"```json\n(.*?)```", page, re.DOTALL)[1])
    auth = Authenticator(keys, where="docs/tenants.md")
    tenants = {key: p.tenant for key, p in auth.keys.items()}
    assert tenants == {"sk-alice-1": "team-a", "sk-bob-1": "team-b", "sk-evals": "evals", "sk-ops": None}
    assert auth.keys["sk-ops"].admin and auth.keys["sk-evals"].background
    assert auth.keys["sk-bob-1"].limits is not None
    assert "--api-keys keys.json" in page and "/v1/usage" in page


def test_the_llm_reference_shows_its_example_as_code_and_every_method():
    """docs/reference/llm.md renders motet.engine.llm's docstrings (mkdocstrings, Markdown): the example must be a
    fenced block (it ran into one paragraph), and a method without a docstring is left out (`chat` was)."""
    import inspect

    from motet.engine import llm

    assert re.search(r"```python\n.*llm\.chat\(.*\n```", llm.__doc__, re.DOTALL)
    public = [n for n, f in inspect.getmembers(llm.LLM, inspect.isfunction) if not n.startswith("_")]
    assert "chat" in public and all(getattr(llm.LLM, n).__doc__ for n in public), public


@pytest.mark.slow
def test_the_python_pages_example_prints_what_the_page_says(capsys, monkeypatch):
    """Issue 57: docs/python.md's adapter example sent a bare question to `llm.generate`, which answered '' (the
    default model's likeliest token after it is its end of turn; HF transformers' too). Its example runs as written,
    from the repository's root, and prints the output the page shows, every line of it text."""
    page = (ROOT / "docs" / "python.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.DOTALL)[1]
    shown = re.search(r"```text\n(.*?)```", page, re.DOTALL)[1]
    monkeypatch.chdir(ROOT)
    exec(compile(code, "docs/python.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed == shown and all(line.strip() for line in printed.splitlines())


def test_the_fine_tuning_pages_round_trip_runs_as_written(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Issue 68, finding 16: docs/fine-tuning.md's round trip never waited for its job, so the model it called was
    None (a 400). It runs as written against a served tiny model named as the page's (`SmolLM2-135M-Instruct`), its
    key the tenants page's `sk-alice-1` (team-a), a `train.jsonl` of the page's own training example; only the
    address differs (a free port for the page's 8000)."""
    import openai

    from tests.live_server import keys_file, tiny_server

    page = (ROOT / "docs" / "fine-tuning.md").read_text()
    code = re.search(r"## The round trip\n\n```python\n(.*?)```", page, re.DOTALL)[1]
    example = json.loads(re.search(r"## Training data\n.*?```json\n(.*?)```", page, re.DOTALL)[1])
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(example) for _ in range(4)))
    keys_file(tmp_path, {"sk-alice-1": "team-a"})
    srv = tiny_server(tiny_model_dir, tmp_path, name="SmolLM2-135M-Instruct")

    class Served(openai.OpenAI):  # the page's client, at this server's address
        def __init__(self, *, base_url: str, **kwargs):
            assert base_url == "http://127.0.0.1:8000/v1"
            super().__init__(base_url=f"{srv.url}/v1", **kwargs)

    monkeypatch.setattr(openai, "OpenAI", Served)
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    try:
        exec(compile(code, "docs/fine-tuning.md", "exec"), names)
    finally:
        srv.stop()
    job, answer = names["job"], names["answer"]
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model.startswith("ft:SmolLM2-135M-Instruct:team-a:extract:")
    assert answer.model == job.fine_tuned_model and answer.choices[0].message.role == "assistant"
    assert "The job has successfully completed" in capsys.readouterr().out


def test_readme_and_the_manuals_index_list_every_page():
    """Issue 68, finding 16: docs/cpu.md (in the site's navigation) was in neither page table. Every page of the
    manual but the index and the API reference's (reached from the Python page) is a row of README's table and of
    docs/index.md's."""
    pages = sorted(
        str(p.relative_to(ROOT / "docs"))
        for p in (ROOT / "docs").rglob("*.md")
        if p.parent.name != "reference" and p.name != "index.md" or p.parent.name == "api"
    )
    assert "cpu.md" in pages and "api/index.md" in pages

    def rows(path: str, prefix: str) -> set[str]:
        """The pages a table's first column links to."""
        lines = (ROOT / path).read_text().splitlines()
        cells = [line.split("|")[1] for line in lines if line.startswith("| ")]
        return {link.removeprefix(prefix) for cell in cells for link in re.findall(r"\]\(([^)]+)\)", cell)}

    assert [p for p in pages if p not in rows("README.md", "docs/")] == []
    assert [p for p in pages if p not in rows("docs/index.md", "")] == []


def test_the_batches_pages_example_file_is_a_batch_every_line_of_which_is_answered(tiny_model_dir, tmp_path):
    """Issue 68, finding 16: docs/api/batches.md uploaded a `requests.jsonl` it never showed. Its example runs as
    the page's batch would: `motet run-batch` (the server's routes and validation, offline) on a tiny model served
    under the page's model name answers every line 200, each body a chat completion as the openai SDK parses it."""
    import os
    import subprocess
    import sys

    from openai.types.chat import ChatCompletion

    page = (ROOT / "docs" / "api" / "batches.md").read_text()
    example = re.search(r"`requests\.jsonl` holds .*?```json\n(.*?)```", page, re.DOTALL)[1]
    lines = [json.loads(line) for line in example.splitlines()]
    assert len(lines) >= 2 and all(line["url"] == "/v1/chat/completions" for line in lines)
    (tmp_path / "requests.jsonl").write_text(example)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "motet.api.cli", "run-batch", "-i", str(tmp_path / "requests.jsonl"), "-o",
           str(out), "--model", str(tiny_model_dir), "--served-model-name", "SmolLM2-135M-Instruct",
           "--threads", "1", "--max-model-len", "1024"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["custom_id"] for a in answers] == [line["custom_id"] for line in lines]
    for a in answers:
        assert a["error"] is None and a["response"]["status_code"] == 200, a
        ChatCompletion.model_validate(a["response"]["body"])
