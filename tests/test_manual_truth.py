"""The manual's architecture pages cite only what exists (issue 60): every repository path, motet name and flag
that docs/DESIGN.md, docs/layout.md and docs/STYLE.md cite is in the code, so renaming a module, a class, a method
or a flag fails here until the page follows.

- paths: `motet/...`, `docs/...`, `tests/...`, `benchmarks/...`, `scripts/...`, `deploy/...` from the root; any
  other path with a folder (`engine/core/scheduler.py`, `api/state.py`, `engine/core/`) under `motet/`; a bare file
  or folder name (`decoder_weights.py`, `csrc/`, `DESIGN.md`) somewhere in the repository;
- names in backticks, and CamelCase names anywhere: a class, def or assignment of that name in motet/ (read with
  `ast`, nothing imported); `Class.member` a member of that class or of a base; `motet.x` a module; `motet <cmd>` a
  subcommand of the CLI; `--flag` a flag some motet parser declares; `NAME=value` an environment variable that
  motet's or the tests' Python names.

STYLE.md's anchor column (what vLLM, llama.cpp, ... do) is the peers', not motet's: it is left out.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("docs/DESIGN.md", "docs/layout.md", "docs/STYLE.md")
TOP = ("motet", "docs", "tests", "benchmarks", "scripts", "deploy")

# Cited on purpose and not motet's: the peers' names the pages compare motet with, projects, other tools' flags.
NOT_OURS = {
    "AsyncScheduler",  # vLLM's
    "EngineClient",  # vLLM's
    "anyio.to_thread",  # AnyIO's worker threads
    "EngineCoreRequest",  # vLLM's
    "OutputProcessor",  # vLLM's
    "Processor",  # vLLM's
    "StructuredOutputManager",  # vLLM's
    "GrammarCompiler",  # xgrammar's
    "GrammarMatcher",  # xgrammar's
    "build_attn",  # llama.cpp's graph builders
    "build_ffn",
    "punica",  # the unrelated PyPI package DESIGN.md warns against
    "DeepSeek",  # a model family's name
    "GeeeekExplorer",  # nano-vllm's owner on GitHub
    "MkDocs",  # the manual's builder
    "llama.cpp",  # the project, not a file
    "ggml-org/llama.cpp",  # its repository
    "--no-deps",  # pip's
    "--strict",  # mkdocs'
}

CODE = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"```.*?```", re.DOTALL)
CAMEL = re.compile(r"(?<![\w.])([A-Z][a-z0-9]+(?:[A-Z][a-z0-9]+)+(?:\.\w+)?)")
PATH = re.compile(r"(?<![\w./<-])((?:[\w.-]+/)+[\w.-]*)")
FILE = re.compile(r"(?<![\w./-])([\w-]+\.(?:py|md|h|cpp|sh|toml|yml))(?![\w/])")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*\*?)")
EXTENSIONS = (".py", ".md", ".h", ".cpp", ".sh", ".toml", ".yml")


def page_text(page: str) -> str:
    """The page, less STYLE.md's anchor column (a table row's second cell)."""
    lines = (ROOT / page).read_text().splitlines()
    if page.endswith("STYLE.md"):
        lines = [
            "|".join(cells[:2] + cells[3:]) if len(cells := line.split("|")) == 5 else line for line in lines
        ]
    return "\n".join(lines)


# -- what motet has -----------------------------------------------------------------------------------------------
class Index:
    """motet/'s names as its source declares them (no import)."""

    def __init__(self):
        self.classes: dict[
            str, list[tuple[list[str], set[str]]]
        ] = {}  # name -> (bases, members) per definition
        self.names: set[str] = (
            set()
        )  # defs, classes, assigned names and attributes, arguments, identifier strings
        self.flags: set[str] = set()
        self.commands: set[str] = set()
        for path in (ROOT / "motet").rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                self._visit(node)

    def _visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.ClassDef):
            members = set().union(*(bound(item) for item in node.body))
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
            self.classes.setdefault(node.name, []).append((bases, members))
        self.names |= bound(node)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            self.names |= {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x}
        elif isinstance(node, ast.keyword) and node.arg:
            self.names.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith("--"):
                self.flags.add(node.value)
            elif node.value.isidentifier():
                self.names.add(node.value)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_parser" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                self.commands.add(first.value)

    def members(self, cls: str, seen: frozenset = frozenset()) -> set[str]:
        """The members a class defines or inherits from a motet base."""
        out: set[str] = set()
        for bases, members in self.classes.get(cls, ()):
            out |= members
            for base in bases:
                if base not in seen:
                    out |= self.members(base, seen | {cls})
        return out


