"""No control of the server from another web page: the `Host` and `Origin` checks (an ASGI middleware).

A server without `--api-keys` (the quick start) would otherwise obey any page the operator's browser opens:
a cross-site `text/plain` or multipart POST needs no CORS preflight, and DNS rebinding points an attacker's
name at 127.0.0.1 so that its page reads the answers as same-origin (Ollama's CVE-2024-28224 is this class).
So, before a route runs:

- `Host` must be a name this server answers to: loopback names, any IP literal (rebinding needs a DNS
  name), the `--host` it listens on, this machine's hostname, or one in `--allowed-hosts` (`*`: any).
  Probes (`/health`, `/ping`, `/version`) are exempt: they hold no data, and orchestrators call them by
  whatever name they use.
- `Origin`, when a browser sends one, must be this server's own (scheme + the Host above) or in
  `--allowed-origins` (`*`: any); CORS headers are sent only for those listed (motet/api/server.py adds
  Starlette's CORSMiddleware then). Clients that are not browsers send no Origin and pass.

JSON bodies are refused unless sent as `application/json` (motet/api/request_body.py), so the simple
cross-site form/text posts fail there too.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from motet import json_input
from motet.api.asgi import request_headers
from motet.api.errors import APIError

PROBES = frozenset({"/health", "/ping", "/version"})
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _split_host(value: str) -> str:
    """The name of a Host header (`name[:port]`, `[v6]:port`), lower-cased, without the port."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value[1:]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def default_hosts(bind_host: str) -> set[str]:
    """The names a server listening on `bind_host` answers to by default (IP literals always pass)."""
    names = set(LOOPBACK_NAMES)
    if bind_host and not _is_ip(bind_host):
        names.add(bind_host.lower())
    hostname = socket.gethostname().lower()
    names |= {hostname, hostname.split(".", 1)[0]}
    return names


def flat_list(values, flag: str = "the flag") -> list[str]:
    """A flag's values; vLLM's form, one JSON list (`--allowed-origins '["*"]'`), is read too (a ValueError
    naming `flag` for a list that is not one of strings)."""
    out = []
    for v in values:
        if not v.strip().startswith("["):
            out.append(v)
            continue
        try:
            items = json_input.loads(v)
        except ValueError as e:
            raise ValueError(f"{flag} {v!r}: not a JSON list ({e})") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"{flag} {v!r}: a JSON list of strings is expected")
        out += items
    return out


def _origin(value: str) -> str:
    """An origin as compared: `scheme://host[:port]`, lower-cased, without a trailing slash."""
    return value.strip().rstrip("/").lower()


class OriginGuard:
    """Pure ASGI middleware: refuses (403, an OpenAI-style error naming the flag to set) a request whose
    Host or Origin is not allowed."""

    def __init__(self, app, bind_host: str, allowed_hosts=(), allowed_origins=()):
        self.app = app
        allowed_hosts, allowed_origins = flat_list(allowed_hosts), flat_list(allowed_origins)
        self.any_host = "*" in allowed_hosts
        self.hosts = default_hosts(bind_host) | {_split_host(h) for h in allowed_hosts if h != "*"}
        self.any_origin = "*" in allowed_origins
        self.origins = {_origin(o) for o in allowed_origins if o != "*"}

    def host_allowed(self, host: str) -> bool:
        name = _split_host(host)
        return self.any_host or _is_ip(name) or name in self.hosts or name.endswith(".localhost")

    def origin_allowed(self, origin: str, host: str, scheme: str) -> bool:
        origin = _origin(origin)
        if self.any_origin or origin in self.origins:
            return True
        parts = urlsplit(origin)  # same-origin: the page this server itself served
        return parts.scheme == scheme and parts.netloc == host.strip().lower() and self.host_allowed(host)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = request_headers(scope)
        host = headers.get("host", "")
        refusal = None
        if scope["path"] not in PROBES and host and not self.host_allowed(host):
            refusal = (
                "invalid_host",
                f"Host {host!r} is not a name this server answers to (a page that rebinds a DNS name to this "
                f"server is refused); start the server with --allowed-hosts {_split_host(host)} to allow it",
            )
        elif "origin" in headers and not self.origin_allowed(
            headers["origin"], host, scope.get("scheme", "http")
        ):
            refusal = (
                "invalid_origin",
                f"a request from the web page at Origin {headers['origin']!r} is refused (another site must "
                f"not control this server); start the server with --allowed-origins {headers['origin']} to "
                f"allow it",
            )
        if refusal is None:
            return await self.app(scope, receive, send)
        code, message = refusal
        await APIError(403, message, code=code).response()(scope, receive, send)
