#!/usr/bin/env bash
# Sets everything up, lints, and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install-browser.sh  # Debian's chromium, for the playground's browser test
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports  # the layers and the no-event-loop-in-policy rule (pyproject.toml)
exec .venv/bin/python -m pytest -q "$@"
