"""`motet serve`'s scale-out flags, and the ClusterSystem they ask for (motet/api/server.py calls both).

Without --replicas, --ray-address or --max-replicas, `motet serve` is the single-process server.
Nothing here imports Ray until a cluster is asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

from motet.cluster.launch import ROUTERS, ClusterSettings
from motet.flag_types import integer, number


def add_args(p) -> None:
    g = p.add_argument_group("scale-out on Ray Serve (the `cluster` extra)")
    g.add_argument(
        "--replicas",
        type=integer(1),
        default=None,
        help="engine replicas behind this server (Ray Serve; default: none, the engine runs in this process)",
    )
    g.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: none, a local Ray starts)"
    )
    g.add_argument(
        "--min-replicas",
        type=integer(0),
        default=None,
        help="autoscale: at least this many replicas (default: none, no autoscaling)",
    )
    g.add_argument(
        "--max-replicas",
        type=integer(1),
        default=None,
        help="autoscale: at most this many replicas (default: none, no autoscaling)",
    )
    g.add_argument(
        "--target-ongoing-requests",
        type=number(0, above=True),
        default=ClusterSettings.target_ongoing_requests,
        help="autoscale: requests per replica (queued at it or running) to aim for",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=integer(1),
        default=None,
        help="requests one replica takes at once; more wait at the ingress "
        "(default: --max-num-seqs + --max-waiting)",
    )
    g.add_argument(
        "--router",
        default="motet",
        choices=ROUTERS,
        help="motet: by cached prefix, adapter and load; pow2: Ray Serve's default (power of two choices)",
    )
    g.add_argument(
        "--adapter-store",
        default=None,
        metavar="URL",
        help="an fsspec URL (s3://..., file:///...) every replica reads uploaded adapters from "
        "(default: --data-dir, read in place)",
    )


def wants_cluster(args) -> bool:
    return bool(args.replicas or args.ray_address or args.max_replicas)


def adapter_dirs(args) -> dict[str, Path]:
    """The local directories where a cluster keeps copies of tenants' adapters, besides --data-dir (flag or
    role -> directory): no --lora-load-dir may overlap them."""
    if not wants_cluster(args) or not args.adapter_store:
        return {}
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from motet.cluster.adapter_store import SharedAdapterStore

    dirs = {"the replicas' adapter cache": SharedAdapterStore().cache_dir}
    fs, root = fsspec.core.url_to_fs(args.adapter_store)
    if isinstance(fs, LocalFileSystem):  # a store on this machine: file:///..., or a plain path
        dirs["--adapter-store"] = Path(root)
    return dirs


def cluster_system(args, config, loras: dict[str, Path]):
    """The ClusterSystem for `motet serve --replicas N ...`; ValueError naming a bad flag."""
    from motet.cluster.adapter_store import SharedAdapterStore
    from motet.cluster.ingress import ClusterSystem
    from motet.cluster.launch import Cluster
    from motet.cluster.model_view import ModelView
    from motet.cluster.replica import ReplicaSettings
    from motet.engine.model_store import resolve_model

    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install -e '.[cluster]'") from None
    replicas = args.replicas or args.min_replicas or 1
    if args.threads is None:  # the machine's cores, all but one (the ingress's), shared by the replicas
        config.num_threads = max(1, ((os.cpu_count() or 2) - 1) // replicas)
    settings = ClusterSettings(
        replicas=replicas,
        min_replicas=args.min_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        ray_address=args.ray_address,
        router=args.router,
        drain_timeout_s=args.drain_timeout,
        max_ongoing_requests=args.max_ongoing_requests or config.max_num_seqs + args.max_waiting,
        threads_per_replica=config.num_threads,
    )
    model_dir = resolve_model(config.model)
    config.model = str(model_dir)  # replicas load the same files, resolved once here
    store = SharedAdapterStore(args.adapter_store)
    replica = ReplicaSettings(
        engine=config,
        loras=loras,
        max_queue_len=args.max_queue_len,
        max_waiting=args.max_waiting,
        adapter_store=args.adapter_store,
    )
    return ClusterSystem(Cluster(settings, replica), ModelView(config, model_dir), store)
