"""Per-tenant LoRA adapters over HTTP: `motet serve` as a real subprocess on the real default model
(slow), and one fast in-process test on a tiny model.

Two tenants upload random PEFT adapters, generate with them (checked against the offline engine), can't
see or touch each other's, have every bad upload refused with nothing left on disk, delete while a
request runs, and find their adapters again after a restart (which also serves a shared --lora adapter).
"""

from __future__ import annotations

import functools
import io
import json
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.api.test_api import MODEL
from tests.live_server import Server
from tests.peft_adapters import strong_adapter

slow = pytest.mark.slow

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
MAX_RANK, MAX_BYTES = 16, 4 << 20
PROMPT = "The capital of France is"
# few tokens: this runs on small shared CPUs; no penalty, whatever the model's generation config says (the offline
# engine below reads none)
GREEDY = dict(temperature=0, max_tokens=8, frequency_penalty=0)
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
RESULTS: dict[str, str] = {}  # outputs shared by the tests, in file order


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory):
    from transformers import LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("adapters")
    base = LlamaForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return {who: strong_adapter(base, tmp / who, seed) for seed, who in enumerate(("alice", "bob"))}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-adapters")
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    return tmp


def start(dirs: Path, *args: str) -> Server:
    flags = ["--max-lora-rank", str(MAX_RANK), "--max-adapter-bytes", str(MAX_BYTES)]
    return Server(
        dirs, "--api-keys", str(dirs / "keys.json"), "--data-dir", str(dirs / "data"), *flags, *args
    )


@pytest.fixture(scope="module")
def server(dirs):
    srv = start(dirs)
    yield srv
    srv.stop()


def http(server: Server, tenant: str) -> httpx.Client:
    key = next(k for k, t in KEYS.items() if t == tenant)
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=300)


def sdk(server: Server, tenant: str) -> openai.OpenAI:
    key = next(k for k, t in KEYS.items() if t == tenant)
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def upload(client: httpx.Client, name: str, files: dict[str, bytes]) -> httpx.Response:
    return client.post("/v1/adapters", data={"name": name}, files=[("files", f) for f in files.items()])


def two_files(path: Path) -> dict[str, bytes]:
    return {f: (path / f).read_bytes() for f in (CONFIG, WEIGHTS)}


def tar(members: list[tarfile.TarInfo | tuple[str, bytes]], mode: str = "w:gz") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as t:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                t.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                t.addfile(info, io.BytesIO(m[1]))
    return buf.getvalue()


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def ids(client: httpx.Client, path: str) -> list[tuple[str, str]]:
    r = client.get(path)
    assert r.status_code == 200, r.text
    return [(m["id"], m["owned_by"]) for m in r.json()["data"]]


def on_disk(dirs: Path, tenant: str) -> list[str]:
    d = dirs / "data" / "adapters" / tenant
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# -- upload, list, generate ------------------------------------------------------------------------------------
@slow
def test_upload_and_list(server, adapters, dirs):
    alice, bob = http(server, "alice"), http(server, "bob")
    r = upload(alice, "a", two_files(adapters["alice"]))
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["id"] == "a" and card["object"] == "adapter" and card["owned_by"] == "alice"
    assert card["parent"] == MODEL and card["size_bytes"] > 0
    again = upload(alice, "a", two_files(adapters["alice"]))  # the same files again (a script run twice)
    assert again.status_code == 200 and again.json() == card, again.text
    error(upload(alice, "a", two_files(adapters["bob"])), 409)  # other files: the name is taken
    error(upload(alice, MODEL, two_files(adapters["alice"])), 409)  # so is the base model's

    # Bob has his own "a" (an archive: a folder inside a .tar.gz), alice a second adapter from a .zip.
    archive = tar([(f"a/{f}", d) for f, d in two_files(adapters["bob"]).items()])
    assert upload(bob, "a", {"a.tar.gz": archive}).status_code == 200
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for f, d in two_files(adapters["alice"]).items():
            z.writestr(f, d)
    assert upload(alice, "zipped", {"zipped.zip": buf.getvalue()}).status_code == 200

    assert ids(alice, "/v1/adapters") == [("a", "alice"), ("zipped", "alice")]
    assert ids(bob, "/v1/adapters") == [("a", "bob")]
    assert alice.get("/v1/adapters/zipped").json()["owned_by"] == "alice"
    models = sdk(server, "alice").models.list().data
    assert [(m.id, m.owned_by) for m in models] == [(MODEL, "motet"), ("a", "alice"), ("zipped", "alice")]
    assert models[1].model_extra["parent"] == MODEL
    assert [m.id for m in sdk(server, "bob").models.list().data] == [MODEL, "a"]
    assert on_disk(dirs, "alice") == ["a", "zipped"] and on_disk(dirs, "bob") == ["a"]


