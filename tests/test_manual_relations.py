"""The relations the manual states, held to the code (tests/test_manual_truth.py checks that the names it cites
exist; this checks what it says of them). `lint-imports` keeps the rest (pyproject.toml's contracts: the layers, the
route families side by side, the API's one door by import).

- the thread rule (docs/DESIGN.md, "Layout"): the modules that start a thread or a process are the ones the manual
  lists, and only the async packages borrow AnyIO's worker threads;
- the one door (docs/DESIGN.md, "The front"): the API calls nothing on a serving system but `ServingFront`'s members,
  but where the start-up builds one;
- a refusal's status decided in one place (docs/layout.md): no module but actors/serving_errors.py builds a 400 or a
  404 of the actors;
- the request's walk (docs/layout.md) has the stops and files docs/STYLE.md counts;
- test-only hooks stay in tests (docs/STYLE.md): no function or method of motet/ is named by tests and by no product
  code, but the ones named here.

Everything is read with `ast` (nothing of motet is imported).
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOTET = ROOT / "motet"


@functools.cache
def modules() -> dict[str, ast.Module]:
    """motet's modules by path under motet/ ("actors/executor.py")."""
    return {
        p.relative_to(MOTET).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(MOTET.rglob("*.py"))
    }


def dotted(node: ast.AST) -> str:
    """A call's function as written: `threading.Thread`, `anyio.to_thread.run_sync`, `HelperProcess`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return ""


def page(name: str) -> str:
    return (ROOT / "docs" / name).read_text()


# -- the thread rule ----------------------------------------------------------------------------------------------
THREAD_CALLS = {
    "Thread",
    "Timer",
    "ThreadPoolExecutor",
    "LLExecutor",
}  # (LLExecutor: llguidance's own threads)
PROCESS_CALLS = {"Popen", "ProcessPoolExecutor", "HelperProcess"}  # (HelperProcess: motet's own Popen)
PROCESS_MODULES = {
    "subprocess",
    "multiprocessing",
    "mp",
}  # any call of theirs: run, check_output, Process, Pool
PROCESS_FUNCTIONS = {"anyio.open_process", "anyio.run_process", "asyncio.create_subprocess_exec",
                     "asyncio.create_subprocess_shell", "os.fork", "os.forkpty", "os.system", "os.popen",
                     "os.posix_spawn", "os.posix_spawnp"}  # fmt: skip


def thread_classes() -> set[str]:
    """motet's own subclasses of threading.Thread (a call of one starts a thread, as `Thread(...)` does)."""
    return {
        node.name
        for tree in modules().values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(dotted(b).split(".")[-1] == "Thread" for b in node.bases)
    }


def starters() -> tuple[set[str], set[str]]:
    """The modules that start threads, and those that start processes: a call of a threading or subprocess
    primitive, of motet's own `HelperProcess` (a Popen of its own) or of a Thread subclass of motet's, or the
    definition of such a subclass (whose `run` is the thread's work)."""
    own_threads = thread_classes()
    threads, processes = set(), set()
    for path, tree in modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name in own_threads:
                threads.add(path)
            if not isinstance(node, ast.Call):
                continue
            name = dotted(node.func)
            last = name.split(".")[-1]
            if last in THREAD_CALLS or last in own_threads:
                threads.add(path)
            elif last in PROCESS_CALLS or name.split(".")[0] in PROCESS_MODULES or name in PROCESS_FUNCTIONS:
                processes.add(path)
    return threads, processes


def listed(kind: str) -> set[str]:
    """The modules DESIGN.md's list item `- {kind}: ...` names (its paths under motet/)."""
    text = page("DESIGN.md")
    item = re.search(rf"^- {kind}: (.*?)(?=^- |^$)", text, re.MULTILINE | re.DOTALL)
    assert item, f"docs/DESIGN.md has no '- {kind}:' item"
    return set(re.findall(r"`([\w/]+\.py)`", item.group(1)))


def test_the_modules_that_start_threads_and_processes_are_the_ones_the_manual_lists():
    """DESIGN.md: "A thread or a process lives in the module whose work it does, which starts it ... These are all
    of them". A new thread (or process) is either in a listed module or named in the list with its work."""
    threads, processes = starters()
    assert threads == listed("threads"), (
        "docs/DESIGN.md's threads list differs from the code: "
        f"starting a thread, not listed: {sorted(threads - listed('threads'))}; "
        f"listed, starting none: {sorted(listed('threads') - threads)}"
    )
    assert processes == listed("processes"), (
        "docs/DESIGN.md's processes list differs from the code: "
        f"starting a process, not listed: {sorted(processes - listed('processes'))}; "
        f"listed, starting none: {sorted(listed('processes') - processes)}"
    )


def test_only_the_async_packages_borrow_anyios_worker_threads():
    """DESIGN.md: "the async packages (`actors/`, `api/`, `cluster/`) run blocking calls on AnyIO's worker threads"."""
    stated = re.search(r"the async packages\s+\(((?:`\w+/`(?:,\s+)?)+)\)", page("DESIGN.md"))
    assert stated, "DESIGN.md no longer names the async packages"
    packages = set(re.findall(r"`(\w+)/`", stated.group(1)))
    borrowing = {
        path
        for path, tree in modules().items()
        if any(isinstance(n, ast.Attribute) and n.attr == "to_thread" for n in ast.walk(tree))
    }
    assert borrowing and {p.split("/")[0] for p in borrowing} <= packages, sorted(borrowing)


