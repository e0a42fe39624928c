"""Adapters across replicas: one shared store every replica reads.

By default the store is the ingress's adapter directory (--data-dir) itself: replicas read an upload at the
path its ref names (one machine, or a filesystem every node mounts). With `--adapter-store URL` (any fsspec
URL: s3://..., gs://..., file:///..., ...) the ingress publishes each adapter version there the first time
a request uses it, as URL/<engine name>/<version digest>/{adapter_config.json, adapter_model.safetensors},
and replicas read only from the store: a replica copies a version into its local cache on first use, with
a stamp of the original's version (motet/lora/manager.py), so its uid and prefix-cache hashes match the ingress's.

Replicas load lazily (on a request's first use) and drop on delete: a replica sweeps the adapters it holds
and removes from its engine the names the store no longer has. Tenant isolation is the ingress's (an
upload's engine name is "tenant/name", and only the ingress resolves names); versions never mix, since a
re-upload is a new version, a new uid and a new key in the store.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import shutil
import tempfile
import threading
import uuid
from pathlib import Path

from motet.lora.manager import VERSION_STAMP, AdapterRef, files_version
from motet.lora.registry import FILES

log = logging.getLogger("motet.adapters")


class SharedAdapterStore:
    def __init__(self, url: str | None = None, cache_dir: str | Path | None = None):
        self.url = url or None
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "motet-adapters").expanduser()
        self._fs = self._root = None
        self._published: dict[int, str] = {}  # uid -> engine name, of the versions published
        # Publishing (the ingress) and fetching (a replica) run in worker threads, several at once when
        # concurrent requests are an adapter's first: one at a time checks the store and copies.
        self._lock = threading.Lock()
        if self.url:
            import fsspec

            self._fs, self._root = fsspec.core.url_to_fs(self.url)

    def _dir(self, name: str, version: str | None = None) -> str:
        parts = [self._root.rstrip("/"), *name.split("/")]
        if version is not None:
            parts.append(hashlib.blake2b(version.encode(), digest_size=8).hexdigest())
        return "/".join(parts)

    # -- the ingress ----------------------------------------------------------------------------------
    def publish(self, ref: AdapterRef) -> None:
        """Make this version of the adapter readable by every replica (blocking: call it in a thread)."""
        if self._fs is None or ref.uid in self._published:
            return
        with self._lock:
            if ref.uid in self._published:  # published by another request while this one waited
                return
            target = self._dir(ref.name, ref.version)
            if not self._fs.exists(f"{target}/{FILES[-1]}"):
                staging = f"{target}.partial-{uuid.uuid4().hex}"  # never another publisher's
                self._fs.makedirs(staging, exist_ok=True)
                for f in FILES:
                    self._fs.put_file(str(Path(ref.path) / f), f"{staging}/{f}")
                self._fs.mv(staging, target, recursive=True)
                log.info("published adapter %s to %s", ref.name, target)
            self._published[ref.uid] = ref.name

    def unpublish(self, name: str) -> None:
        """The adapter `name` was deleted: remove every version from the store (blocking)."""
        if self._fs is None:
            return
        self._published = {uid: n for uid, n in self._published.items() if n != name}
        if self._fs.exists(self._dir(name)):
            self._fs.rm(self._dir(name), recursive=True)

    # -- a replica ------------------------------------------------------------------------------------
    def local(self, ref: AdapterRef) -> AdapterRef:
        """The ref to hand the engine: the store's files, copied here once per version when the store is a
        URL. FileNotFoundError when the store no longer has them."""
        if self._fs is None:
            return ref
        local = self.cache_dir / ref.name / hashlib.blake2b(ref.version.encode(), digest_size=8).hexdigest()
        # Replicas on one machine share the cache: one process at a time checks and copies (another replica
        # replacing a complete copy while this one's engine reads it would look like a deleted adapter).
        with self._lock, open(self._ensure(local.parent) / ".lock", "a+") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # (released as the file closes)
            self._fetch(ref, local)
        return AdapterRef(ref.name, local, ref.version)

    def _fetch(self, ref: AdapterRef, local: Path) -> None:
        if files_version(local) != ref.version:
            source = self._dir(ref.name, ref.version)
            staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=self._ensure(local.parent)))
            try:
                for f in FILES:
                    self._fs.get_file(f"{source}/{f}", str(staging / f))
                (staging / VERSION_STAMP).write_text(ref.version)
                shutil.rmtree(local, ignore_errors=True)
                staging.rename(local)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise

    def deleted(self, ref: AdapterRef) -> bool:
        """The store has no version of this adapter's name any more (blocking)."""
        if self._fs is None:
            return files_version(ref.path) == "missing"
        return not self._fs.exists(self._dir(ref.name))

    def forget(self, name: str) -> None:
        """Remove a deleted adapter's local copies."""
        if self._fs is not None:
            shutil.rmtree(self.cache_dir / name, ignore_errors=True)

    @staticmethod
    def _ensure(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        return path
