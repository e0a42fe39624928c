"""The tenant's line's bounds (`motet serve --tenant-wait-timeout`): plain values, read by the parser before the API's
modules are imported (motet/api/rate_limits.py keeps the line)."""

from __future__ import annotations

# A request over its tenant's concurrency limit waits for a place this long (`motet serve --tenant-wait-timeout`),
# in a line of at most LINE_PER_PLACE requests for each place; then 429. The openai SDKs' default 2 retries each
# wait in line again.
DEFAULT_WAIT_S = 30.0
LINE_PER_PLACE = 4
