"""`motet serve`'s fine-tuning flags, and the runner they build (motet/api/server.py calls both)."""

from __future__ import annotations

from pathlib import Path

from motet.flag_types import integer, number

DEFAULT_SHARE = 0.25  # --fine-tuning-share: a quarter of the machine for training while serving is busy
MAX_SHARE = 0.9  # (serving keeps a tenth at least: its streams stall for the slices in between)


def add_args(p) -> None:
    from motet.api.fine_tuning.settings import RunnerSettings
    from motet.api.fine_tuning.store import Quotas

    p.add_argument(
        "--fine-tuning-max-running",
        type=integer(1),
        default=RunnerSettings.max_running,
        help="fine-tuning jobs (/v1/fine_tuning/jobs) training at once, each in a process of its own; the others "
        "wait, tenants in turn",
    )
    p.add_argument(
        "--fine-tuning-threads",
        type=integer(1),
        default=None,
        help="compute threads of a fine-tuning job's process (default: the cores serving uses; it never runs "
        "beside serving's steps)",
    )
    p.add_argument(
        "--fine-tuning-share",
        type=number(0.0, MAX_SHARE),
        default=DEFAULT_SHARE,
        help="the share of the machine's time fine-tuning jobs train in while serving is busy (at most "
        f"{MAX_SHARE}: serving keeps the rest); while serving is idle they have all of it. The serving engine lends "
        "its cores to one job's process at a time between its steps, so the machine never runs more compute "
        "threads than --threads (0: jobs train only while serving is idle)",
    )
    p.add_argument(
        "--fine-tuning-nice",
        type=integer(0, 19),
        default=None,
        help="the niceness of a fine-tuning job's process (default: 0, as serving, where the serving engine lends "
        "it the CPU's cores; 19 where nothing does, behind a Ray cluster or beside a GPU's engine, and serving's "
        "threads go first)",
    )
    p.add_argument(
        "--fine-tuning-max-jobs-per-tenant",
        type=integer(1),
        default=Quotas.max_active,
        help="a tenant's fine-tuning jobs queued, running or paused at once; one more gets 429",
    )
    p.add_argument(
        "--fine-tuning-max-tokens-per-day",
        type=integer(1),
        default=None,
        help="training tokens a tenant's fine-tuning jobs may train in 24 hours (a job's examples' tokens times "
        "its epochs); a job past it gets 429 (default: no limit)",
    )
    p.add_argument(
        "--fine-tuning-max-validating",
        type=integer(1),
        default=Quotas.max_validating,
        help="a tenant's fine-tuning jobs whose files are checked and tokenized at once; its next one waits its turn "
        "(another tenant's never waits on them)",
    )


def runner(args, data: Path, files, adapters, usage, threads: int, lease=None):
    """The server's fine-tuning runner; `threads`: serving's (the workers' default); `lease`: the serving engine's
    lease of its cores to the workers (motet/actors/training_lease.py; None behind Ray)."""
    from motet.api.fine_tuning.runner import FineTuningRunner
    from motet.api.fine_tuning.settings import RunnerSettings
    from motet.api.fine_tuning.store import FineTuningStore, Quotas
    from motet.cluster.serve_flags import training_launch

    settings = RunnerSettings(
        max_running=args.fine_tuning_max_running,
        threads=args.fine_tuning_threads or threads,
        nice=args.fine_tuning_nice,
        lease=lease,
    )
    if (launch := training_launch(args)) is not None:  # behind a Ray cluster: Ray Train runs
        settings.launch = launch
    quotas = Quotas(args.fine_tuning_max_jobs_per_tenant, args.fine_tuning_max_tokens_per_day,
                    args.fine_tuning_max_validating)  # fmt: skip
    return FineTuningRunner(FineTuningStore(data), files, adapters, usage, settings, quotas)
