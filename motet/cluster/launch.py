"""Starting and stopping the engine replicas on Ray Serve: a local Ray started here, or an existing cluster
joined at `--ray-address`; one Serve application of EngineReplica replicas (fixed in number, or autoscaled
between --min-replicas and --max-replicas on ongoing requests per replica), routed by MotetRouter. Under
prefill/decode disaggregation (--prefill-replicas), a second application of prefill replicas beside it
(motet/cluster/disaggregation.py), both deployed at once.

Both calls block (Ray's API is synchronous). A local Ray's processes share the fate of the *thread* that
started them (Ray spawns them with PR_SET_PDEATHSIG, which Linux ties to the spawning thread), so the ingress
runs the cluster in a ClusterThread that lives exactly as long as it: a pooled worker thread would be reaped
when idle, and Ray with it. Stopping a local Ray ends every process it started, and waits for them (the agents
its raylet started too; one that outlives the wait is killed); on a joined cluster only this application is
deleted.

Ray's driver installs abseil's failure signal handler, SIGTERM included: on SIGTERM it logs, passes the signal
on, and arms `alarm(3)`, whose SIGALRM handler abort()s the process 3 s later (mid-drain, or after a drain
that took less: exit status -6). SIGTERM is the server's (it drains), so `reclaim_sigterm` hands it back to
Python's handler once Ray is up; abseil keeps the crash signals (SIGSEGV, SIGABRT, ...).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("motet.cluster")

APP = "motet"  # the engine replicas (the decode ones under disaggregation)
PREFILL_APP = "motet-prefill"
STRAGGLER_WAIT_S = 15.0  # after ray.shutdown, for the processes Ray started to exit before they are killed
ROUTERS = ("motet", "pow2")  # motet's router, or Ray Serve's default (power of two choices)
SOURCE_ROOT = Path(__file__).resolve().parents[2]  # where replicas import motet from


@dataclass
class ClusterSettings:
    replicas: int = 2
    min_replicas: int | None = None  # with max_replicas: autoscaling
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0  # per replica, queued at it or running: autoscaling's target
    ray_address: str | None = None  # join this cluster; None: start a local one
    router: str = "motet"
    drain_timeout_s: float = 30.0  # a replica scaled down finishes its requests for up to this long
    max_ongoing_requests: int = 80  # per replica; more wait in the ingress's router queue
    threads_per_replica: int = 1
    prefill_replicas: int = 0  # >0: prefill/decode disaggregation, `replicas` being the decode ones
    # fine-tuning jobs train as Ray Train runs on a node holding this custom resource (None: in the server's
    # machine, as a child process); a local Ray holds one unit of it
    fine_tuning_ray_resource: str | None = None

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        lo, hi = self.min_replicas, self.max_replicas
        if (lo is None) != (hi is None):
            raise ValueError("--min-replicas and --max-replicas go together (autoscaling between them)")
        if lo is not None and not 0 <= lo <= hi:
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas, got {lo} and {hi}")
        if hi is not None and hi < 1:
            raise ValueError(f"--max-replicas must be at least 1, got {hi}")
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if self.prefill_replicas < 0:
            raise ValueError(f"--prefill-replicas must be at least 0, got {self.prefill_replicas}")
        if self.prefill_replicas and self.autoscaling:
            raise ValueError("--prefill-replicas (fixed pools) does not go with --min/--max-replicas yet")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        """Of every pool together."""
        return (self.max_replicas if self.autoscaling else self.replicas) + self.prefill_replicas


class Cluster:
    def __init__(self, settings: ClusterSettings, replica_settings):
        self.settings, self.replica_settings = settings, replica_settings
        self.started_ray = False
        self.prefill_handle = None  # the prefill pool's, under disaggregation (set by `start`)

    def deployment_options(self, prefill: bool = False) -> dict:
        from ray.serve.config import RequestRouterConfig

        from motet.cluster.reports import REPORT_PERIOD_S
        from motet.cluster.router import MotetRouter, ReportingPowerOfTwoRouter

        s = self.settings
        router = MotetRouter if s.router == "motet" else ReportingPowerOfTwoRouter
        options = dict(
            name="PrefillReplica" if prefill else "EngineReplica",
            max_ongoing_requests=s.max_ongoing_requests,
            ray_actor_options={"num_cpus": s.threads_per_replica},
            request_router_config=RequestRouterConfig(
                request_router_class=router, request_routing_stats_period_s=REPORT_PERIOD_S
            ),
            logging_config={"enable_access_log": False},  # the ingress logs requests
            graceful_shutdown_wait_loop_s=0.5,
            graceful_shutdown_timeout_s=s.drain_timeout_s,
            health_check_period_s=2.0,
        )
        if prefill:
            options["num_replicas"] = s.prefill_replicas
        elif s.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": s.min_replicas,
                "initial_replicas": max(s.min_replicas, min(s.replicas, s.max_replicas)),
                "max_replicas": s.max_replicas,
                "target_ongoing_requests": s.target_ongoing_requests,
                "upscale_delay_s": 5.0,
                "downscale_delay_s": 60.0,
            }
        else:
            options["num_replicas"] = s.replicas
        return options

    def connect(self) -> None:
        """Ray up: a local one started, or the cluster at --ray-address joined."""
        import ray

        s = self.settings
        path = os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}  # what the replicas' processes need
        if s.ray_address:
            ray.init(address=s.ray_address, runtime_env={"env_vars": env}, log_to_driver=True)
        else:
            cpus = max(os.cpu_count() or 1, s.most_replicas * s.threads_per_replica)
            resources = {s.fine_tuning_ray_resource: 1} if s.fine_tuning_ray_resource else None
            # A local Ray's processes inherit this process's environment as they start: `env` reaches its workers
            # so, not through a runtime_env, which would make Ray start workers of their own for this job and
            # leave the ones it prestarted (one a CPU) idle: two processes more per start here
            with _environment(env):
                ray.init(num_cpus=cpus, resources=resources, include_dashboard=False)
            self.started_ray = True

    def start(self):
        """The replicas up (each has loaded the model), once `connect` has; the deployment's handle."""
        from ray import serve

        from motet.cluster.replica import EngineReplica

        s = self.settings
        serve.start(proxy_location="Disabled")
        app = serve.deployment(EngineReplica, **self.deployment_options()).bind(self.replica_settings)
        log.info(
            "starting %s engine replicas",
            s.replicas if not s.autoscaling else f"{s.min_replicas}-{s.max_replicas}",
        )
        if not s.prefill_replicas:
            return serve.run(app, name=APP, route_prefix=None)
        log.info("and %d prefill replicas (prefill/decode disaggregation)", s.prefill_replicas)
        prefill = serve.deployment(EngineReplica, **self.deployment_options(prefill=True))
        handle, self.prefill_handle = serve.run_many(
            [
                serve.RunTarget(app, name=APP, route_prefix=None),
                serve.RunTarget(prefill.bind(self.replica_settings), name=PREFILL_APP, route_prefix=None),
            ]
        )
        return handle

    def stop(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        started = _descendants() if self.started_ray else []  # raylet, GCS, agents, workers
        try:
            if self.started_ray:
                serve.shutdown()
            else:
                serve.delete(APP)
                if self.settings.prefill_replicas:
                    serve.delete(PREFILL_APP)
        except Exception:
            log.exception("stopping the Serve application failed")
        if self.started_ray:  # and any started meanwhile (before ray.shutdown, while they are ours)
            pids = {p.pid for p in started}
            started += [p for p in _descendants() if p.pid not in pids]
        ray.shutdown(wait_for_processes=True)
        _reap(started)


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """`env` in this process's environment for the block's time (what a process started meanwhile inherits)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _descendants() -> list:
    """This process's descendants: with a local Ray, the processes it started (the server starts no others)."""
    import psutil

    return psutil.Process().children(recursive=True)


def _reap(processes: list) -> None:
    """Wait for `processes` to exit; kill (SIGKILL) those that outlive STRAGGLER_WAIT_S, and reap them."""
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=STRAGGLER_WAIT_S)
    for p in alive:
        log.warning("a Ray process outlived the shutdown; killing it: %s", p)
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            p.kill()
    psutil.wait_procs(alive, timeout=STRAGGLER_WAIT_S)


def reclaim_sigterm() -> None:
    """SIGTERM back to Python's handler (the server's drain), from Ray's abseil one (see the module doc).
    Signal handlers belong to the main thread: elsewhere (an app in tests) there is none to reclaim."""
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
        if handler is not None:  # None: installed outside Python, nothing of ours to restore
            signal.signal(signal.SIGTERM, handler)


class ClusterThread(threading.Thread):
    """Starts the cluster, keeps it (and Ray's processes, which die with this thread) until `finish`, stops it."""

    def __init__(self, cluster: Cluster):
        super().__init__(name="motet-cluster", daemon=True)
        self.cluster = cluster
        self.handle = None
        self.error: BaseException | None = None
        self.connected = threading.Event()  # Ray is up (or failed to start: see `started`)
        self.started = threading.Event()  # the handle, or the error, is there
        self._finish = threading.Event()

    def run(self) -> None:
        try:
            try:
                self.cluster.connect()
            finally:
                self.connected.set()
            self.handle = self.cluster.start()
        except BaseException as e:  # handed to the ingress, which fails its start-up with it
            self.error = e
        finally:
            self.started.set()
        self._finish.wait()
        self.cluster.stop()

    def finish(self) -> None:
        self._finish.set()
