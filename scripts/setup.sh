#!/usr/bin/env bash
# Creates .venv at the repo root and installs motet into it (idempotent; fast when already done).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
# torch first, pinned: on this machine it is a local CPU wheel; unpinned it would pull CUDA packages.
.venv/bin/python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".[dev,cluster]"
