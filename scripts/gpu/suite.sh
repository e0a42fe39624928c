#!/usr/bin/env bash
# The whole test suite on the GPU machine, after scripts/gpu/real_model.sh staged the real model on the same
# warm machine (the real-model tests find it in $MOTET_CACHE_DIR; the device has no network to pull it):
#   run(command="bash scripts/gpu/suite.sh", carry=[".whl", ".whl2"], timeout_s=600)
# Files run whole per worker (--dist loadfile): a module-scoped server's tests depend on their order.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d /tmp/site/xgrammar ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
[ -d /tmp/site2/openai ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site2 .whl2/*.whl || exit 1
export PYTHONPATH=/tmp/site:/tmp/site2:$PWD PYTHONUNBUFFERED=1 MOTET_CACHE_DIR=/tmp/motet-cache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout ${SUITE_TIMEOUT:-570} python3 -m pytest tests -q -p no:cacheprovider --timeout 280 -n ${WORKERS:-6} --dist loadfile 2>&1 | tee "$OUT/full_pytest.log" | tail -${TAIL:-40}
