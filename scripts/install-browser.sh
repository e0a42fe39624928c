#!/usr/bin/env bash
# Installs Debian's chromium for the playground's browser test (tests/api/test_playground.py), where it is missing
# and apt-get can run as root; otherwise says why and leaves that test to skip. Idempotent.
set -euo pipefail
if command -v chromium >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install-browser: no chromium, and apt-get cannot run as root here: tests/api/test_playground.py will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -q && apt-get install -y -q chromium; } >/tmp/motet-install-browser.log 2>&1; then
    echo "install-browser: apt-get could not install chromium (see /tmp/motet-install-browser.log):" \
        "tests/api/test_playground.py will skip" >&2
fi
