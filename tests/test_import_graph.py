"""motet's import graph, read from the source with `ast`: every import counts, those under `if TYPE_CHECKING:` and
those inside functions included (import-linter leaves out the first: `exclude_type_checking_imports`). A circle
means a type lives in the wrong module: move it to a leaf both sides import, rather than hiding the import."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "motet"
# The longest chain of imports among motet.api's own modules today (cli -> server -> app -> a route family -> streams
# -> state -> ...; 17 before issue 60, which asks for at most 8). It may shrink, never grow.
API_FLOORS = 10


def modules() -> dict[str, tuple[Path, bool]]:
    """Each module's dotted name: its file, and whether it is a package's __init__."""
    found = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    """Each module's imports of motet's modules (`from a import b` names a.b where b is a module, else a)."""
    mods = modules()

    def nearest(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, package) in mods.items():
        here = name if package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [nearest(a.name) for a in node.names if a.name.split(".")[0] == PACKAGE]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join([*base, node.module] if node.module else base)
                else:
                    source = node.module or ""
                if source.split(".")[0] != PACKAGE:
                    continue
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in mods else nearest(source)
                    for a in node.names
                ]
            else:
                continue
            edges[name].update(t for t in targets if t is not None and t != name)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def longest_chain(edges: dict[str, set[str]], within: str) -> tuple[str, ...]:
    """The longest chain of imports among the modules under `within` (the graph has no circle)."""
    inside = {m for m in edges if m == within or m.startswith(within + ".")}
    assert not [c for c in circles(edges) if inside.intersection(c)], "a circle has no longest chain"

    @functools.cache
    def chain(m: str) -> tuple[str, ...]:
        return (m, *max((chain(n) for n in edges[m] & inside), key=len, default=()))

    return max((chain(m) for m in inside), key=len)


def test_graph_sees_every_kind_of_import():
    edges = graph()
    # under `if TYPE_CHECKING:` (api/billing.py names the reply streams it reads)
    assert "motet.actors.reply" in edges["motet.api.billing"]
    # inside a function (motet.serve imports the command when called)
    assert "motet.api.cli" in edges["motet"]
    # `from motet.api import rate_limits` names the module, not the package
    assert "motet.api.rate_limits" in edges["motet.api.billing"]


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    assert circles(graph()) == []


def test_api_depth():
    chain = longest_chain(graph(), "motet.api")
    assert len(chain) <= API_FLOORS, f"motet.api is {len(chain)} floors deep: {' -> '.join(chain)}"
