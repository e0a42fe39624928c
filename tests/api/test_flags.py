"""Every numeric flag of `motet serve` is a finite number in its range, or the server refuses to start with one
line naming the flag and a non-zero exit (issue 31, finding 6: `--responses-max-age-days nan` was accepted
and made every stored response unreadable).

The flags are read from the real parser (motet/api/cli.py `build_parser`), so a flag added later is covered
too; the one-line refusal is checked on a real `motet serve` subprocess.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys

import pytest

from motet.api.cli import build_parser
from motet.flag_types import MAX_FLAG_FILE_BYTES
from tests.live_server import ROOT


def serve_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def numeric_flags() -> list[argparse.Action]:
    """The flags that take a number (the others are names, files, JSON, strings, choices or switches)."""
    return [a for a in serve_parser()._actions
            if a.option_strings and getattr(a.type, "__name__", None) in ("integer", "number")]  # fmt: skip


@functools.cache
def serve_flags_parser() -> argparse.ArgumentParser:
    """One parser for the parametrized cases (a parse leaves its parser as it was; building one is ~20 ms)."""
    return build_parser()


def test_the_numeric_flags_are_found():
    names = {a.option_strings[0] for a in numeric_flags()}
    assert {"--responses-max-age-days", "--port", "--drain-timeout", "--kv-cache-memory-gb"} <= names
    assert {"--replicas", "--target-ongoing-requests", "--grammar-max-depth", "--max-waiting"} <= names
    assert not names & {"--model", "--host", "--data-dir", "--lora-load-dir"}


@pytest.mark.parametrize("flag", numeric_flags(), ids=lambda a: a.option_strings[0])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "-1", "x", ""])
def test_non_finite_negative_and_malformed_values_are_refused(flag, value, capsys):
    name = flag.option_strings[0]
    with pytest.raises(SystemExit) as e:
        serve_flags_parser().parse_args(["serve", f"{name}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0], err


@pytest.mark.parametrize("flag", numeric_flags(), ids=lambda a: a.option_strings[0])
def test_defaults_are_in_range(flag):
    """A default written out on the command line parses back to itself (it is in the flag's range)."""
    if flag.default is not None:
        args = serve_flags_parser().parse_args(["serve", f"{flag.option_strings[0]}={flag.default}"])
        assert getattr(args, flag.dest) == flag.default


@pytest.mark.parametrize(
    "flag, bad, good",
    [
        ("--responses-max-age-days", "0", "0.5"),
        ("--drain-timeout", "1e300", "0"),  # a deadline 1e300 s away overflows the event loop
        ("--port", "65536", "0"),
        ("--max-waiting", "0", "1"),  # no request could ever be admitted
        ("--min-replicas", "-1", "0"),
        ("--kv-cache-memory-gb", "0", "0.25"),
        ("--grammar-timeout", "0", "0.5"),
    ],
)
def test_range_edges(flag, bad, good):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, bad])
    build_parser().parse_args(["serve", flag, good])


def test_motet_serve_refuses_nan_in_one_line():
    cmd = [sys.executable, "-m", "motet.api.cli", "serve", "--responses-max-age-days", "nan"]
    cmd += ["--model", str(ROOT / "no-such-model")]  # refused before any model is looked for
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--responses-max-age-days" in lines[0] and "finite" in lines[0], done.stderr


# (the machine torch is told it is, what `--device` says of it)
CPU_ONLY_BUILD = dict(cuda=None, hip=None, available=False, count=0)
TWO_GPUS = dict(cuda="12.4", hip=None, available=True, count=2)
NO_GPU_SEEN = dict(cuda="12.4", hip=None, available=False, count=0)


