#!/usr/bin/env bash
# Sets everything up, lints, builds the manual, and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-browser.sh  # Debian's chromium, for the playground's browser test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports  # the layers and the no-event-loop-in-policy rule (pyproject.toml)
# The manual (mkdocs.yml, docs/) with warnings as errors: a broken link or anchor, or a docstring the API
# reference cannot render, fails here. Not --quiet: it hides the very warnings --strict counts; the log is
# shown only when the build fails.
docs_log=$(.venv/bin/mkdocs build --strict --site-dir site 2>&1) || { echo "$docs_log"; exit 1; }
# Three workers on two cores, each test file whole on one (a module's served app is shared by its tests, in order):
# a test waiting on a server, a Ray start or a job leaves its core to a third worker (the 2-core Zen 1: 1,597-1,604 s
# against 1,754 with two, ~0% idle), the longest files first (tests/conftest.py SLOWEST_FILES, kept in that order:
# --no-loadscope-reorder). OpenMP's threads sleep when idle instead of spinning: with a worker's servers and another
# worker's forward passes on the same cores, spinning threads took the cores from the ones with work (a server test
# pair: 235 s spinning, 37 s passive, on 2 cores).
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# The tests' processes (workers, servers, replicas, jobs: several hundred) write and read .pyc files for motet and
# the tests even where the environment says not to: with PYTHONDONTWRITEBYTECODE set, each compiled every module of
# motet's it imported at every start (~1 s of a server's start here) and each worker every test module (a
# collection of 38 s instead of 23).
unset PYTHONDONTWRITEBYTECODE
# One compute thread a process (the test processes, their servers, ranks and workers): the workers' processes
# already use both cores, and a 2-thread region waits at its barrier for a thread another worker's process
# holds (tests/models/test_model_declarations.py on a loaded machine: 209 s at 2 threads, 90 s at 1;
# 11% less CPU). The kernels' own tests run at 2 threads (tests/kernels/conftest.py: the work split between
# threads), the API's and the real engine's main fixtures with every core (their default path: outputs not
# overlapped); a test that needs more sets its own.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# `-m ""`: every test, the smoke runs too (a plain `pytest` leaves them out: pyproject.toml's addopts); a -m given
# here comes later and wins.
exec .venv/bin/python -m pytest -q -n "${MOTET_TEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder -m "" "$@"
