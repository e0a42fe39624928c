"""The server's own storage failing (a full disk, an I/O error), as clean API errors: 507 Insufficient Storage
when full, 503 for any other I/O failure, both with Retry-After (space may be freed, a disk may come back). What
counts as such a failure: motet/api/sqlite_store.py.
"""

from __future__ import annotations

import functools

import anyio.to_thread

from motet.api.errors import APIError
from motet.api.sqlite_store import StorageFailure

RETRY_AFTER_FULL_S = 30  # a full disk passes when the operator or the retention frees space: not at once


def storage_error(e: StorageFailure, what: str) -> APIError:
    """The answer to a request whose `what` failed on storage."""
    if e.full:
        return APIError(
            507,
            f"{what}: the server's storage is full ({e.cause})",
            code="storage_full",
            type="server_error",
            headers={"Retry-After": str(RETRY_AFTER_FULL_S)},
        )
    return APIError(503, f"{what}: the server's storage failed ({e.cause})", code="storage_unavailable")


async def stored_call(what: str, call, *args):
    """`call(*args)`, a store's call, in a worker thread; its storage failing is the answer `storage_error` makes
    (`what` says what failed)."""
    try:
        return await anyio.to_thread.run_sync(functools.partial(call, *args))
    except StorageFailure as e:
        raise storage_error(e, what) from None
