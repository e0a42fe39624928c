"""A tenant's name in the --api-keys file is one its adapters' store can hold (motet/lora/registry.py's rule, the
one a tenant's uploads and fine-tuned models are stored under), or `motet serve` refuses the file at start-up in one
line naming the tenant and the rule (issue 68, finding 9: "team a", "a:b" and a 70-character name were accepted,
and their fine-tuning jobs trained to the end and failed storing their model)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from motet.api.auth import Authenticator
from motet.lora.adapter import AdapterError
from motet.lora.names import check_name
from tests.live_server import ROOT

UNSTORABLE = ["team a", "a:b", "x" * 70, ".hidden", "a/b"]
STORABLE = ["team-a", "a.b_c", "x" * 64, "default"]


def write_keys(tmp_path, keys: dict) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(keys))
    return str(path)


@pytest.mark.parametrize("name", UNSTORABLE)
@pytest.mark.parametrize("form", ["name", "object"])
def test_a_tenant_the_adapter_store_cannot_hold_is_refused_with_its_name_and_the_rule(tmp_path, name, form):
    with pytest.raises(AdapterError):  # the adapters' store's own rule refuses it
        check_name("tenant", name)
    value = name if form == "name" else {"tenant": name, "limits": {"requests_per_minute": 10}}
    with pytest.raises(ValueError) as e:
        Authenticator.from_file(write_keys(tmp_path, {"sk-ok": "alice", "sk-bad": value}))
    assert "--api-keys" in str(e.value) and repr(name)[:40] in str(e.value), e.value
    assert "1-64 letters, digits, '.', '_' or '-'" in str(e.value), e.value


@pytest.mark.parametrize("name", STORABLE)
def test_every_tenant_the_keys_file_accepts_is_one_the_adapter_store_holds(tmp_path, name):
    auth = Authenticator.from_file(
        write_keys(tmp_path, {"sk-1": name, "sk-2": {"tenant": name, "admin": True}})
    )
    for principal in auth.keys.values():
        assert check_name("tenant", principal.tenant) == name


def test_motet_serve_refuses_the_keys_file_in_one_line(tiny_model_dir, tmp_path):
    keys = write_keys(tmp_path, {"sk-a": "alice", "sk-b": "team a"})
    cmd = [sys.executable, "-m", "motet.api.cli", "serve", "--model", str(tiny_model_dir), "--port", "0",
           "--api-keys", keys, "--data-dir", str(tmp_path / "data")]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("motet: error: --api-keys"), done.stderr
    assert "'team a'" in lines[0] and "1-64 letters" in lines[0], done.stderr
