"""vLLM's `POST /v1/load_lora_adapter` reads only what the operator allowed (issue 31, findings 2 and 5): files
linked out of `--lora-load-dir` are refused, a link swapped in after the path was resolved is not followed,
a data directory that overlaps a load directory is refused at start-up, and every malformed path is a 400
naming `lora_path`, never a 500.

In-process (Starlette TestClient) on a tiny random model, with real files, symlinks and a FIFO on disk; the
start-up refusal also through a real `motet serve` subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import motet.lora.registry as registry
from motet.actors.system import ServingSystem
from motet.api.adapters.store import AdapterStore
from motet.api.auth import Authenticator
from motet.api.state import ServerState
from motet.engine.config import EngineConfig
from motet.engine.llm_engine import LLMEngine
from motet.lora.registry import AdapterPathError, read_server_adapter
from tests.live_server import ROOT
from tests.peft_adapters import make_adapter
from tests.served_app import served_app

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ALICE, BOB = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}


@pytest.fixture(scope="module")
def tree(tiny_model_dir, tmp_path_factory) -> Path:
    """load/ (the --lora-load-dir) and, outside it, secret/ (another adapter nobody may read):
    load/real        a plain adapter
    load/links       both files symlinks to secret/'s
    load/half        a real config, the weights a symlink to secret/'s
    load/escape      a symlink to secret/ itself
    load/hub         an HF-cache layout: files that are symlinks to blobs inside load/ (allowed)
    load/fifo        a FIFO where adapter_config.json should be
    """
    tmp = tmp_path_factory.mktemp("adapter-paths")
    load, secret = tmp / "load", tmp / "secret"
    make_adapter(tiny_model_dir, load / "real", seed=0)
    make_adapter(tiny_model_dir, secret, seed=1)
    (load / "links").mkdir()
    (load / "half").mkdir()
    (load / "hub" / "blobs").mkdir(parents=True)
    (load / "hub" / "snapshot").mkdir()
    (load / "fifo").mkdir()
    for name in (CONFIG, WEIGHTS):
        os.symlink(secret / name, load / "links" / name)
        (load / "hub" / "blobs" / name).write_bytes((secret / name).read_bytes())
        os.symlink(Path("..") / "blobs" / name, load / "hub" / "snapshot" / name)
    (load / "half" / CONFIG).write_bytes((load / "real" / CONFIG).read_bytes())
    os.symlink(secret / WEIGHTS, load / "half" / WEIGHTS)
    os.symlink(secret, load / "escape")
    os.mkfifo(load / "fifo" / CONFIG)
    (load / "fifo" / WEIGHTS).write_bytes((load / "real" / WEIGHTS).read_bytes())
    return tmp


@pytest.fixture(scope="module")
def client(tiny_model_dir, tree):
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=4, max_lora_rank=8)
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir))
    store = AdapterStore(
        system, tree / "data", reserved=("tiny",), max_bytes=1 << 20, load_dirs=(tree / "load",)
    )
    state = ServerState(system, ["tiny"], auth=Authenticator({"ka": "alice", "kb": "bob"}), adapters=store)
    with served_app(state, raise_server_exceptions=False) as c:
        yield c


def load(client, name, path, headers=ALICE):
    return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=headers)


def refused(r, status: int, param: str = "lora_path") -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err["message"]


def adapters(client, headers=ALICE) -> list[str]:
    return [a["id"] for a in client.get("/v1/adapters", headers=headers).json()["data"]]


# -- files outside the load directory -----------------------------------------------------------------------
@pytest.mark.parametrize("where", ["links", "half", "escape"])
def test_files_linked_out_of_the_load_dir_are_refused(client, tree, where):
    message = refused(load(client, f"x-{where}", str(tree / "load" / where)), 403)
    assert "outside" in message or "not under" in message
    assert f"x-{where}" not in adapters(client)


def test_links_that_stay_inside_the_load_dir_are_followed(client, tree):
    """A Hugging Face cache snapshot (files symlinked to blobs beside it) under the load directory loads:
    the stored copy is the blobs' bytes."""
    assert load(client, "hub", str(tree / "load" / "hub" / "snapshot")).status_code == 200
    stored = tree / "data" / "adapters" / "alice" / "hub"
    for name in (CONFIG, WEIGHTS):
        assert (stored / name).read_bytes() == (tree / "load" / "hub" / "blobs" / name).read_bytes()
    assert "hub" not in adapters(client, BOB)


def test_a_link_swapped_in_after_resolving_is_not_followed(tree, monkeypatch):
    """The second check: even when resolving saw no link (as when a link is swapped in between resolving
    and opening), every component is opened without following one, so secret/'s bytes are never read."""
    monkeypatch.setattr(registry.os.path, "realpath", os.path.abspath)  # resolution that sees no links
    roots = (Path(os.path.realpath(tree / "load")),)
    for where in ("links", "half"):
        with pytest.raises(AdapterPathError, match="is not a regular file"):
            read_server_adapter(str(tree / "load" / where), roots, 1 << 20, "lora_path")
    with pytest.raises(AdapterPathError, match="a link appeared"):  # a directory component that is a link
        read_server_adapter(str(tree / "load" / "escape"), roots, 1 << 20, "lora_path")


