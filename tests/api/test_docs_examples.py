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
