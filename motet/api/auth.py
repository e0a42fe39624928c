"""Bearer API keys from a JSON file; none configured: auth off.

Each key maps to a tenant name (`"sk-...": "tenant-a"`), or to an object naming its rights:
`{"tenant": "ops", "admin": true}` (a tenant key that also reads /metrics) or `{"admin": true}` (reads
/metrics only: what Prometheus scrapes with); a tenant's keys may also say `"limits"` (motet/api/rate_limits.py)
and `"priority_class": "batch"` (its requests are batch work, which yields to interactive requests, as the
Batch API's lines and `service_tier: "flex"` do; "interactive" is the default). /metrics names every tenant's adapters and per-tenant
figures, so under auth only admin keys read it (and `GET /v1/usage`, every tenant's usage); a tenant key gets
403 there.

A request's key is found in one dictionary lookup, by its SHA-256 digest: the work per request does not grow
with the keys (10,000 of them cost what 2 do), and a lookup's timing can only tell digests apart, which
leaks nothing of a key. A tenant's own key, which the Batch API's lines are sent with, is one lookup too.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from motet import json_input

log = logging.getLogger("motet.api")

_LIMIT_FIELDS = {
    "max_concurrent_requests": "max_concurrent",
    "requests_per_minute": "rpm",
    "tokens_per_minute": "tpm",
}
MAX_LIMIT = 10**15  # past this a limit is a typo (and no longer exact as the float a bucket holds)


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's limits as its keys say them (`"limits"`); motet/api/rate_limits.py enforces them."""

    max_concurrent: int | None = None
    rpm: int | None = None
    tpm: int | None = None

    @classmethod
    def parse(cls, where: str, value) -> TenantLimits:
        if not isinstance(value, dict) or set(value) - set(_LIMIT_FIELDS):
            raise ValueError(
                f"{where}: limits is an object of {', '.join(_LIMIT_FIELDS)}, got {json.dumps(value)[:80]}"
            )
        for key, v in value.items():
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_LIMIT:
                raise ValueError(
                    f"{where}: limits.{key} must be an integer from 1 to {MAX_LIMIT}, got {json.dumps(v)[:40]}"
                )
        return cls(**{_LIMIT_FIELDS[k]: v for k, v in value.items()})


DEFAULT_TENANT = "default"
_KEY_FIELDS = {"tenant", "admin", "limits", "priority_class"}
PRIORITY_CLASSES = ("interactive", "batch")
MAX_KEYS_FILE_BYTES = 256 << 20  # a million keys with limits; read again on each SIGHUP


@dataclass(frozen=True)
class Principal:
    """Who a key speaks for: a tenant (None: an admin-only key), whether it reads /metrics, the tenant's
    limits (motet/api/rate_limits.py; None: none) and its priority class (PRIORITY_CLASSES)."""

    tenant: str | None
    admin: bool = False
    limits: TenantLimits | None = None
    priority_class: str = "interactive"

    @property
    def background(self) -> bool:
        """Whether the tenant's requests are batch work."""
        return self.priority_class == "batch"


def _tenant(where: str, name: str) -> str:
    """A tenant's name, refused unless its adapters' store can hold it (motet/lora/names.py's rule: a tenant's
    adapters and fine-tuned models are stored under its name)."""
    from motet.lora.names import check_name

    try:
        return check_name("tenant", name)
    except ValueError as e:
        raise ValueError(
            f"{where}: {e} (its adapters and fine-tuned models are stored under its name)"
        ) from None


def _principal(where: str, value) -> Principal:
    if isinstance(value, str) and value:
        return Principal(_tenant(where, value))
    if isinstance(value, dict) and value and set(value) <= _KEY_FIELDS:
        tenant, admin = value.get("tenant"), value.get("admin", False)
        tenant_ok = tenant is None or (isinstance(tenant, str) and tenant)
        if tenant_ok and isinstance(admin, bool) and (tenant is not None or admin):
            if tenant is not None:
                _tenant(where, tenant)
            limits = TenantLimits.parse(where, value["limits"]) if "limits" in value else None
            if limits is not None and tenant is None:
                raise ValueError(f"{where}: limits belong to a tenant; an admin-only key has none")
            priority_class = value.get("priority_class", "interactive")
            if priority_class not in PRIORITY_CLASSES or (tenant is None and "priority_class" in value):
                raise ValueError(
                    f"{where}: priority_class is a tenant's, one of {', '.join(PRIORITY_CLASSES)}; got "
                    f"{json.dumps(priority_class)[:40]}"
                )
            return Principal(tenant, admin, limits, priority_class)
    raise ValueError(
        f'{where}: each key maps to a tenant name, or to {{"tenant": NAME, "admin": true, "limits": {{...}}, '
        f'"priority_class": "interactive" | "batch"}} / '
        f'{{"admin": true}} (an admin key reads /metrics), got {json.dumps(value)[:80]}'
    )