@pytest.mark.parametrize(
    "machine, value, says",
    [
        (CPU_ONLY_BUILD, "bogus", "unknown device 'bogus': motet runs on auto"),
        (CPU_ONLY_BUILD, "mps", "unknown device 'mps'"),
        (CPU_ONLY_BUILD, "cuda", "cuda: CUDA is not available in this torch build"),
        (CPU_ONLY_BUILD, "cuda:7", "cuda:7: CUDA is not available in this torch build"),
        (NO_GPU_SEEN, "cuda", "sees no CUDA device on this machine"),
        (
            TWO_GPUS,
            "cuda:7",
            "cuda:7: no such device index: this machine has 2 CUDA device(s), cuda:0 to cuda:1",
        ),
    ],
)
def test_a_device_this_machine_lacks_is_refused_naming_device(machine, value, says, monkeypatch, capsys):
    """Issue 68, finding 5: `--device bogus|cuda|cuda:7` on a CPU-only torch was a start-up traceback (in the
    dtype and memory checks); now argparse's one line naming --device and why, exit 2. The engine's config
    refuses it alike (LLM(device=...))."""
    import torch

    from motet.engine.config import EngineConfig

    monkeypatch.setattr(torch.version, "cuda", machine["cuda"])
    monkeypatch.setattr(torch.version, "hip", machine["hip"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: machine["available"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: machine["count"])
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--device", value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --device: " in err[0] and says in err[0], err
    with pytest.raises(ValueError, match=re.escape(says)):
        EngineConfig(device=value)


@pytest.mark.parametrize("value", ["auto", "cpu"])
def test_the_devices_every_machine_has_pass(value):
    build_parser().parse_args(["serve", "--device", value])


def test_motet_serve_refuses_an_unknown_device_in_one_line(tiny_model_dir):
    cmd = [
        sys.executable,
        "-m",
        "motet.api.cli",
        "serve",
        "--model",
        str(tiny_model_dir),
        "--device",
        "bogus",
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device" in lines[0] and "unknown device 'bogus'" in lines[0], done.stderr


def deep_json_file(tmp_path, depth: int = 100_000) -> str:
    path = tmp_path / "deep.json"
    path.write_text("[" * depth + "]" * depth)
    return str(path)


def fifo(tmp_path) -> str:
    path = tmp_path / "weights.fifo"
    os.mkfifo(path)
    return str(path)


def huge_file(tmp_path) -> str:
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(MAX_FLAG_FILE_BYTES + 1)  # (sparse: nothing is written)
    return str(path)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--tenant-weights", deep_json_file),  # was a RecursionError's traceback
        ("--tenant-weights", "/dev/zero"),  # was read until memory ran out
        ("--tenant-weights", fifo),  # would wait for a writer
        ("--tenant-weights", huge_file),
        ("--served-model-name", ""),
        ("--served-model-name", "m" * 100_000),
        ("--served-model-name", "two words"),
        ("--allowed-hosts", ""),
        ("--allowed-hosts", "http://example.com"),
        ("--allowed-hosts", "a..b"),
        ("--allowed-origins", "not a url"),
        ("--allowed-origins", "https://app.example.com/page"),
        ("--allowed-origins", '["*", "nope"]'),
        ("--allowed-origins", "[" * 100_000),
        ("--override-generation-config", "[" * 100_000 + "]" * 100_000),
        ("--override-generation-config", '{"temperature": NaN}'),
        ("--lora-modules", '{"name": ' + "[" * 100_000),
        ("--block-size", "1000000"),
        ("--max-model-len", "1"),
        ("--threads", "100000"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else getattr(v, "__name__", "long"),
)
def test_flags_of_every_kind_are_refused_at_parse_time_in_one_line(flag, value, tmp_path, capsys):
    """Issue 57: names, hosts, origins, JSON files and inline JSON are checked as the flags are parsed: exit 2
    with one line naming the flag (argparse's own refusal), no traceback, nothing read past the bounds."""
    value = value(tmp_path) if callable(value) else value
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and flag in err[0] and "Traceback" not in err[0], err
    assert len(err[0]) < 1000  # a 100,000-character value is not echoed whole


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--served-model-name", "Qwen/Qwen2.5-0.5B-Instruct"),
        ("--allowed-hosts", "*"),
        ("--allowed-hosts", "api.example.com"),
        ("--allowed-hosts", "my_service:8000"),
        ("--allowed-hosts", "10.0.0.7"),
        ("--allowed-origins", "*"),
        ("--allowed-origins", "http://localhost:3000"),
        ("--allowed-origins", "https://app.example.com/"),
        ("--allowed-origins", '["https://a.example.com", "http://127.0.0.1:5173"]'),
        ("--block-size", "256"),
        ("--max-model-len", "64"),
        ("--threads", "1"),
    ],
)
def test_good_values_of_those_flags_pass(flag, value):
    build_parser().parse_args(["serve", flag, value])


@pytest.mark.parametrize(
    "flags, says",
    [
        (
            ["--max-model-len", "10000000000"],
            "--max-model-len 10000000000 is more than the model's 4096 positions",
        ),
        (["--num-kv-blocks", "100000000000"], "--num-kv-blocks 100000000000 asks for"),
        (["--kv-cache-memory-gb", "1e9"], "--kv-cache-memory-gb 1e+09 asks for"),
        (["--adapter-memory-gb", "1e9"], "--adapter-memory-gb 1e+09 asks for"),
        (["--kv-offload-gb", "1e9"], "--kv-offload-gb 1e+09 asks for"),
        (["--num-kv-blocks", "1"], "--num-kv-blocks 1 holds a KV cache of 16 tokens"),
        (["--num-kv-blocks", "4", "--block-size", "256"], None),  # 1,024 tokens: enough
        # issue 68, finding 13: refused once the weights had loaded (the server up), or naming another flag
        (["--quantization", "gptq"], "--quantization gptq: "),
        (["--quantization", "awq"], "is not an AWQ checkpoint (its config.json has no quantization_config)"),
        (
            ["--tensor-parallel-size", "1000"],
            "--tensor-parallel-size 1000: tensor parallelism splits the model's 2 key/value heads, one at least "
            "per rank: choose a --tensor-parallel-size of at most 2",
        ),
        (["--tensor-parallel-size", "2"], None),
    ],
)
def test_flags_the_model_or_memory_bound_are_refused_before_anything_loads(flags, says, tiny_model_dir, tmp_path,
                                                                           capsys, monkeypatch):  # fmt: skip
    """Issue 57: these failed after start-up with the allocator's errors (or, for one block, were accepted):
    now `check_model` refuses them once the model's config is read, in one line, exit 2."""
    from motet.api import server
    from motet.api.cli import main

    def listen(*args, **kwargs):  # what comes after the checks (binding the port): not this test's
        raise ValueError("the checks passed")

    monkeypatch.setattr(server, "listen", listen)
    code = main(["serve", "--model", str(tiny_model_dir), "--port", "0", "--data-dir", str(tmp_path / "d"),
                 *flags])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("motet: error: "), err
    assert (says or "the checks passed") in err[0], err


def test_more_ranks_than_cores_are_refused_before_any_starts(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """Each rank is a process with its threads: --tensor-parallel-size past the cores this process may run on is
    refused naming the flag and the limit (here one core, as a container may give)."""
    from motet.api import server
    from motet.api.cli import main

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(server, "listen", lambda *a, **k: pytest.fail("the checks passed"))
    code = main(["serve", "--model", str(tiny_model_dir), "--port", "0", "--data-dir", str(tmp_path / "d"),
                 "--tensor-parallel-size", "2"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert (
        "--tensor-parallel-size 2 is more than this machine's 1 core(s) this process may run on" in err[0]
    ), err


def test_motet_serve_refuses_a_context_past_the_models_in_one_line(tiny_model_dir):
    cmd = [sys.executable, "-m", "motet.api.cli", "serve", "--model", str(tiny_model_dir), "--port", "0",
           "--max-model-len", "10000000000"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--max-model-len" in lines[0] and "4096 positions" in lines[0], done.stderr


# Each command's path flags with a path of the wrong kind: {file} a regular file, {dir} a directory, {file}/x a path
# under a file (ENOTDIR). `env`: a path given as an environment variable instead of a flag.
PATH_CASES = [
    ("eval --out FILE", ["eval", "jsonschema", "--out", "{file}"], {}, "argument --out: {file}: not a directory"),
    ("eval --out UNDER", ["eval", "jsonschema", "--out", "{file}/x"], {}, "argument --out: {file}/x: Not a directory"),
    ("eval --data DIR", ["eval", "jsonschema", "--out", "{dir}/r", "--data", "{dir}"], {},
     "argument --data: {dir}: not a regular file (a directory)"),
    ("eval lora --adapters-dir FILE", ["eval", "lora", "--out", "{dir}/r", "--adapters-dir", "{file}"], {},
     "argument --adapters-dir: {file}: not a directory (a regular file)"),
    ("run-batch -i DIR", ["run-batch", "-i", "{dir}", "-o", "{dir}/out.jsonl"], {},
     "argument -i/--input-file: {dir}: not a regular file (a directory)"),
    ("run-batch -o DIR", ["run-batch", "-i", "{file}", "-o", "{dir}"], {},
     "argument -o/--output-file: {dir}: not a regular file (a directory)"),
    ("run-batch -o UNDER", ["run-batch", "-i", "{file}", "-o", "{file}/x"], {},
     "argument -o/--output-file: {file}/x: Not a directory"),
    ("pull --cache-dir FILE", ["pull", "--cache-dir", "{file}"], {}, "argument --cache-dir: {file}: not a directory"),
    ("pull --cache-dir UNDER", ["pull", "--cache-dir", "{file}/x"], {}, "argument --cache-dir: {file}/x: Not a directory"),
    ("serve --data-dir FILE", ["serve", "--data-dir", "{file}"], {}, "argument --data-dir: {file}: not a directory"),
    ("serve --data-dir UNDER", ["serve", "--data-dir", "{file}/x"], {}, "argument --data-dir: {file}/x: Not a directory"),
    ("serve $MOTET_DATA_DIR FILE", ["serve"], {"MOTET_DATA_DIR": "{file}"},
     "motet: error: $MOTET_DATA_DIR {file}: not a directory (a regular file)"),
    ("serve --kv-shared-dir FILE", ["serve", "--kv-shared-dir", "{file}"], {},
     "argument --kv-shared-dir: {file}: not a directory"),
    ("serve --api-keys DIR", ["serve", "--api-keys", "{dir}"], {}, "--api-keys {dir}: cannot read"),
    ("serve --tenant-weights DIR", ["serve", "--tenant-weights", "{dir}"], {},
     "argument --tenant-weights: {dir}: not a regular file (a directory)"),
    ("generate --kv-disk-gb, $MOTET_DATA_DIR FILE", ["generate", "--prompt", "x", "--kv-disk-gb", "1"],
     {"MOTET_DATA_DIR": "{file}"}, "motet: error: $MOTET_DATA_DIR {file}: not a directory (a regular file)"),
    ("fine-tune FILE DIR", ["fine-tune", "{dir}"], {}, "argument FILE: {dir}: not a regular file (a directory)"),
    ("fine-tune --out FILE", ["fine-tune", "{file}", "--out", "{file}"], {}, "argument --out: {file}: not a directory"),
]  # fmt: skip
_ENGINE = {"serve", "generate", "run-batch", "fine-tune"}  # commands that take --model


@pytest.mark.parametrize("argv, env, says", [c[1:] for c in PATH_CASES], ids=[c[0] for c in PATH_CASES])
def test_a_path_flag_of_the_wrong_kind_exits_2_in_one_line(argv, env, says, tiny_model_dir, tmp_path, capsys,
                                                          monkeypatch):  # fmt: skip
    """Issue 68: every command's path flags, as `motet fine-tune`'s (flag_types.py input_file, input_directory,
    output_file, output_directory): a file to read that is a directory, an output that exists as a file or lies
    under one is argparse's one-line refusal, exit 2, before anything loads or runs (before: an OSError's
    traceback out of open() or mkdir(), for `run-batch -o` once the whole batch had run)."""
    from motet.api.cli import main

    file, folder = tmp_path / "afile", tmp_path / "adir"
    file.write_text("{}\n")
    folder.mkdir()
    fill = {"file": file, "dir": folder}
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(**fill))
    args = [a.format(**fill) for a in argv]
    # Where a path passed (before the checks), nothing is pulled (the tiny model) and no server started (one
    # that is not there).
    if args[0] in _ENGINE:
        args += ["--model", str(tiny_model_dir), "--threads", "1"]
    if args[0] == "eval":
        args += ["--base-url", "http://127.0.0.1:9"]
    if args[0] == "serve":
        args += ["--port", "0"]
    try:
        code = main(args)
    except SystemExit as e:  # (`motet eval` parses its own flags)
        code = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert says.format(**fill) in err[0] and "Traceback" not in err[0], err


def test_paths_of_the_right_kind_and_urls_pass(tmp_path):
    """What the path types let through: a file to overwrite, a directory to make (its parents too), a URL where
    the flag takes one (run-batch's http(s), the shared KV tier's fsspec URLs)."""
    data = tmp_path / "in.jsonl"
    data.write_text("")
    new = tmp_path / "new" / "dir"
    args = build_parser().parse_args(["run-batch", "-i", str(data), "-o", str(data)])
    assert (args.input_file, args.output_file) == (str(data), str(data))
    args = build_parser().parse_args(["run-batch", "-i", "https://h/in.jsonl", "-o", f"{new}/out.jsonl"])
    assert args.input_file == "https://h/in.jsonl"
    args = build_parser().parse_args(["serve", "--data-dir", str(new), "--kv-shared-dir", "s3://bucket/kv"])
    assert (args.data_dir, args.kv_shared_dir) == (new, "s3://bucket/kv")
    assert build_parser().parse_args(["pull", "--cache-dir", str(new)]).cache_dir == new
    assert not new.exists()  # (made by the command that writes there, not by its parser)
