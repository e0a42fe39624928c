"""Issue 65 ("start-up that does only what it needs") and issue 68 item 17: the command line imports what a command
uses, when it uses it. Building `motet serve`'s parser once pulled torch, transformers, xgrammar and more in
(motet/api/cli.py took its flags' defaults from motet/engine/config.py, which imported torch): `motet serve --help`
took 3.4-6 s of CPU. Now the parser, `--help`, `--version` and the checks `motet serve` makes before it binds its
port (the model's config, the flags against it and the memory: motet/api/server.py `check_model`) import none of
the heavy libraries; what each imported is read from a fresh interpreter's `sys.modules` or `-X importtime`, never
from a clock."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

from tests.live_server import ROOT

# What a parser, a help text or the model's config never needs: the engine's libraries and the server's.
HEAVY = ("torch", "transformers", "xgrammar", "ray", "starlette", "uvicorn", "llguidance", "outlines_core")


def imported_by(code: str) -> dict:
    """Runs `code` in a fresh interpreter (as the `motet` command starts); what it printed as JSON (its last line),
    with the heavy packages it imported under "heavy"."""
    wrapper = (
        "import json, sys\n"
        + code
        + f"\nprint(json.dumps({{'heavy': sorted(m for m in {HEAVY!r} if m in sys.modules)"
        ", 'out': globals().get('out')}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", wrapper], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def imported_modules(importtime_stderr: str) -> set[str]:
    """The modules `python -X importtime` reports (one line each: `import time: self | cumulative | name`)."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in importtime_stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


@pytest.mark.parametrize("argv", [["serve", "--help"], ["--help"], ["--version"], ["fine-tune", "--help"],
                                  ["generate", "--help"], ["run-batch", "--help"], ["cache", "--help"]])  # fmt: skip
def test_help_and_version_import_no_heavy_library(argv):
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "motet.api.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    modules = imported_modules(done.stderr)
    assert "motet.flag_types" in modules  # (the report is read: the parser's modules are in it)
    top = {m.split(".")[0] for m in modules}
    assert not top & set(HEAVY), sorted(top & set(HEAVY))
    if argv == ["--version"]:  # the installed distribution's version, as pip reports it
        assert done.stdout.strip() == f"motet {importlib.metadata.version('motet')}"
    if argv == ["serve", "--help"]:  # the parser was built: every flag is there
        assert "--gpu-memory-utilization" in done.stdout and "--fine-tuning-max-running" in done.stdout


def test_every_parser_and_its_defaults_import_no_heavy_library():
    found = imported_by(
        "from motet.api.cli import build_parser\n"
        "parser = build_parser()\n"
        "args = parser.parse_args(['serve'])\n"
        "out = {'max_num_seqs': args.max_num_seqs, 'block_size': args.block_size, 'dtype': args.dtype,"
        " 'quantization': parser._subparsers._group_actions[0].choices['serve']._option_string_actions"
        "['--quantization'].choices}"
    )
    assert found["heavy"] == []
    from motet.engine.config import QUANTIZATIONS, EngineConfig

    # the defaults still come from EngineConfig (one place), and the choices from the formats' own lists
    assert found["out"]["max_num_seqs"] == EngineConfig.max_num_seqs
    assert found["out"]["block_size"] == EngineConfig.block_size
    assert found["out"]["dtype"] == "auto"
    from motet.engine.weights.quantized_checkpoint import iter_checkpoint_weights  # noqa: F401 (its module loads)
    from motet.kernels.quant import FORMATS

    assert tuple(found["out"]["quantization"]) == QUANTIZATIONS
    assert set(FORMATS) < set(QUANTIZATIONS) and {"gguf", "gptq", "awq"} < set(QUANTIZATIONS)


def test_the_checks_before_the_port_is_bound_import_no_heavy_library(tiny_model_dir):
    """`motet serve`'s refusals that the config decides (the model, the flags against it, the memory) run before
    it binds its port: they must not wait for torch. The same check refuses what it refused (a KV cache over the
    memory), and finds the model's context length as the engine does."""
    found = imported_by(
        "from motet.api.cli import build_parser, engine_config\n"
        "from motet.api.server import check_model\n"
        f"args = build_parser('serve').parse_args(['serve', '--model', {str(tiny_model_dir)!r}])\n"
        "config = engine_config(args)\n"
        "model_dir, max_len = check_model(config)\n"
        "try:\n"
        f"    check_model(engine_config(build_parser('serve').parse_args(['serve', '--model', {str(tiny_model_dir)!r},"
        " '--kv-cache-memory-gb', '100000'])))\n"
        "    refused = None\n"
        "except ValueError as e:\n"
        "    refused = str(e)\n"
        "out = {'max_len': max_len, 'dtype': config.dtype, 'refused': refused}"
    )
    assert found["heavy"] == []
    from transformers import AutoConfig

    assert found["out"]["max_len"] == AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings
    assert found["out"]["dtype"] in ("float32", "bfloat16")
    assert "--kv-cache-memory-gb 100000 asks for" in found["out"]["refused"], found["out"]