def bound(node: ast.AST) -> set[str]:
    """The names a statement defines: a def or class, an assignment's targets (names and attributes)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        targets = [node.target]
    out = set()
    for target in targets:
        for t in ast.walk(target):
            if isinstance(t, ast.Name):
                out.add(t.id)
            elif isinstance(t, ast.Attribute):
                out.add(t.attr)
    return out


@functools.cache
def index() -> Index:
    return Index()


@functools.cache
def repository_names() -> frozenset[str]:
    """Every file and folder name in the repository's own folders, and the root's."""
    names = {p.name for p in ROOT.iterdir()}
    for top in TOP:
        names |= {p.name for p in (ROOT / top).rglob("*") if "__pycache__" not in p.parts}
    return frozenset(names)


# -- the checks ---------------------------------------------------------------------------------------------------
def path_exists(cited: str) -> bool:
    path = cited.rstrip("/")
    if path.split("/")[0] in TOP:
        return (ROOT / path).exists()
    if "/" in path:
        return (ROOT / "motet" / path).exists()
    return path in repository_names()


def name_exists(cited: str) -> bool:
    """A name cited in backticks (or a CamelCase one anywhere): True where motet defines it."""
    idx = index()
    name = cited.removesuffix("()")
    if name.startswith("motet."):
        module = ROOT / name.removesuffix(".*").replace(".", "/")
        return module.is_dir() or module.with_suffix(".py").is_file()
    head, _, member = name.partition(".")
    if head in idx.classes and member:
        return member in idx.members(head)
    if head[:1].isupper() and not member:
        return head in idx.classes or head in idx.names
    return all(part in idx.names for part in name.split("."))


def flag_exists(flag: str) -> bool:
    flags = index().flags
    if flag.endswith("*"):
        return any(f.startswith(flag[:-1]) for f in flags)
    return flag in flags or (flag.startswith("--no-") and f"--{flag[5:]}" in flags)


def cited_paths(text: str) -> set[str]:
    paths = {p.rstrip(".") for p in PATH.findall(text)}
    paths = {p for p in paths if p.endswith("/") or p.endswith(EXTENSIONS)}
    return (paths | set(FILE.findall(text))) - NOT_OURS


def cited_names(text: str) -> set[str]:
    """Backticked spans that are code names (identifiers, dotted or called); CamelCase names outside backticks."""
    names = set()
    for span in CODE.findall(text):
        if (
            re.fullmatch(r"[A-Za-z_][\w.]*(\(\))?(\.\*)?", span)
            and "/" not in span
            and not span.endswith(EXTENSIONS)
        ):
            names.add(span)
    names |= set(CAMEL.findall(CODE.sub("", text)))
    return names - NOT_OURS


def cited_environment(text: str) -> set[str]:
    """Environment variables set in backticks (`NAME=value`)."""
    return {m[1] for span in CODE.findall(text) if (m := re.fullmatch(r"([A-Z][A-Z0-9_]+)=\S+", span))}


def environment_exists(name: str) -> bool:
    """Some Python file of motet's or of the tests' reads or sets it (by its name in quotes)."""
    files = [*(ROOT / "motet").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    return any(f'"{name}"' in f.read_text() for f in files)


def cited_commands(text: str) -> set[str]:
    return {m[1] for span in CODE.findall(text) if (m := re.fullmatch(r"motet ([a-z-]+)", span))}


def cited_flags(text: str) -> set[str]:
    return set(FLAG.findall(text)) - NOT_OURS


def missing(find, exists) -> dict[str, list[str]]:
    out = {}
    for page in PAGES:
        gone = sorted(c for c in find(page_text(page)) if not exists(c))
        if gone:
            out[page] = gone
    return out


def test_every_cited_path_exists():
    assert sum(len(cited_paths(page_text(p))) for p in PAGES) > 60  # (the extraction still finds the paths)
    assert missing(cited_paths, path_exists) == {}


def test_every_cited_name_exists():
    assert sum(len(cited_names(page_text(p))) for p in PAGES) > 60
    assert missing(cited_names, name_exists) == {}


def test_every_cited_flag_command_and_variable_exists():
    assert missing(cited_flags, flag_exists) == {}
    assert missing(cited_environment, environment_exists) == {}
    assert missing(cited_commands, lambda c: c in index().commands) == {}
    assert {"serve", "pull", "generate", "eval", "run-batch", "fine-tune"} <= index().commands


def test_the_pages_name_every_grammar_backend():
    """Where DESIGN.md and layout.md list the grammar backends, each one motet has is there (llguidance was not)."""
    from motet.grammar.specs import BACKEND_NAMES

    design = page_text("docs/DESIGN.md")
    listed = {
        "docs/DESIGN.md": design[design.index("**Structured output**") :].split("\n- ")[0],
        "docs/layout.md": next(
            line for line in page_text("docs/layout.md").splitlines() if line.startswith("grammar/")
        ),
    }
    assert {page: [b for b in BACKEND_NAMES if b not in text] for page, text in listed.items()} == {
        page: [] for page in listed
    }


def test_a_renamed_module_class_member_or_flag_would_fail():
    """The checks themselves: what the pages cite passes, the same citation after a rename does not."""
    assert path_exists("engine/core/scheduler.py") and not path_exists("engine/core/schedule.py")
    assert path_exists("motet/models/") and not path_exists("motet/model/")
    assert path_exists("decoder_weights.py") and not path_exists("decoder_weight.py")
    assert name_exists("RowPlan") and not name_exists("RowPlans")
    assert name_exists("OutputDelta.merge") and not name_exists("OutputDelta.merged")
    assert name_exists("LLMEngine.step()") and not name_exists("LLMEngine.steps()")
    assert name_exists("motet.engine") and not name_exists("motet.engines")
    assert flag_exists("--replicas") and flag_exists("--grammar-max-*") and not flag_exists("--replica")
    assert cited_names("`Foo.bar` and FooBar") == {"Foo.bar", "FooBar"}
    assert cited_paths("see api/state.py, `engine/core/` and docs/layout.md.") == {
        "api/state.py",
        "engine/core/",
        "docs/layout.md",
    }
