"""The installed distribution's version: `motet.__version__`, and what the API answers on /version and in its
OpenAPI document (which import it from here: the `motet` package itself imports the API's command)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("motet")
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0.0.0+unknown"
