"""Per-tenant LoRA adapters on disk: `DATA/adapters/<tenant>/<name>/{adapter_config.json, adapter_model.safetensors}`.

Uploads are untrusted: the two files, or one `.tar` / `.tar.gz` / `.tgz` / `.zip` archive holding them (at
its root or in one top-level folder). Archive members are read into memory under size limits and never
extracted by path: absolute paths, `..`, links, devices, duplicates, oversized and unexpected members
are refused with an `AdapterError` naming the member. A save writes a hidden temp folder beside the
target, validates it with `load_adapter` against the base model, and only then renames it into place,
so an invalid or interrupted upload, or one the disk has no room for (the OSError is raised as it is),
leaves nothing behind (leftovers of a crash are swept at start-up).

Tenants are isolated by construction: every path is built from a validated tenant and name, and a
lookup of another tenant's adapter is indistinguishable from a missing one.

An adapter directory named by a path on the server (vLLM's load_lora_adapter) is read by
`read_server_adapter`, only from under the operator's load directories: the path and each file in it are
resolved (symlinks, '..') and must stay under one of them, and each file is then opened one component at a
time from that directory with no symlink followed, so a link swapped in meanwhile is refused too. Load
directories never overlap a directory holding tenants' own adapters (motet/lora/names.py `check_load_dirs`, at
start-up), or a tenant could load another's upload as its own. Plain synchronous code.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import stat
import tarfile
import tempfile
import uuid
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from motet.lora.adapter import (
    CONFIG_FILE,
    PICKLED_SUFFIXES,
    WEIGHTS_FILE,
    AdapterError,
    AdapterTooLarge,
    load_adapter,
    pickle_refusal,
)
from motet.lora.names import check_name, is_adapter_name
from motet.lora.peft_config import brief
from motet.models.config import ModelConfig

FILES = (CONFIG_FILE, WEIGHTS_FILE)
IGNORED = {"README.md"}  # PEFT's save_pretrained writes a model card beside the adapter: skipped
MAX_MEMBERS = 16


class AdapterNotFound(AdapterError):
    """No such adapter for this tenant (also what another tenant's adapter looks like)."""


class AdapterExists(AdapterError):
    """The tenant already has an adapter with this name (save with overwrite=True to replace it)."""


class AdapterQuotaExceeded(AdapterError):
    """An adapter that does not fit in the room its tenant has left."""


class AdapterPathError(AdapterError):
    """A server path that names no adapter directory: malformed, missing, unreadable, or not a directory."""


class AdapterPathRefused(AdapterError):
    """A server path, or a file in it, that resolves outside the directories adapters may be read from."""


@dataclass(frozen=True)
class AdapterInfo:
    tenant: str
    name: str
    path: Path
    size_bytes: int
    created: float  # modification time of the adapter folder (seconds since the epoch)


class AdapterRegistry:
    def __init__(
        self, data_dir: str | Path, base: ModelConfig, *, max_rank: int = 64, max_bytes: int = 1 << 30
    ):
        self.root = Path(data_dir) / "adapters"
        self.base, self.max_rank, self.max_bytes = base, max_rank, max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        for leftover in self.root.glob("*/.*"):  # temp folders of saves or deletes cut short by a crash
            shutil.rmtree(leftover, ignore_errors=True)

    def _dir(self, tenant: str, name: str | None = None) -> Path:
        d = self.root / check_name("tenant", tenant)
        return d if name is None else d / check_name("adapter", name)

    # -- reading -----------------------------------------------------------------------------------------
    def get(self, tenant: str, name: str) -> AdapterInfo:
        path = self._dir(tenant, name)
        if not all((path / f).is_file() for f in FILES):
            raise AdapterNotFound(f"no adapter named {name!r}")
        return AdapterInfo(
            tenant, name, path, sum((path / f).stat().st_size for f in FILES), path.stat().st_mtime
        )

    def list(self, tenant: str) -> list[AdapterInfo]:
        d = self._dir(tenant)
        names = sorted(p.name for p in d.iterdir() if is_adapter_name(p.name)) if d.is_dir() else []
        infos = []
        for name in names:
            with contextlib.suppress(AdapterNotFound):  # deleted meanwhile
                infos.append(self.get(tenant, name))
        return infos

    # -- writing -----------------------------------------------------------------------------------------
    def save(
        self,
        tenant: str,
        name: str,
        files: dict[str, bytes] | None = None,
        *,
        archive: bytes | None = None,
        filename: str | None = None,
        overwrite: bool = False,
        room: int | None = None,
    ) -> AdapterInfo:
        """Store an adapter from its two files or from one archive (`filename` says its format). The same files
        again under the same name are stored already: that adapter is returned (a script's upload can run twice);
        other files under a taken name are AdapterExists unless `overwrite`; files of more than `room` bytes
        together are AdapterQuotaExceeded, before anything is written."""
        target = self._dir(tenant, name)
        if (files is None) == (archive is None):
            raise AdapterError("upload either the adapter files or one archive")
        files = self._from_archive(archive, filename or "") if archive is not None else dict(files)
        self._check_files(files)
        if target.exists() and not overwrite:
            if _holds(target, files):
                return self.get(tenant, name)
            raise AdapterExists(f"adapter {name!r} already exists with other files")
        if room is not None and (size := sum(map(len, files.values()))) > room:
            raise AdapterQuotaExceeded(
                f"the adapter's {size} bytes do not fit in the {max(room, 0)} bytes left"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        try:
            for fname, data in files.items():
                _write_durably(tmp / fname, data)
            load_adapter(tmp, self.base, max_rank=self.max_rank, name=name, max_file_bytes=self.max_bytes)
            if overwrite and target.exists():
                self._remove(target)
            try:
                os.rename(tmp, target)  # atomic; fails if another save took the name meanwhile
            except OSError as e:
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                raise AdapterExists(f"adapter {name!r} already exists") from None
            try:
                _fsync_dir(target.parent)
            except BaseException:  # not known to be durable: not stored (the caller is told it failed)
                with contextlib.suppress(OSError):
                    self._remove(target)
                raise
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, AdapterError) and str(tmp) in str(e):  # name the upload, not our temp folder
                raise type(e)(str(e).replace(str(tmp) + os.sep, "").replace(str(tmp), name)) from None
            raise
        return self.get(tenant, name)

    def delete(self, tenant: str, name: str) -> None:
        path = self._dir(tenant, name)
        if not path.is_dir():
            raise AdapterNotFound(f"no adapter named {name!r}")
        self._remove(path)

    @staticmethod
    def _remove(path: Path) -> None:
        """Rename out of sight first (atomic), then delete at leisure."""
        trash = path.parent / f".del-{uuid.uuid4().hex}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    # -- checking uploads --------------------------------------------------------------------------------
    def _check_files(self, files: dict[str, bytes]) -> None:
        for ignored in IGNORED:
            files.pop(ignored, None)
        if unexpected := sorted(set(files) - set(FILES)):
            raise AdapterError(f"unexpected file {unexpected[0]!r}; an adapter is {' and '.join(FILES)}")
        if missing := [f for f in FILES if f not in files]:
            raise AdapterError(f"{missing[0]} is missing; an adapter is {' and '.join(FILES)}")
        if sum(len(d) for d in files.values()) > self.max_bytes:
            raise AdapterTooLarge(f"the adapter is larger than the limit of {self.max_bytes} bytes")

    def _from_archive(self, data: bytes, filename: str) -> dict[str, bytes]:
        lower = filename.lower()
        if lower.endswith(".zip"):
            return self._from_zip(data)
        if lower.endswith((".tar", ".tar.gz", ".tgz")):
            return self._from_tar(data)
        raise AdapterError(f"archive {filename!r}: unsupported format; upload a .tar, .tar.gz, .tgz or .zip")

    def _member(self, name: str, size: int, out: dict[str, bytes]) -> str | None:
        """Check a file member's path and size; returns the adapter file it is, or None for one to skip."""
        parts = _safe_parts(name)
        if parts and parts[-1].lower().endswith(PICKLED_SUFFIXES):
            raise pickle_refusal(f"archive member {name!r}")
        if len(parts) > 2 or not parts or parts[-1] not in (*FILES, *IGNORED):
            raise AdapterError(f"archive member {name!r} is unexpected; an adapter is {' and '.join(FILES)}")
        if size > self.max_bytes:
            raise AdapterTooLarge(
                f"archive member {name!r}: {size} bytes is above the limit of {self.max_bytes}"
            )
        if parts[-1] in IGNORED:
            return None
        if parts[-1] in out:
            raise AdapterError(f"archive member {name!r}: {parts[-1]} appears twice")
        return parts[-1]

    def _from_tar(self, data: bytes) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        try:
            # Streaming mode: headers are checked as they come, before any member's data is inflated.
            with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tar:
                for i, m in enumerate(tar):
                    if i >= MAX_MEMBERS:
                        raise AdapterError(f"archive has more than {MAX_MEMBERS} members")
                    if m.isdir():
                        _safe_parts(m.name)
                        continue
                    if not m.isfile():
                        kind = "link" if m.issym() or m.islnk() else "special file"
                        raise AdapterError(
                            f"archive member {m.name!r} is a {kind}; only regular files are accepted"
                        )
                    key = self._member(m.name, m.size, out)
                    if key is not None:
                        out[key] = tar.extractfile(m).read()
        except (tarfile.TarError, EOFError, OSError) as e:
            raise AdapterError(f"archive is not a valid tar file ({e})") from None
        return out

    def _from_zip(self, data: bytes) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                infos = z.infolist()
                if len(infos) > MAX_MEMBERS:
                    raise AdapterError(f"archive has more than {MAX_MEMBERS} members")
                for info in infos:
                    if (info.external_attr >> 16) & 0o170000 == 0o120000:
                        raise AdapterError(
                            f"archive member {info.filename!r} is a link; only regular files are accepted"
                        )
                    if info.is_dir():
                        _safe_parts(info.filename)
                        continue
                    key = self._member(info.filename, info.file_size, out)
                    if key is not None:
                        with z.open(info) as f:  # reads at most file_size bytes (CRC-checked)
                            out[key] = f.read(self.max_bytes + 1)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, RuntimeError) as e:
            raise AdapterError(f"archive is not a valid zip file ({e})") from None
        return out