@slow
def test_generate_with_adapter(server, adapters):
    alice, bob = sdk(server, "alice"), sdk(server, "bob")
    base = alice.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0].text
    mine = alice.completions.create(model="a", prompt=PROMPT, **GREEDY)
    assert mine.model == "a"
    theirs = bob.completions.create(model="a", prompt=PROMPT, **GREEDY).choices[0].text
    assert len({base, mine.choices[0].text, theirs}) == 3  # each tenant's "a" is its own adapter
    RESULTS.update(base=base, alice=mine.choices[0].text, bob=theirs)

    # Chat, streaming, with the adapter.
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    chunks = alice.chat.completions.create(model="a", messages=messages, stream=True, **GREEDY)
    chat = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # Both are the offline engine's greedy outputs with the same adapter.
    from motet.engine.llm import LLM
    from motet.engine.sampling_params import SamplingParams

    llm = LLM(num_kv_blocks=64, dtype="auto")  # the server's default dtype
    llm.add_lora("a", adapters["alice"])
    for prompt, served in ((PROMPT, RESULTS["alice"]), (llm.tokenizer.encode_chat(messages), chat)):
        (offline,) = llm.generate([prompt], SamplingParams(**GREEDY), adapters=["a"])  # alone, as served
        assert offline.text == served


@slow
def test_tenant_isolation(server):
    alice, bob = http(server, "alice"), http(server, "bob")
    missing = error(bob.get("/v1/adapters/nope"), 404)
    hidden = error(bob.get("/v1/adapters/zipped"), 404)  # alice's: looks exactly like a missing one
    assert hidden["message"] == missing["message"].replace("nope", "zipped")
    error(bob.delete("/v1/adapters/zipped"), 404)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        sdk(server, "bob").completions.create(model="zipped", prompt=PROMPT, max_tokens=2)
    assert "zipped" not in [i for i, _ in ids(bob, "/v1/models")]
    assert alice.get("/v1/adapters/zipped").status_code == 200  # still there for alice


# -- bad uploads ----------------------------------------------------------------------------------------------
def edit_config(path: Path, **changes) -> dict[str, bytes]:
    files = two_files(path)
    files[CONFIG] = json.dumps({**json.loads(files[CONFIG]), **changes}).encode()
    return files


def edit_weights(path: Path, fn) -> dict[str, bytes]:
    tensors = load_file(path / WEIGHTS)
    fn(tensors)
    buf = Path(path / "edited.safetensors")
    save_file(tensors, buf)
    return {CONFIG: (path / CONFIG).read_bytes(), WEIGHTS: buf.read_bytes()}


def _drop_one_b(t):
    del t[next(k for k in sorted(t) if "lora_B" in k)]


def _bad_shape(t):
    key = next(k for k in sorted(t) if "lora_A" in k)
    t[key] = torch.zeros(8, 100)


