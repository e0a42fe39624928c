"""Every numeric flag of `motet serve` is a finite number in its range, or the server refuses to start with one
line naming the flag and a non-zero exit (issue 31, finding 6: `--responses-max-age-days nan` was accepted
and made every stored response unreadable).

The flags are read from the real parser (motet/api/cli.py `build_parser`), so a flag added later is covered
too; the one-line refusal is checked on a real `motet serve` subprocess.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from motet.api.cli import build_parser
from tests.live_server import ROOT


def serve_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def numeric_flags() -> list[argparse.Action]:
    """The flags that take a typed value (every other flag is a string, a choice or a switch)."""
    return [a for a in serve_parser()._actions if a.option_strings and a.type is not None]


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
        build_parser().parse_args(["serve", f"{name}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and name in err[0], err


@pytest.mark.parametrize("flag", numeric_flags(), ids=lambda a: a.option_strings[0])
def test_defaults_are_in_range(flag):
    """A default written out on the command line parses back to itself (it is in the flag's range)."""
    if flag.default is not None:
        args = build_parser().parse_args(["serve", f"{flag.option_strings[0]}={flag.default}"])
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
