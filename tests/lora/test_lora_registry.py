"""The per-tenant adapter registry on disk: uploads as files or archives, hostile archives refused,
atomic saves, tenant isolation, and state that survives a restart."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile

import pytest
import torch
from safetensors.torch import save

import motet.lora.registry as registry
from motet.lora.adapter import AdapterError, AdapterTooLarge, load_adapter
from motet.lora.registry import AdapterExists, AdapterNotFound, AdapterRegistry
from tests.lora.test_lora_pool import BASE

CFG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def adapter_files(rank: int = 4, seed: int = 0, shape_error: bool = False) -> dict[str, bytes]:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(BASE.num_hidden_layers):
        key = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, BASE.hidden_size + shape_error, generator=g)
        tensors[f"{key}.lora_B.weight"] = torch.randn(BASE.hidden_size, rank, generator=g)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj"]}
    return {CFG: json.dumps(cfg).encode(), WEIGHTS: save(tensors)}


def tar_bytes(members, gz=False) -> bytes:
    """members: (name, bytes) for files, or (name, tarfile type, linkname) for anything else."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gz else "w") as tar:
        for m in members:
            info = tarfile.TarInfo(m[0])
            if len(m) == 2:
                info.size = len(m[1])
                tar.addfile(info, io.BytesIO(m[1]))
            else:
                info.type, info.linkname = m[1], m[2]
                tar.addfile(info)
    return buf.getvalue()