# -- the one door -------------------------------------------------------------------------------------------------
def front_members() -> set[str]:
    (front,) = (
        n
        for n in ast.walk(modules()["actors/front.py"])
        if isinstance(n, ast.ClassDef) and n.name == "ServingFront"
    )
    return {n.name for n in front.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def start_up_modules() -> set[str]:
    """The API's modules that build a serving system or an engine: those the one-door contract (pyproject.toml)
    lets import one."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (door,) = (c for c in contracts if c["name"].startswith("the API's one door"))
    return {
        rule.split(" -> ")[0].removeprefix("motet.").replace(".", "/") + ".py"
        for rule in door["ignore_imports"]
    }


def test_the_api_calls_nothing_on_a_serving_system_but_the_front():
    """DESIGN.md, "The front": the API sees a serving system only through `ServingFront`: every attribute the
    API reads of a `system` (`state.system.X`, `self.system.X`) is one of the front's members."""
    members, start_up = front_members(), start_up_modules()
    assert start_up and "submit_all" in members
    used: Counter[str] = Counter()
    stray = []
    for path, tree in modules().items():
        if not path.startswith("api/") or path in start_up:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Name) and node.value.id == "system")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "system")
            ):
                used[node.attr] += 1
                if node.attr not in members:
                    stray.append(f"motet/{path}:{node.lineno} system.{node.attr}")
    assert not stray, stray
    # what layout.md's walk says the routes call
    assert used["submit_all"] and not used["submit"]


# -- refusals -----------------------------------------------------------------------------------------------------
def test_a_requests_refusal_is_built_in_serving_errors_only():
    """layout.md: a request refused for what it is has its status decided in actors/serving_errors.py wherever
    the refusal is found (`request_refusal`, `model_not_found`): no other module builds the actors' 400 or 404."""
    built = {
        f"motet/{path}:{node.lineno}"
        for path, tree in modules().items()
        if path != "actors/serving_errors.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and dotted(node.func).split(".")[-1] in ("InvalidRequest", "ModelNotFound")
    }
    assert not built, sorted(built)


# -- the walk -----------------------------------------------------------------------------------------------------
def test_styles_count_of_the_request_path_is_layouts_walk():
    walk = (
        page("layout.md").split("## A chat request, from the route to the sampled token")[1].split("```")[1]
    )
    stops = [line.split()[0] for line in walk.splitlines() if line.strip() and not line.startswith(" ")]
    files = set(re.findall(r"(?<![\w./])((?:\w+/)+\w+\.py)", walk))
    for path in files:
        assert (MOTET / path).is_file(), path
    said = re.search(
        r"(\d+) stops, a file each, and `engine/speculative/` .*?, (\d+) files named along them",
        page("STYLE.md"),
    )
    assert said, "STYLE.md's request path row no longer counts the walk"
    assert stops[-1] == "engine/speculative/"
    assert (int(said.group(1)), int(said.group(2))) == (len(stops) - 1, len(files))


# -- test-only hooks ----------------------------------------------------------------------------------------------
# Named by tests and by no product code, kept on purpose: each kernel's torch reference sits beside it (DESIGN.md,
# "Kernels"), and the two below are the borderline ones a module's own interface keeps.
KEPT = {
    "actors/runtime.py Actor.tell",  # the actors' blocking send, beside tell_nowait (which the product uses)
    "grammar/cache.py GrammarCache.overrunning",  # the count `_overrunning` reads under the cache's lock
}


def names_in(top: Path) -> Counter[str]:
    """Every name a tree's Python reads: names, attributes, imports, identifier strings (getattr, dispatch)."""
    out: Counter[str] = Counter()
    for path in top.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Name):
                out[node.id] += 1
            elif isinstance(node, ast.Attribute):
                out[node.attr] += 1
            elif isinstance(node, ast.alias):
                out[node.name.split(".")[-1]] += 1
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
                out[node.value] += 1
    return out


def test_no_product_function_is_only_the_tests():
    """STYLE.md: test-only hooks stay in tests. A function or method of motet/ that tests call and no product
    code names (its definition aside) belongs in tests/."""
    product, tests = names_in(MOTET), names_in(ROOT / "tests")
    native = Counter(
        re.findall(
            r"\w+", " ".join(p.read_text() for p in MOTET.rglob("*.[ch]*") if p.suffix in (".h", ".cpp"))
        )
    )
    found = []
    for path, tree in modules().items():
        defs = [(None, n) for n in tree.body]
        defs += [(c.name, n) for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
        for cls, node in defs:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("__"):
                continue
            name = node.name
            if product[name] or native[name] or not tests[name]:
                continue
            where = f"{path} {cls + '.' if cls else ''}{name}"
            if where in KEPT or (path.startswith("kernels/") and name.endswith("_reference")):
                continue
            found.append(where)
    assert not found, f"product functions only tests use (move them into tests/): {found}"