def _holds(folder: Path, files: dict[str, bytes]) -> bool:
    """Whether `folder` holds exactly these adapter files (sizes first: most differences end there)."""
    try:
        return all(
            (folder / f).stat().st_size == len(data) and (folder / f).read_bytes() == data
            for f, data in files.items()
        )
    except OSError:
        return False


def _safe_parts(name: str) -> list[str]:
    """A member path's parts; absolute paths, drive letters, backslashes and '..' are refused."""
    if name.startswith("/") or re.match(r"[A-Za-z]:", name) or "\\" in name:
        raise AdapterError(f"archive member {name!r}: absolute or non-POSIX paths are refused")
    parts = [p for p in PurePosixPath(name).parts if p != "."]
    if ".." in parts:
        raise AdapterError(f"archive member {name!r}: '..' in paths is refused")
    return parts


def _write_durably(path: Path, data: bytes) -> None:
    """A new file holding `data`, on disk before this returns; a short write (a full disk) raises."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- adapters read from the server's own disk -------------------------------------------------------------------
MAX_PATH_BYTES = 4096  # PATH_MAX on Linux: a longer path names nothing
MAX_NAME_BYTES = 255  # NAME_MAX, a path component's limit on every Linux filesystem
_NOFOLLOW = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW


def read_server_adapter(path, roots: Sequence[Path], max_bytes: int, what: str = "path") -> dict[str, bytes]:
    """The files of the adapter directory `path` on this machine, read only from under `roots` (resolved
    directories, see check_load_dirs). Refusals name `what`: AdapterPathRefused for a path or file that
    resolves outside the roots, AdapterTooLarge over `max_bytes`, AdapterPathError for everything else
    (malformed, missing, unreadable); never another exception."""
    _check_path(path, what)
    try:
        real = Path(os.path.realpath(path))
        if _root(real, roots) is None:
            raise AdapterPathRefused(f"{what} is not under a directory this server loads adapters from")
        if not real.is_dir():
            missing = not real.exists()
            raise AdapterPathError(
                f"{what} {brief(path)} {'does not exist' if missing else 'is not a directory'}"
            )
        files, left = {}, max_bytes
        for name in FILES:
            file = Path(os.path.realpath(real / name))
            root = _root(file, roots)
            if root is None:
                raise AdapterPathRefused(
                    f"{what}: {name} links outside the directories this server loads adapters from"
                )
            try:
                files[name] = _read_beneath(root, file.relative_to(root), left, f"{what}: {name}")
            except FileNotFoundError:
                raise AdapterPathError(f"{what} has no {name}: not a PEFT LoRA adapter directory") from None
            left -= len(files[name])
    except AdapterTooLarge:
        raise AdapterTooLarge(f"the adapter is larger than the limit of {max_bytes} bytes") from None
    except OSError as e:  # permissions, a name too long for the filesystem, a link swapped in meanwhile, ...
        raise AdapterPathError(f"{what} {brief(path)} cannot be read: {e.strerror or e}") from None
    return files


def _check_path(path, what: str) -> None:
    """Refuse, before the OS sees it, what would make a path lookup raise (a NUL byte, text no file name
    can hold) or that names nothing (relative, longer than the OS allows)."""
    if not isinstance(path, str):
        raise AdapterPathError(f"{what} must be a string")
    if "\x00" in path:
        raise AdapterPathError(f"{what} holds a NUL character")
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise AdapterPathError(f"{what} is not valid Unicode (a lone surrogate)") from None
    if not os.path.isabs(path):
        raise AdapterPathError(f"{what} must be an absolute path")
    if len(encoded) > MAX_PATH_BYTES:
        raise AdapterPathError(f"{what} is longer than {MAX_PATH_BYTES} bytes")
    if any(len(part) > MAX_NAME_BYTES for part in encoded.split(b"/")):
        raise AdapterPathError(f"{what} has a component longer than {MAX_NAME_BYTES} bytes")


def _root(real: Path, roots: Sequence[Path]) -> Path | None:
    return next((r for r in roots if real.is_relative_to(r)), None)


def _read_beneath(root: Path, rel: Path, limit: int, what: str) -> bytes:
    """The regular file `root/rel`, opened one component at a time from `root` without following a
    symlink (the path was resolved: a link found now was swapped in since), at most `limit` bytes."""
    if not rel.parts:
        raise AdapterPathError(f"{what} is not a regular file")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in rel.parts[:-1]:
            try:
                child = os.open(part, _NOFOLLOW | os.O_DIRECTORY, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a link (or a file) where a directory was
                    raise AdapterPathError(f"{what} changed while it was read (a link appeared)") from None
                raise
            os.close(fd)
            fd = child
        seen = os.stat(rel.parts[-1], dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(seen.st_mode):  # a FIFO, device or link is never opened
            raise AdapterPathError(f"{what} is not a regular file")
        if seen.st_size > limit:
            raise AdapterTooLarge(what)
        file = os.open(rel.parts[-1], _NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(file, "rb") as f:
        now = os.fstat(f.fileno())
        if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
            raise AdapterPathError(f"{what} changed while it was read")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise AdapterTooLarge(what)
    return data
