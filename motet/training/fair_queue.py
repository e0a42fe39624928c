"""Which queued fine-tuning job runs next: tenants in turn, so that one tenant's many jobs never hold back
another's.

The tenant with the fewest jobs running goes first, then the one whose last job started longest ago (a tenant
that never ran one first of all), then the tenant whose oldest job has waited longest; its oldest job runs. Plain
code: the runner (motet/api/fine_tuning/runner.py) asks it whenever a slot frees up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Queued:
    job_id: str
    tenant: str
    order: int  # when it was queued (smaller: earlier)


def next_job(
    queued: Sequence[Queued], running: Counter[str] | Mapping[str, int], last_start: Mapping[str, float]
) -> Queued | None:
    """`running`: each tenant's running jobs; `last_start`: when each tenant's last job started."""
    oldest: dict[str, Queued] = {}
    for job in queued:
        if job.tenant not in oldest or job.order < oldest[job.tenant].order:
            oldest[job.tenant] = job
    if not oldest:
        return None
    tenant = min(
        oldest,
        key=lambda t: (running.get(t, 0), last_start.get(t, float("-inf")), oldest[t].order),
    )
    return oldest[tenant]