# -- malformed paths: a 400 naming lora_path, never a 500 -----------------------------------------------------
@pytest.mark.parametrize(
    "path, match",
    [
        ("{load}/real\x00/etc/passwd", "NUL"),
        ("{load}/" + "x" * 300, "longer than 255 bytes"),  # ENAMETOOLONG from the OS
        ("{load}" + "/a" * 3000, "longer than 4096 bytes"),
        ("{load}/missing", "does not exist"),
        ("{load}/real/" + CONFIG, "not a directory"),
        ("{load}/fifo", "not a regular file"),  # a FIFO: refused without opening it (which would block)
        ("load/real", "absolute"),
        ("~/real", "absolute"),
        ("~nosuchuser/real", "absolute"),
        ("", None),
        (5, "string"),
        (None, "string"),
        (["/x"], "string"),
        ({"p": "/x"}, "string"),
        (True, "string"),
    ],
    ids=lambda v: repr(v)[:20],
)
def test_malformed_paths_are_400_naming_lora_path(client, tree, path, match):
    if isinstance(path, str):
        path = path.replace("{load}", str(tree / "load"))
    message = refused(load(client, "x", path), 400)
    assert match is None or match in message, message


def test_a_lone_surrogate_in_lora_path_names_it(client):
    body = '{"lora_name": "x", "lora_path": "/tmp/\\udc80"}'
    r = client.post(
        "/v1/load_lora_adapter", content=body, headers={**ALICE, "Content-Type": "application/json"}
    )
    refused(r, 400)


def test_bad_adapter_names_name_lora_name(client, tree):
    refused(load(client, "../x", str(tree / "load" / "real")), 400, "lora_name")
    refused(load(client, "x" * 100_000, str(tree / "load" / "real")), 400, "lora_name")


def test_an_adapter_over_the_size_limit_is_413(tiny_model_dir, tree):
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=4, max_lora_rank=8)
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir))
    store = AdapterStore(system, tree / "small-data", max_bytes=1000, load_dirs=(tree / "load",))
    state = ServerState(system, ["tiny"], auth=Authenticator({"ka": "alice"}), adapters=store)
    with served_app(state, raise_server_exceptions=False) as c:
        refused(load(c, "big", str(tree / "load" / "real")), 413)


# -- the data directory never overlaps a load directory -------------------------------------------------------
@pytest.mark.parametrize("data, loads", [("load/data", "load"), ("load", "load"), ("d", "d/imports")])
def test_a_data_dir_overlapping_a_load_dir_is_refused(tree, data, loads):
    (tree / loads).mkdir(parents=True, exist_ok=True)
    with pytest.raises(ValueError, match="overlaps --data-dir"):
        AdapterStore(None, tree / data, load_dirs=(tree / loads,))


def test_motet_serve_refuses_a_data_dir_under_a_load_dir_in_one_line(tiny_model_dir, tree):
    """Otherwise tenant B loads `DATA/adapters/alice/NAME` and gets a copy of alice's adapter."""
    cmd = [sys.executable, "-m", "motet.api.cli", "serve", "--model", str(tiny_model_dir)]
    cmd += ["--data-dir", str(tree / "load" / "data"), "--lora-load-dir", str(tree / "load")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--lora-load-dir" in lines[0] and "--data-dir" in lines[0], done.stderr


@pytest.mark.parametrize("store", ["file://{load}/store", "{load}/store", None])
def test_replicas_local_adapter_copies_never_overlap_a_load_dir(tiny_model_dir, tree, store):
    """With replicas, tenants' adapters are also copied to a local --adapter-store and the replicas' cache:
    `motet serve` refuses a load dir over either, before Ray or a model is started."""
    from motet.api.cli import build_parser, engine_config
    from motet.api.server import build_state
    from motet.cluster.shared_adapter_store import SharedAdapterStore

    argv = ["serve", "--model", str(tiny_model_dir), "--replicas", "2", "--data-dir", str(tree / "d2")]
    if store is not None:  # a store under the load dir
        argv += ["--adapter-store", store.format(load=tree / "load"), "--lora-load-dir", str(tree / "load")]
    else:  # the replicas' cache (in the system's temp dir), with a store elsewhere
        cache = SharedAdapterStore().cache_dir
        cache.mkdir(parents=True, exist_ok=True)
        argv += ["--adapter-store", "memory://x", "--lora-load-dir", str(cache)]
    args = build_parser().parse_args(argv)
    with pytest.raises(ValueError, match="--adapter-store" if store else "the replicas' adapter cache"):
        build_state(args, engine_config(args))