def _link(name: str, target: str, kind=tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


BAD = {
    "bad-json": (
        lambda p: {**two_files(p), CONFIG: b"{not json"},
        400,
        "adapter_config.json: not valid JSON",
    ),
    "rank-too-high": (lambda p: edit_config(p, r=32), 400, f"above this server's max LoRA rank {MAX_RANK}"),
    "dora": (lambda p: edit_config(p, use_dora=True), 400, "DoRA (use_dora) is not supported"),
    "missing-lora-b": (lambda p: edit_weights(p, _drop_one_b), 400, "has no matching lora_B"),
    "shape-mismatch": (lambda p: edit_weights(p, _bad_shape), 400, "has shape [8, 100], expected [8, 576]"),
    "missing-weights": (lambda p: {CONFIG: (p / CONFIG).read_bytes()}, 400, f"{WEIGHTS} is missing"),
    "dotdot-in-archive": (
        lambda p: {"x.tar.gz": tar([(f"../{f}", d) for f, d in two_files(p).items()])},
        400,
        "'..' in paths is refused",
    ),
    "absolute-path-in-archive": (
        lambda p: {"x.tar": tar([(f"/tmp/{f}", d) for f, d in two_files(p).items()], "w")},
        400,
        "absolute or non-POSIX paths are refused",
    ),
    "symlink-in-archive": (
        lambda p: {"x.tgz": tar([(CONFIG, (p / CONFIG).read_bytes()), _link(WEIGHTS, "/etc/passwd")])},
        400,
        f"archive member '{WEIGHTS}' is a link",
    ),
    "oversized": (
        lambda p: {CONFIG: (p / CONFIG).read_bytes(), WEIGHTS: b"\0" * (MAX_BYTES + (1 << 20))},
        413,
        f"larger than the adapter size limit of {MAX_BYTES} bytes",
    ),
    "archive-bomb": (  # tiny compressed, over the limit inflated
        lambda p: {
            "x.tar.gz": tar([(CONFIG, (p / CONFIG).read_bytes()), (WEIGHTS, b"\0" * (MAX_BYTES + 1))])
        },
        413,
        f"above the limit of {MAX_BYTES}",
    ),
    "pickle-bin": (
        lambda p: {CONFIG: (p / CONFIG).read_bytes(), "adapter_model.bin": b"\x80\x04pickle"},
        400,
        "adapter_model.bin: pickled checkpoints are refused",
    ),
    "unsupported-archive": (lambda p: {"x.rar": b"Rar!"}, 400, "unexpected file 'x.rar'"),
}


@slow
@pytest.mark.parametrize("case", list(BAD))
def test_bad_upload_refused_and_nothing_stored(server, adapters, dirs, case):
    build, status, message = BAD[case]
    alice = http(server, "alice")
    before = on_disk(dirs, "alice")
    err = error(upload(alice, case, build(adapters["alice"])), status)
    assert message in err["message"]
    assert on_disk(dirs, "alice") == before  # no adapter, no temp folder
    error(alice.get(f"/v1/adapters/{case}"), 404)


@slow
def test_bad_names(server, adapters):
    alice = http(server, "alice")
    for name in ("../x", ".hidden", "a/b", "x" * 65):
        assert "is invalid" in error(upload(alice, name, two_files(adapters["alice"])), 400)["message"]
    error(alice.post("/v1/adapters", data={"name": "x"}), 400)  # no files
    assert error(alice.post("/v1/adapters", json={"name": "x"}), 400)["param"] == "name"


# -- delete, restart --------------------------------------------------------------------------------------------
@slow
def test_delete_lets_running_requests_finish(server, dirs):
    alice = http(server, "alice")
    stream = sdk(server, "alice").completions.create(
        model="zipped",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        frequency_penalty=0,  # as GREEDY (RESULTS)
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    deleted = []
    t = threading.Thread(target=lambda: deleted.append(alice.delete("/v1/adapters/zipped")))
    t.start()
    rest = list(chunks)
    t.join()
    assert deleted[0].json() == {"id": "zipped", "object": "adapter", "deleted": True}
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    assert rest[-1].choices[0].finish_reason == "length" and text.startswith(RESULTS["alice"])

    error(alice.get("/v1/adapters/zipped"), 404)
    error(alice.delete("/v1/adapters/zipped"), 404)
    with pytest.raises(openai.NotFoundError):
        sdk(server, "alice").completions.create(model="zipped", prompt=PROMPT, max_tokens=2)
    assert on_disk(dirs, "alice") == ["a"]


@slow
def test_restart_keeps_adapters_and_serves_shared_ones(server, dirs, adapters):
    server.stop()
    srv = start(dirs, "--lora", f"shared={adapters['bob']}")
    try:
        alice, bob = http(srv, "alice"), http(srv, "bob")
        assert ids(alice, "/v1/adapters") == [("a", "alice"), ("shared", "motet")]
        assert ids(bob, "/v1/models") == [(MODEL, "motet"), ("a", "bob"), ("shared", "motet")]
        client = sdk(srv, "alice")
        assert (
            client.completions.create(model="a", prompt=PROMPT, **GREEDY).choices[0].text == RESULTS["alice"]
        )
        # The shared adapter holds bob's weights: the same output as bob's own "a".
        assert (
            client.completions.create(model="shared", prompt=PROMPT, **GREEDY).choices[0].text
            == RESULTS["bob"]
        )
        error(alice.delete("/v1/adapters/shared"), 403)
        error(upload(alice, "shared", two_files(adapters["alice"])), 409)
        # Deleted and uploaded again under the same name: the new weights serve.
        bob_sdk = sdk(srv, "bob")
        assert (
            bob_sdk.completions.create(model="a", prompt=PROMPT, **GREEDY).choices[0].text == RESULTS["bob"]
        )
        assert bob.delete("/v1/adapters/a").status_code == 200
        assert upload(bob, "a", two_files(adapters["alice"])).status_code == 200
        again = bob_sdk.completions.create(model="a", prompt=PROMPT, **GREEDY).choices[0].text
        assert again == RESULTS["alice"]
    finally:
        srv.stop()


# -- in process, on a tiny model ----------------------------------------------------------------------------
def test_in_process_upload_use_delete(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from motet.actors.system import ServingSystem
    from motet.api.adapters.store import AdapterStore
    from motet.api.auth import Authenticator
    from motet.api.state import ServerState
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from tests.served_app import served_app

    path = strong_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "ad", seed=0)
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=4, max_lora_rank=8)
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir))
    store = AdapterStore(system, tmp_path / "data", reserved=("tiny",), max_bytes=1 << 20)
    state = ServerState(system, ["tiny"], auth=Authenticator({"ka": "alice", "kb": "bob"}), adapters=store)
    alice, bob = {"Authorization": "Bearer ka"}, {"Authorization": "Bearer kb"}
    body = {"prompt": "The quick brown", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with served_app(state) as c:

        def text(model, headers=alice):
            r = c.post("/v1/completions", json={**body, "model": model}, headers=headers)
            return r.json()["choices"][0]["text"] if r.status_code == 200 else r.status_code

        files = [("files", f) for f in two_files(path).items()]
        assert c.post("/v1/adapters", data={"name": "a"}, files=files, headers=alice).status_code == 200
        assert [m["id"] for m in c.get("/v1/models", headers=alice).json()["data"]] == ["tiny", "a"]
        assert [m["id"] for m in c.get("/v1/models", headers=bob).json()["data"]] == ["tiny"]
        with_adapter = text("a")
        assert with_adapter != text("tiny") and text("a", bob) == 404
        assert c.delete("/v1/adapters/a", headers=bob).status_code == 404
        assert c.delete("/v1/adapters/a", headers=alice).status_code == 200
        assert text("a") == 404
        deadline = time.monotonic() + 10
        known = system.executor.engine.adapters.known
        while any(ref.name == "alice/a" for ref in list(known.values())):  # forgotten between steps
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert c.post("/v1/adapters", data={"name": "a"}, files=files, headers=alice).status_code == 200
        assert text("a") == with_adapter  # registered again, lazily


def test_an_unknown_models_404_names_the_models_the_tenant_may_use(tiny_model_dir, tmp_path):
    """Issue 57: a typo'd model's 404 named nothing to use instead. It names what GET /v1/models lists for the
    tenant (the served name, the shared adapters and its own), never another tenant's adapter nor the path the
    model was loaded from; read through the openai SDK."""
    from transformers import AutoModelForCausalLM

    from motet.actors.system import ServingSystem
    from motet.api.adapters.store import AdapterStore
    from motet.api.auth import Authenticator
    from motet.api.state import ServerState
    from motet.engine.config import EngineConfig
    from motet.engine.llm_engine import LLMEngine
    from tests.served_app import served_app

    path = strong_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "ad", seed=0)
    cfg = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=4, max_lora_rank=8)
    system = ServingSystem(lambda: LLMEngine(cfg, model_dir=tiny_model_dir))
    store = AdapterStore(system, tmp_path / "data", reserved=("tiny",), max_bytes=1 << 20)
    state = ServerState(system, ["tiny", str(tiny_model_dir)], auth=Authenticator({"ka": "alice", "kb": "bob"}),
                        adapters=store)  # fmt: skip
    with served_app(state) as c:
        files = [("files", f) for f in two_files(path).items()]
        for name, key in (("alice-adapter", "ka"), ("bobs-secret", "kb")):
            r = c.post(
                "/v1/adapters", data={"name": name}, files=files, headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200, r.text
        for key, listed, hidden in (
            ("ka", "alice-adapter", "bobs-secret"),
            ("kb", "bobs-secret", "alice-adapter"),
        ):
            client = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=c, max_retries=0)
            visible = [m.id for m in client.models.list()]
            assert visible == ["tiny", listed]
            asks = (
                functools.partial(client.completions.create, model="tinny", prompt="x", max_tokens=1),
                functools.partial(client.models.retrieve, "tinny"),
            )
            for ask in asks:
                with pytest.raises(openai.NotFoundError) as e:
                    ask()
                message = e.value.body["message"]
                assert e.value.body["code"] == "model_not_found" and "'tinny'" in message
                assert all(repr(name) in message for name in visible), message
                assert hidden not in message and str(tiny_model_dir) not in message, message
