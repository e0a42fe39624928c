"""Starting and stopping the engine replicas on Ray Serve: a local Ray started here, or an existing cluster
joined at `--ray-address`; one Serve application of EngineReplica replicas (fixed in number, or autoscaled
between --min-replicas and --max-replicas on ongoing requests per replica), routed by MotetRouter.

Both calls block (Ray's API is synchronous). A local Ray's processes share the fate of the *thread* that
started them (Ray spawns them with PR_SET_PDEATHSIG, which Linux ties to the spawning thread), so the ingress
runs the cluster in a ClusterThread that lives exactly as long as it: a pooled worker thread would be reaped
when idle, and Ray with it. Stopping a local Ray ends every process it started; on a joined cluster only this
application is deleted.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("motet.cluster")

APP = "motet"
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

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.autoscaling else self.replicas


class Cluster:
    def __init__(self, settings: ClusterSettings, replica_settings):
        self.settings, self.replica_settings = settings, replica_settings
        self.started_ray = False

    def deployment_options(self) -> dict:
        from ray.serve.config import RequestRouterConfig

        from motet.cluster.reports import REPORT_PERIOD_S
        from motet.cluster.router import MotetRouter, ReportingPowerOfTwoRouter

        s = self.settings
        router = MotetRouter if s.router == "motet" else ReportingPowerOfTwoRouter
        options = dict(
            name="EngineReplica",
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
        if s.autoscaling:
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

    def start(self):
        """Ray up, the replicas up (each has loaded the model); the deployment's handle."""
        import ray
        from ray import serve

        from motet.cluster.replica import EngineReplica

        s = self.settings
        path = os.pathsep.join(p for p in (str(SOURCE_ROOT), os.environ.get("PYTHONPATH")) if p)
        runtime_env = {"env_vars": {"PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}}
        if s.ray_address:
            ray.init(address=s.ray_address, runtime_env=runtime_env, log_to_driver=True)
        else:
            cpus = max(os.cpu_count() or 1, s.most_replicas * s.threads_per_replica)
            ray.init(num_cpus=cpus, include_dashboard=False, runtime_env=runtime_env)
            self.started_ray = True
        serve.start(proxy_location="Disabled")
        app = serve.deployment(EngineReplica, **self.deployment_options()).bind(self.replica_settings)
        log.info(
            "starting %s engine replicas",
            s.replicas if not s.autoscaling else f"{s.min_replicas}-{s.max_replicas}",
        )
        return serve.run(app, name=APP, route_prefix=None)

    def stop(self) -> None:
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            if self.started_ray:
                serve.shutdown()
            else:
                serve.delete(APP)
        except Exception:
            log.exception("stopping the Serve application failed")
        ray.shutdown()


class ClusterThread(threading.Thread):
    """Starts the cluster, keeps it (and Ray's processes, which die with this thread) until `finish`, stops it."""

    def __init__(self, cluster: Cluster):
        super().__init__(name="motet-cluster", daemon=True)
        self.cluster = cluster
        self.handle = None
        self.error: BaseException | None = None
        self.started = threading.Event()  # the handle, or the error, is there
        self._finish = threading.Event()

    def run(self) -> None:
        try:
            self.handle = self.cluster.start()
        except BaseException as e:  # handed to the ingress, which fails its start-up with it
            self.error = e
        finally:
            self.started.set()
        self._finish.wait()
        self.cluster.stop()

    def finish(self) -> None:
        self._finish.set()
