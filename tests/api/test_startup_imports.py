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


def test_a_gguf_files_second_start_checks_it_without_heavy_libraries(tiny_model_dir, tmp_path, monkeypatch):
    """A bare GGUF file's config and tokenizer are derived once (motet/engine/weights/gguf_model.py); a later start
    finds them before its port is bound, and must not import torch (or numpy) to do so: the derivation's modules are
    imported where it derives. What the check finds is what the first start derived."""
    from motet.engine.weights.model_store import resolve_model
    from tests.engine.test_gguf_model_file import write_gguf_file
    from tests.kernels.test_quantization import GGUF_TYPES

    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))
    gguf_file = write_gguf_file(tiny_model_dir, tmp_path / "bare" / "tiny.gguf", GGUF_TYPES)
    derived = resolve_model(str(gguf_file))  # the first start's derivation
    found = imported_by(
        "from motet.api.cli import build_parser, engine_config\n"
        "from motet.api.server import check_model\n"
        f"args = build_parser('serve').parse_args(['serve', '--model', {str(gguf_file)!r}])\n"
        "model_dir, max_len = check_model(engine_config(args))\n"
        "out = {'model_dir': str(model_dir), 'max_len': max_len, 'numpy': 'numpy' in sys.modules}"
    )
    assert found["heavy"] == [] and found["out"]["numpy"] is False, found
    from transformers import AutoConfig

    assert found["out"]["model_dir"] == str(derived)
    assert found["out"]["max_len"] == AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings


def test_loading_the_model_and_its_first_token_import_no_dynamo(tiny_model_dir):
    """The model is made on the meta device before its weights are put in place (motet/engine/worker/model.py
    `CausalLM.on_meta`); drawing an embedding table's random values there imported torch._dynamo (seconds of every
    start), for values the checkpoint's replace. An engine loaded and stepped once still answers as HF does."""
    found = imported_by(
        "from motet.engine.llm import LLM\n"
        "from motet.engine.sampling_params import SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir)!r}, device='cpu', block_size=8, num_kv_blocks=64)\n"
        "[result] = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4))\n"
        "out = {'tokens': result.token_ids, 'dynamo': 'torch._dynamo' in sys.modules}"
    )
    assert found["out"]["dynamo"] is False, found
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=4, do_sample=False)[0, 4:].tolist()
    assert found["out"]["tokens"] == want


def test_the_heap_the_start_builds_is_settled_once():
    """While `motet serve` imports its modules and builds its app (motet/api/server.py `settled_heap`), the
    collector makes no full passes over the growing heap; afterwards the garbage of the build is collected (none is
    frozen with it), what survives is frozen out of later passes, and collection is on again. Run in a fresh
    interpreter: freezing would reach the test process's own objects."""
    found = imported_by(
        "import gc, weakref\n"
        "from motet.api.server import settled_heap\n"
        "class Node: pass\n"
        "frozen_before = gc.get_freeze_count()\n"
        "with settled_heap():\n"
        "    during = gc.isenabled()\n"
        "    kept = Node(); kept.me = kept\n"
        "    garbage = Node(); garbage.me = garbage; dead = weakref.ref(garbage); del garbage\n"
        "out = {'during': during, 'after': gc.isenabled(), 'garbage_collected': dead() is None,"
        " 'frozen': gc.get_freeze_count() > frozen_before, 'kept_alive': kept.me is kept}"
    )
    assert found["out"] == {
        "during": False,
        "after": True,
        "garbage_collected": True,
        "frozen": True,
        "kept_alive": True,
    }


# What a start on a host without a GPU never uses before its first grammar request: the grammar backends' libraries
# (llguidance's tokenizer bridge imports transformers' modelling code), the schema checker, and Triton (its kernels
# run on CUDA only, or under TRITON_INTERPRET).
NOT_AT_START = ("xgrammar", "llguidance", "outlines_core", "jsonschema", "triton")


def test_the_serving_path_and_a_models_load_import_no_grammar_library_nor_triton(tiny_model_dir, monkeypatch):
    """motet serve's modules (the actor system and the app) and an engine loaded on the CPU and stepped once import
    none of NOT_AT_START: the grammar backends are imported when the vocabulary is built or the first grammar is
    compiled (motet/grammar/cache.py), jsonschema by the first schema's check, Triton by the first kernel launch
    (motet/kernels/triton_support.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a served CPU host's environment, not the tests'
    found = imported_by(
        "import motet.actors.system, motet.api.server\n"
        "from motet.engine.llm import LLM\n"
        "from motet.engine.sampling_params import SamplingParams\n"
        f"llm = LLM({str(tiny_model_dir)!r}, device='cpu', block_size=8, num_kv_blocks=64)\n"
        "llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=2))\n"
        f"out = {{'not_at_start': sorted(m for m in {NOT_AT_START!r} if m in sys.modules)}}\n"
    )
    assert found["out"]["not_at_start"] == [], found
