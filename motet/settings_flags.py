"""Command-line flags that each set one field of a settings dataclass (EngineConfig, ClusterSettings): a flag's
default is its field's, and the parsed values go back into the fields by the same record, so a flag's name, its
default and where its value goes are written once (as vLLM derives its engine flags from EngineArgs)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


class SettingsFlags:
    """The flags of one settings class: `adder` declares them on a parser, `values` reads them back."""

    def __init__(self) -> None:
        self.fields: dict[str, str] = {}  # argparse dest -> the settings' field

    def adder(self, parser, settings: type) -> Callable[..., argparse.Action]:
        """`add(*names, field=None, **options)`: `parser.add_argument(*names, **options)` for a flag that sets
        `settings`' `field` (by default the flag's own name, its dashes underscores); its default is the field's
        unless `options` give one."""

        def add(*names: str, field: str | None = None, **options) -> argparse.Action:
            long = next(n for n in names if n.startswith("--"))
            dest = options.get("dest") or long[2:].replace("-", "_")
            field = field or dest
            if "default" not in options:  # (a field with a default_factory has no class attribute)
                options["default"] = getattr(settings, field)
            self.fields[dest] = field
            return parser.add_argument(*names, **options)

        return add

    def values(self, args: argparse.Namespace) -> dict:
        """{field: value} of every such flag `args` holds."""
        return {field: getattr(args, dest) for dest, field in self.fields.items() if hasattr(args, dest)}