def refused(status: int, message: str, code: str):
    """The API's error for a key refused (401) or of the wrong kind (403). motet/api/errors.py is imported on first
    use: `motet serve` reads the keys file before its port answers, before the API's modules are imported."""
    from motet.api.errors import APIError

    return APIError(status, message, code=code)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Authenticator:
    def __init__(self, keys: dict[str, str | dict] | None = None, *, where: str = "API keys"):
        self._keys: dict[str, Principal] = {}
        self._by_digest: dict[bytes, Principal] = {}  # what a request's key is looked up in
        self._tenant_keys: dict[str, str] = {}  # each tenant's first key
        for key, value in (keys or {}).items():
            self.add(key, _principal(where, value))

    @property
    def keys(self):
        """key -> Principal, read only (`add` keeps the lookups beside it)."""
        return MappingProxyType(self._keys)

    def add(self, key: str, principal: Principal) -> None:
        self._keys[key] = principal
        self._by_digest[_digest(key)] = principal
        if principal.tenant is not None:
            self._tenant_keys.setdefault(principal.tenant, key)

    def key_of(self, tenant: str) -> str | None:
        """One of `tenant`'s keys (the first in the file); None: it has none."""
        return self._tenant_keys.get(tenant)

    @classmethod
    def from_file(cls, path: str | Path | None) -> Authenticator:
        if path is None:
            log.warning(
                "authentication is OFF: no --api-keys file; every request is tenant %r and /metrics is open",
                DEFAULT_TENANT,
            )
            return cls()
        try:  # a regular file only (a FIFO would wait for a writer), bounded, nested as a request body may be
            keys = json_input.load_file(path, MAX_KEYS_FILE_BYTES)
        except ValueError as e:
            raise ValueError(f"--api-keys {path}: cannot read a JSON object of key -> tenant ({e})") from None
        if not isinstance(keys, dict):
            raise ValueError(f"--api-keys {path}: must be a JSON object mapping each key to a tenant name")
        if not keys:
            raise ValueError(f"--api-keys {path}: holds no keys")
        auth = cls(keys, where=f"--api-keys {path}")
        limited = auth.tenant_limits()  # a tenant whose keys disagree is refused here
        tenants = {p.tenant for p in auth.keys.values() if p.tenant is not None}
        admins = sum(p.admin for p in auth.keys.values())
        log.info(
            "authentication is on: %d keys, %d tenants (%d with limits), %d admin keys",
            len(keys), len(tenants), len(limited), admins,
        )  # fmt: skip
        if not admins:
            log.warning("no admin key in --api-keys: GET /metrics and GET /v1/usage answer 403 to every key")
        return auth

    def tenant_limits(self) -> dict[str, TenantLimits]:
        """Each tenant's limits; its keys must not disagree."""
        out: dict[str, TenantLimits] = {}
        for p in self.keys.values():
            if p.tenant is None or p.limits is None:
                continue
            if out.setdefault(p.tenant, p.limits) != p.limits:
                raise ValueError(f"tenant {p.tenant!r}: its keys give different limits; give them once")
        return out

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def principal(self, authorization: str | None) -> Principal:
        """The key's principal; 401 when it is missing or unknown (auth on)."""
        if not self.enabled:
            return Principal(DEFAULT_TENANT, admin=True)
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise refused(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        found = self._by_digest.get(_digest(key.strip()))
        if found is None:
            raise refused(401, "invalid API key", code="invalid_api_key")
        return found

    def tenant(self, authorization: str | None) -> str:
        return self.caller(authorization).tenant

    def caller(self, authorization: str | None) -> Principal:
        """The principal of a tenant's key; 403 for an admin-only key."""
        principal = self.principal(authorization)
        if principal.tenant is None:
            raise refused(
                403,
                "this API key is an admin key: it reads /metrics and /v1/usage, and makes no requests of a "
                "tenant; use a tenant's key",
                code="admin_key",
            )
        return principal

    def check_admin(self, authorization: str | None, route: str) -> None:
        """401 without a valid key, 403 naming `route` (what was asked, e.g. "GET /v1/usage") for a tenant's key
        (auth on); nothing to check with auth off."""
        if not self.principal(authorization).admin:
            raise refused(
                403,
                f'{route} needs an admin key (an --api-keys entry with "admin": true); this key is a tenant\'s',
                code="admin_key_required",
            )