def zip_bytes(members, symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members:
            z.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo(symlink)
            info.external_attr = 0o120777 << 16
            z.writestr(info, "/etc/passwd")
    return buf.getvalue()


@pytest.fixture
def reg(tmp_path):
    return AdapterRegistry(tmp_path, BASE, max_rank=16, max_bytes=64 << 10)


def on_disk(tmp_path) -> list[str]:
    """Everything under the adapters root, hidden files included."""
    root = tmp_path / "adapters"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_save_files_then_get_list_delete(reg, tmp_path):
    info = reg.save("acme", "support-v1", adapter_files())
    assert info.path == tmp_path / "adapters" / "acme" / "support-v1" and info.size_bytes > 0
    assert load_adapter(info.path, BASE).rank == 4
    assert reg.get("acme", "support-v1") == info
    reg.save("acme", "b.2", adapter_files(seed=1))
    assert [i.name for i in reg.list("acme")] == ["b.2", "support-v1"]
    reg.delete("acme", "support-v1")
    assert [i.name for i in reg.list("acme")] == ["b.2"]
    with pytest.raises(AdapterNotFound, match="no adapter named 'support-v1'"):
        reg.get("acme", "support-v1")
    with pytest.raises(AdapterNotFound):
        reg.delete("acme", "support-v1")
    assert on_disk(tmp_path) == ["acme", "acme/b.2", f"acme/b.2/{CFG}", f"acme/b.2/{WEIGHTS}"]


@pytest.mark.parametrize("kind", ["tar", "tar.gz", "tgz", "zip", "zip-folder", "tar-folder+readme"])
def test_save_archives(reg, kind):
    files = adapter_files()
    members = list(files.items())
    if kind == "zip-folder":
        data, name = zip_bytes([(f"my-adapter/{n}", d) for n, d in members]), "a.zip"
    elif kind == "zip":
        data, name = zip_bytes(members), "a.zip"
    elif kind == "tar-folder+readme":
        folder = [("./out", tarfile.DIRTYPE, "")] + [(f"./out/{n}", d) for n, d in members]
        data, name = tar_bytes([*folder, ("./out/README.md", b"# card")]), "a.tar"
    else:
        data, name = tar_bytes(members, gz=kind != "tar"), f"a.{kind}"
    info = reg.save("t", "x", archive=data, filename=name)
    assert sorted(p.name for p in info.path.iterdir()) == [CFG, WEIGHTS]
    assert (info.path / WEIGHTS).read_bytes() == files[WEIGHTS]


@pytest.mark.parametrize(
    "members, message",
    [
        ([("../adapter_config.json", b"{}")], "'..' in paths is refused"),
        ([("a/../../adapter_config.json", b"{}")], "'..' in paths is refused"),
        ([("/etc/adapter_config.json", b"{}")], "absolute"),
        ([("adapter_config.json", tarfile.SYMTYPE, "/etc/passwd")], "is a link"),
        ([("adapter_model.safetensors", tarfile.LNKTYPE, "adapter_config.json")], "is a link"),
        ([("dev", tarfile.CHRTYPE, "")], "special file"),
        ([("adapter_config.json", b"x" * (65 << 10))], "above the limit"),
        ([("evil.py", b"import os")], "'evil.py' is unexpected"),
        ([("adapter_model.bin", b"\x80\x04pickle")], "pickled checkpoints are refused"),
        ([("a/b/adapter_config.json", b"{}")], "unexpected"),
        ([("adapter_config.json", b"{}"), ("x/adapter_config.json", b"{}")], "appears twice"),
        ([(f"f{i}", tarfile.DIRTYPE, "") for i in range(20)], "more than 16 members"),
    ],
)
def test_hostile_tar_members_are_refused(reg, tmp_path, members, message):
    for gz in (False, True):
        with pytest.raises(AdapterError, match=message):
            reg.save("t", "x", archive=tar_bytes(members, gz=gz), filename="a.tgz" if gz else "a.tar")
    assert on_disk(tmp_path) == []


def test_hostile_zip_members_are_refused(reg, tmp_path):
    good = list(adapter_files().items())
    cases = [
        (zip_bytes(good[1:], symlink=CFG), "is a link"),
        (zip_bytes([("../x/adapter_config.json", b"{}")]), "'..' in paths"),
        (zip_bytes([("/abs/adapter_config.json", b"{}")]), "absolute"),
        (zip_bytes([("C:/adapter_config.json", b"{}")]), "absolute"),
        (zip_bytes([("adapter_model.safetensors", b"\0" * (65 << 10))]), "above the limit"),
        (zip_bytes([*good, ("notes.txt", b"hi")]), "'notes.txt' is unexpected"),
        (b"PK\x03\x04 not really a zip", "not a valid zip"),
    ]
    for data, message in cases:
        with pytest.raises(AdapterError, match=message):
            reg.save("t", "x", archive=data, filename="a.zip")
    with pytest.raises(AdapterError, match="unsupported format"):
        reg.save("t", "x", archive=b"", filename="a.rar")
    assert on_disk(tmp_path) == []


def test_invalid_uploads_leave_nothing(reg, tmp_path):
    files = adapter_files()
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        reg.save("t", "x", {WEIGHTS: files[WEIGHTS]})
    with pytest.raises(AdapterError, match="unexpected file 'run.sh'"):
        reg.save("t", "x", {**files, "run.sh": b""})
    # Validation against the base model runs before the rename; the message names the file, not a temp dir.
    with pytest.raises(AdapterError, match=r"^adapter_model.safetensors: key .* has shape") as e:
        reg.save("t", "x", adapter_files(shape_error=True))
    assert ".tmp-" not in str(e.value)
    with pytest.raises(AdapterError, match="max LoRA rank 16"):
        reg.save("t", "x", adapter_files(rank=32))
    assert [p for p in on_disk(tmp_path) if p != "t"] == []


def test_a_crash_mid_save_leaves_nothing(reg, tmp_path, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. the process is interrupted while the upload is written

    monkeypatch.setattr(registry, "load_adapter", crash)
    with pytest.raises(KeyboardInterrupt):
        reg.save("t", "x", adapter_files())
    assert [p for p in on_disk(tmp_path) if p != "t"] == []


def test_names_are_validated(reg):
    for tenant, name in [
        ("t", "../x"),
        ("t", ".hidden"),
        ("t", "a/b"),
        ("t", "x" * 65),
        ("../t", "x"),
        ("t", ""),
    ]:
        with pytest.raises(AdapterError, match="name .* is invalid"):
            reg.save(tenant, name, adapter_files())
    reg.save("t", "A-z_0.9", adapter_files())


def test_tenants_are_isolated(reg):
    reg.save("alice", "secret", adapter_files())
    with pytest.raises(AdapterNotFound) as other:
        reg.get("bob", "secret")
    with pytest.raises(AdapterNotFound) as missing:
        reg.get("bob", "nothing-here")
    assert str(other.value) == str(missing.value).replace("nothing-here", "secret")
    assert reg.list("bob") == []
    with pytest.raises(AdapterNotFound):
        reg.delete("bob", "secret")
    reg.save("bob", "secret", adapter_files(seed=5))  # same name, another tenant: its own adapter
    assert reg.get("alice", "secret").path != reg.get("bob", "secret").path


def test_overwrite_is_explicit(reg):
    first = reg.save("t", "x", adapter_files(seed=1))
    assert (
        reg.save("t", "x", adapter_files(seed=1)) == first
    )  # the same files again: stored already, untouched
    with pytest.raises(AdapterExists, match="already exists"):
        reg.save("t", "x", adapter_files(seed=2))
    info = reg.save("t", "x", adapter_files(seed=2), overwrite=True)
    assert (info.path / WEIGHTS).read_bytes() == adapter_files(seed=2)[WEIGHTS]


def test_survives_a_restart_and_sweeps_leftovers(reg, tmp_path):
    reg.save("t", "x", adapter_files())
    (tmp_path / "adapters" / "t" / ".tmp-crashed").mkdir()  # a save cut short by a crash
    again = AdapterRegistry(tmp_path, BASE)
    assert [i.name for i in again.list("t")] == ["x"]
    assert on_disk(tmp_path) == ["t", "t/x", f"t/x/{CFG}", f"t/x/{WEIGHTS}"]


def test_size_refusals_are_typed(reg, tmp_path):
    """The API answers these 413 (not 400) by their type."""
    files = adapter_files()
    big = {**files, WEIGHTS: files[WEIGHTS] + b"\0" * (64 << 10)}
    with pytest.raises(AdapterTooLarge):
        reg.save("t", "x", big)
    with pytest.raises(AdapterTooLarge):
        reg.save("t", "x", archive=tar_bytes([(CFG, b"x" * (65 << 10))]), filename="a.tar")
    with pytest.raises(AdapterError) as e:
        reg.save("t", "x", archive=tar_bytes([("evil.py", b"import os")]), filename="a.tar")
    assert not isinstance(e.value, AdapterTooLarge)
    assert on_disk(tmp_path) == []
