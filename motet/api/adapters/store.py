"""Per-tenant LoRA adapters: where they are stored, and which adapter a request's `model` names.

Adapters are stored by motet/lora/registry.py under --data-dir and validated against the base model (and
--max-lora-rank) in a worker thread. A tenant's adapters are listed from disk the first time the tenant
is seen, then kept in memory (this server is their only writer), so resolving a model name costs no
disk access. Isolation: a tenant only ever looks in its own index, so another tenant's adapter is
answered exactly like a missing one (404). In the engine an upload is named "tenant/name", so every
tenant may have its own "a"; shared adapters (`motet serve --lora NAME=PATH`) keep their plain name, are
visible to every tenant and cannot be deleted over HTTP; a tenant's own adapter of the same name wins.
The HTTP routes are in motet/api/adapters/routes.py.

A tenant's adapters together are bounded (`max_bytes_per_tenant`); the room left is less what the tenant's
admitted work will store (the fine-tuning jobs' reservations, `reserved_by`), and room is checked and taken (a
save, a reservation) by one at a time.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import anyio
import anyio.to_thread

from motet.api.errors import APIError, echo
from motet.api.sqlite_store import StorageFailure
from motet.api.storage_errors import storage_error, stored_call
from motet.lora.adapter import AdapterError, AdapterTooLarge
from motet.lora.manager import AdapterRef
from motet.lora.names import FINE_TUNED_PREFIX, check_load_dirs, check_name
from motet.lora.registry import (
    FILES,
    AdapterExists,
    AdapterNotFound,
    AdapterPathRefused,
    AdapterQuotaExceeded,
    AdapterRegistry,
    read_server_adapter,
)

if TYPE_CHECKING:
    from motet.actors.front import ServingFront

T = TypeVar("T")
SHARED_OWNER = "motet"
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".zip")


@dataclass
class Adapter:
    ref: AdapterRef
    owner: str
    created: int
    size_bytes: int


def _not_found(name: str) -> APIError:
    return APIError(404, f"no adapter named {echo(name)}", param="name", code="adapter_not_found")


class AdapterStore:
    def __init__(
        self,
        system: ServingFront,
        data_dir: str | Path,
        *,
        shared: dict[str, Path] | None = None,
        reserved: tuple[str, ...] = (),
        max_bytes: int = 512 << 20,
        max_bytes_per_tenant: int | None = None,
        load_dirs: tuple[Path, ...] = (),
    ):
        self.system, self.data_dir, self.max_bytes = system, Path(data_dir), max_bytes
        self.max_bytes_per_tenant = max_bytes_per_tenant  # a tenant's adapters together (None: no limit)
        # server-side directories `load_from` may read adapters from (--lora-load-dir); none: it is off.
        # ValueError if one overlaps the data dir: a tenant could load another tenant's adapter from it.
        self.load_dirs = check_load_dirs(load_dirs, {"--data-dir": self.data_dir})
        self.reserved = set(reserved)  # the base model's names: no adapter may take them
        now = int(time.time())
        self.shared = {
            name: Adapter(AdapterRef.of(name, path), SHARED_OWNER, now, _size(Path(path)))
            for name, path in (shared or {}).items()
        }
        self._registry: AdapterRegistry | None = None
        self._lock = anyio.Lock()
        self._saving = anyio.Lock()  # a tenant's room checked and taken by one save or reservation at a time
        # (tenant, besides: a job or None) -> the bytes the tenant's admitted work will store but that job's
        self._reserved: Callable[[str, str | None], int] = lambda tenant, besides: 0
        self._tenants: dict[str, dict[str, Adapter]] = {}
        # what else keeps a tenant's models, told of each one deleted: (tenant, name), in a worker thread
        self.on_delete: list[Callable[[str, str], None]] = []

    async def registry(self) -> AdapterRegistry:
        """Opened on first use: it validates against the base model, known once the engine is loaded."""
        async with self._lock:
            if self._registry is None:
                model = self.system.model
                self._registry = await anyio.to_thread.run_sync(
                    functools.partial(
                        AdapterRegistry,
                        self.data_dir,
                        model.model_config,
                        max_rank=model.max_lora_rank,
                        max_bytes=self.max_bytes,
                    )
                )
        return self._registry

    def _entry(self, info) -> Adapter:
        ref = AdapterRef.of(f"{info.tenant}/{info.name}", info.path)  # its version: the files' identity
        return Adapter(ref, info.tenant, int(info.created), info.size_bytes)

    async def own(self, tenant: str) -> dict[str, Adapter]:
        """The tenant's uploads by name, listed from disk once."""
        if tenant not in self._tenants:
            registry = await self.registry()
            try:
                infos = await anyio.to_thread.run_sync(registry.list, tenant)
            except AdapterError:  # a tenant name the registry cannot hold: it has no uploads
                infos = []
            self._tenants.setdefault(tenant, {i.name: self._entry(i) for i in infos})
        return self._tenants[tenant]

    def reserved_by(self, reserved: Callable[[str, str | None], int]) -> None:
        """Where reservations are kept (the fine-tuning store's jobs): (tenant, a job or None) -> the bytes the
        tenant's admitted work but that job's will store, which no other save may take."""
        self._reserved = reserved

    async def room(self, tenant: str, job: str | None = None) -> int | None:
        """The bytes the tenant's adapters may still take (None: no limit): less what its admitted work will store,
        but `job`'s own (the job storing an adapter takes its own reserved room)."""
        if self.max_bytes_per_tenant is None:
            return None
        own = await self.own(tenant)
        reserved = await stored_call("the adapters' room could not be read", self._reserved, tenant, job)
        return self.max_bytes_per_tenant - sum(a.size_bytes for a in own.values()) - reserved

    async def reserve(
        self, tenant: str, need: int, take: Callable[[], T], refusal: Callable[[int], Exception]
    ) -> T:
        """Run `take` (in a thread), which records work that will store `need` bytes of the tenant's adapters (its
        reservation from then on), if they fit in the tenant's room; else raise `refusal(room)`."""
        async with self._saving:
            room = await self.room(tenant)
            if room is not None and need > room:
                raise refusal(max(room, 0))
            return await anyio.to_thread.run_sync(take)

    async def visible(self, tenant: str) -> list[Adapter]:
        own = await self.own(tenant)
        merged = {**self.shared, **own}
        return [merged[n] for n in sorted(merged)]

    async def get(self, tenant: str, name: str) -> Adapter:
        adapter = (await self.own(tenant)).get(name) or self.shared.get(name)
        if adapter is None:
            raise _not_found(name)
        return adapter

    async def resolve(self, tenant: str, model: str) -> AdapterRef | None:
        adapter = (await self.own(tenant)).get(model) or self.shared.get(model)
        return adapter.ref if adapter else None

    async def save(
        self,
        tenant: str,
        name: str,
        files: dict[str, bytes],
        *,
        fine_tuned: bool = False,
        job: str | None = None,
    ) -> Adapter:
        """Store the tenant's adapter `name`; `fine_tuned`: the fine-tuning service's model (an `ft:` name, which
        no upload may take), stored by `job` in the room it reserved."""
        if name in self.reserved or name in self.shared:
            raise APIError(409, f"the name {name!r} is taken by a model this server serves", param="name")
        if name.startswith(FINE_TUNED_PREFIX) and not fine_tuned:
            raise APIError(
                400, f"names starting with {FINE_TUNED_PREFIX!r} are fine-tuned models' (POST /v1/fine_tuning/jobs)",
                param="name",
            )  # fmt: skip
        own = await self.own(tenant)
        registry = await self.registry()
        if len(files) == 1 and next(iter(files)).lower().endswith(ARCHIVES):
            ((filename, data),) = files.items()
            save = functools.partial(registry.save, tenant, name, archive=data, filename=filename)
        else:
            save = functools.partial(registry.save, tenant, name, files)
        try:
            async with self._saving:
                room = await self.room(tenant, job)
                info = await anyio.to_thread.run_sync(functools.partial(save, room=room))
                own[name] = adapter = self._entry(info)
        except AdapterQuotaExceeded as e:
            raise APIError(
                400,
                f"{e}: this tenant's adapters may hold {self.max_bytes_per_tenant} bytes together "
                "(--adapters-max-bytes-per-tenant); delete some (DELETE /v1/adapters/{name})",
                param="name",
                code="storage_quota_exceeded",
            ) from None
        except AdapterExists:
            raise APIError(
                409,
                f"adapter {name!r} already exists with other files (uploading the same files again is fine): "
                f"delete it first (DELETE /v1/adapters/{name}) or upload under another name",
                param="name",
                code="adapter_exists",
            ) from None
        except AdapterError as e:
            status = 413 if isinstance(e, AdapterTooLarge) else 400
            raise APIError(status, str(e), code="invalid_adapter") from None
        except OSError as e:  # the disk is full or failing: the registry left nothing half-written
            raise storage_error(StorageFailure.from_os(e), "the adapter was not stored") from None
        return adapter

    async def add_fine_tuned(self, tenant: str, name: str, path: Path, job: str) -> Adapter:
        """A fine-tuning job's adapter directory (its model or a checkpoint) stored as the tenant's adapter `name`,
        in the room the job reserved: served, listed and deletable like an upload. Storing the same files again is
        a no-op."""

        def read() -> dict[str, bytes]:
            return {f: (path / f).read_bytes() for f in FILES}

        try:
            files = await anyio.to_thread.run_sync(read)
        except OSError as e:
            raise storage_error(StorageFailure.from_os(e), "the adapter was not stored") from None
        return await self.save(tenant, name, files, fine_tuned=True, job=job)

    async def load_from(self, tenant: str, name: str, path: str) -> Adapter:
        """Store, as the tenant's adapter `name`, the PEFT adapter directory `path` on the server (vLLM's
        /v1/load_lora_adapter): only from under the operator's --lora-load-dir directories (each file
        resolved and checked, then opened with no symlink followed: motet/lora/registry.py), validated and
        copied like an upload (so it survives a restart and its source may change later)."""
        if not self.load_dirs:
            raise APIError(
                403, "this server loads no adapters from its own disk (see --lora-load-dir)", "lora_path"
            )
        try:
            check_name("adapter", name)
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_name") from None
        read = functools.partial(read_server_adapter, path, self.load_dirs, self.max_bytes, "lora_path")
        try:
            data = await anyio.to_thread.run_sync(read)
        except AdapterPathRefused as e:
            raise APIError(403, str(e), param="lora_path") from None
        except AdapterTooLarge as e:
            raise APIError(413, str(e), param="lora_path") from None
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_path") from None
        return await self.save(tenant, name, data)

    async def delete(self, tenant: str, name: str) -> None:
        own = await self.own(tenant)
        if name not in own:
            if name in self.shared:
                raise APIError(403, f"adapter {name!r} is shared by the server and cannot be deleted")
            raise _not_found(name)
        registry = await self.registry()
        adapter = own.pop(name)  # out of the index first: no new request resolves it from now on
        try:
            await anyio.to_thread.run_sync(registry.delete, tenant, name)
        except AdapterNotFound:
            pass
        except BaseException:
            own[name] = adapter
            raise
        self.system.remove_lora(adapter.ref.name)
        for deleted in self.on_delete:
            await anyio.to_thread.run_sync(deleted, tenant, name)


def _size(path: Path) -> int:
    return sum((path / f).stat().st_size for f in FILES if (path / f).is_file())
