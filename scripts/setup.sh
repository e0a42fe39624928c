#!/usr/bin/env bash
# Creates .venv at the repo root and installs motet into it (idempotent; fast when already done).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }
# torch pinned: on this machine it is a local CPU wheel; unpinned it would pull CUDA packages.
requirements=(torch==2.13.0 -e ".[dev,cluster]")
# uv (from PyPI) installs the ~200 packages in ~80 s, their bytecode compiled (20 s without), where pip takes ~5
# minutes (a fifth of CI's budget) here. It reads neither pip.conf nor PIP_*, so it gets pip's own settings (the
# local torch wheel's folder, the machine's caps), pip's best match across indexes, and scripts/constraints.txt
# (where the two resolvers would pick differently).
# Where uv cannot be had or fails, pip does the same install.
if .venv/bin/python -c "import uv" 2>/dev/null || pip install -q uv 2>/dev/null; then
    uv=$(.venv/bin/python -c "import uv; print(uv.find_uv_bin())")
    mapfile -t pip_settings < <(.venv/bin/python - <<'EOF'
import shlex, subprocess, sys

listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
seen = set()
for line in listing.splitlines():
    key, _, value = line.partition("=")
    option = key.rsplit(".", 1)[-1]
    if option not in ("index-url", "extra-index-url", "find-links", "constraint"):
        continue
    for item in " ".join(shlex.split(value)).split():
        if (option, item) not in seen:
            seen.add((option, item))
            print(f"--{option}={item}")
EOF
    )
    # (--native-tls: the system's certificates, which pip's cert setting names, not uv's bundled ones;
    # --compile-bytecode: the .pyc files pip writes and uv does not by default. Without them every process compiles
    # what it imports, and where PYTHONDONTWRITEBYTECODE is set (as on this machine) it does so at every start:
    # torch's import took 7.9 s here instead of 2.9, a server's imports 15 s instead of 4.4)
    if "$uv" pip install -q --native-tls --compile-bytecode --python .venv/bin/python \
        --index-strategy unsafe-best-match "${pip_settings[@]}" --constraint scripts/constraints.txt \
        "${requirements[@]}"; then
        exit 0
    fi
    echo "setup: uv could not install; pip will" >&2
fi
.venv/bin/python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -c scripts/constraints.txt -e ".[dev,cluster]"
