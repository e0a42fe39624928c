"""Bearer API keys mapped to tenants, from a JSON file {"key": "tenant"}; none configured: auth off."""

from __future__ import annotations

import hmac
import json
import logging
from pathlib import Path

from motet.api.errors import APIError

log = logging.getLogger("motet.api")

DEFAULT_TENANT = "default"


class Authenticator:
    def __init__(self, keys: dict[str, str] | None = None):
        self.keys = dict(keys or {})

    @classmethod
    def from_file(cls, path: str | Path | None) -> Authenticator:
        if path is None:
            log.warning(
                "authentication is OFF: no --api-keys file; every request is tenant %r", DEFAULT_TENANT
            )
            return cls()
        try:
            keys = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--api-keys {path}: cannot read a JSON object of key -> tenant ({e})") from None
        if not isinstance(keys, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in keys.items()
        ):
            raise ValueError(f"--api-keys {path}: must be a JSON object mapping each key to a tenant name")
        if not keys:
            raise ValueError(f"--api-keys {path}: holds no keys")
        log.info("authentication is on: %d keys, %d tenants", len(keys), len(set(keys.values())))
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def tenant(self, authorization: str | None) -> str:
        if not self.enabled:
            return DEFAULT_TENANT
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        for known, tenant in self.keys.items():  # constant-time compare: no key prefix leaks by timing
            if hmac.compare_digest(known.encode(), key.strip().encode()):
                return tenant
        raise APIError(401, "invalid API key", code="invalid_api_key")
