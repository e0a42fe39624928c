"""`motet serve`'s scale-out flags, and the ClusterSystem they ask for (motet/api/server.py calls both).

Without --replicas, --prefill-replicas, --ray-address or --max-replicas, `motet serve` is the single-process
server.
Nothing here imports Ray until a cluster is asked for.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from motet.cluster.launch import ROUTERS, ClusterSettings
from motet.engine.config import EngineConfig
from motet.flag_types import integer, number, or_url, output_directory
from motet.settings_flags import SettingsFlags

# The scale-out flags that set a ClusterSettings field of their own (the others: `cluster_system`).
CLUSTER_FLAGS = SettingsFlags()


def add_args(p) -> None:
    g = p.add_argument_group("scale-out on Ray Serve (the `cluster` extra)")
    flag = CLUSTER_FLAGS.adder(g, ClusterSettings)
    g.add_argument(
        "--replicas",
        type=integer(1),
        default=None,
        help="engine replicas behind this server (Ray Serve; default: none, the engine runs in this process)",
    )
    flag("--ray-address", help="join this Ray cluster (default: none, a local Ray starts)")
    flag(
        "--min-replicas",
        type=integer(0),
        help="autoscale: at least this many replicas (default: none, no autoscaling)",
    )
    flag(
        "--max-replicas",
        type=integer(1),
        help="autoscale: at most this many replicas (default: none, no autoscaling)",
    )
    flag(
        "--target-ongoing-requests",
        type=number(0, above=True),
        help="autoscale: requests per replica (queued at it or running) to aim for",
    )
    g.add_argument(
        "--max-ongoing-requests",
        type=integer(1),
        default=None,
        help="requests one replica takes at once; more wait at the ingress "
        "(default: --max-num-seqs + --max-waiting)",
    )
    flag(
        "--router",
        choices=ROUTERS,
        help="motet: by cached prefix, adapter and load; pow2: Ray Serve's default (power of two choices)",
    )
    flag(
        "--fine-tuning-ray-resource",
        metavar="NAME",
        help="fine-tuning jobs train as Ray Train runs on a node holding the custom resource NAME (`ray start "
        "--resources '{\"NAME\": 1}'`; a local Ray holds one unit), their run directories under --data-dir at the "
        "same path there (default: in this machine, as a child process of the server)",
    )
    g.add_argument(
        "--adapter-store",
        default=None,
        metavar="URL",
        help="an fsspec URL (s3://..., file:///...) every replica reads uploaded adapters from "
        "(default: --data-dir, read in place)",
    )
    g.add_argument(
        "--prefill-replicas",
        type=integer(1),
        default=None,
        help="prefill/decode disaggregation: this many replicas compute prompts' KV, handed to the decode "
        "replicas through the shared KV tier (--kv-shared-dir); default: none, each replica does both",
    )
    g.add_argument(
        "--decode-replicas",
        type=integer(1),
        default=None,
        help="with --prefill-replicas: the replicas that decode (default: --replicas, else 1)",
    )
    g.add_argument(
        "--kv-shared-dir",
        type=or_url(output_directory),
        default=None,
        metavar="PATH|URL",
        help="a KV tier every replica reads and writes: a directory or fsspec URL (file:///..., s3://...), "
        "entries checksummed and bound to the model and KV layout; a prefix one replica computed is a hit for "
        f"all (default: none; with --prefill-replicas on a local Ray, {DEFAULT_KV_SHARED_DIR})",
    )
    g.add_argument(
        "--kv-shared-gb",
        type=number(0, above=True),
        default=EngineConfig.kv_shared_gb,
        help="the shared KV tier's bound, in GiB: each replica keeps the entries it knows of within it",
    )


# Under disaggregation on one machine, the shared KV tier's default (as the replicas' adapter cache is there)
DEFAULT_KV_SHARED_DIR = str(Path(tempfile.gettempdir()) / "motet-kv-shared")


def wants_cluster(args) -> bool:
    return bool(args.replicas or args.ray_address or args.max_replicas or _prefill_replicas(args))


def _prefill_replicas(args) -> int:
    return getattr(args, "prefill_replicas", None) or 0


def pools(args) -> tuple[int, int]:
    """(prefill replicas, decode replicas or colocated ones); ValueError naming a bad flag."""
    prefill, decode = _prefill_replicas(args), getattr(args, "decode_replicas", None)
    if decode is not None and not prefill:
        raise ValueError("--decode-replicas goes with --prefill-replicas (use --replicas otherwise)")
    if decode is not None and args.replicas is not None and decode != args.replicas:
        raise ValueError("--replicas and --decode-replicas disagree: give one")
    return prefill, decode or args.replicas or args.min_replicas or 1


def kv_shared_dir(args, prefill_replicas: int) -> str | None:
    """The shared KV tier's directory or URL: --kv-shared-dir, or a default on one machine under
    disaggregation (which needs one); ValueError where none can be chosen."""
    if args.kv_shared_dir:
        return args.kv_shared_dir
    if not prefill_replicas:
        return None
    if args.ray_address:
        raise ValueError(
            "--prefill-replicas on a joined cluster needs --kv-shared-dir, a store every node reaches"
        )
    return DEFAULT_KV_SHARED_DIR


def adapter_dirs(args) -> dict[str, Path]:
    """The local directories where a cluster keeps copies of tenants' adapters, besides --data-dir (flag or
    role -> directory): no --lora-load-dir may overlap them."""
    if not wants_cluster(args) or not args.adapter_store:
        return {}
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from motet.cluster.shared_adapter_store import SharedAdapterStore

    dirs = {"the replicas' adapter cache": SharedAdapterStore().cache_dir}
    fs, root = fsspec.core.url_to_fs(args.adapter_store)
    if isinstance(fs, LocalFileSystem):  # a store on this machine: file:///..., or a plain path
        dirs["--adapter-store"] = Path(root)
    return dirs


def training_launch(args):
    """Where fine-tuning jobs train: behind a cluster with --fine-tuning-ray-resource, as Ray Train runs (None: the
    runner's own child processes); ValueError for the flag without a cluster."""
    resource = getattr(args, "fine_tuning_ray_resource", None)
    if not resource:
        return None
    if not wants_cluster(args):
        raise ValueError("--fine-tuning-ray-resource goes with a Ray cluster (--replicas or --ray-address)")
    import functools

    from motet.cluster.training_jobs import RayTrainWorker

    return functools.partial(RayTrainWorker.start, resource)


def cluster_system(args, config, loras: dict[str, Path]):
    """The ClusterSystem for `motet serve --replicas N ...`; ValueError naming a bad flag."""
    from motet.cluster.cluster_system import ClusterSystem
    from motet.cluster.launch import Cluster
    from motet.cluster.replica import ReplicaSettings
    from motet.cluster.shared_adapter_store import SharedAdapterStore
    from motet.engine.config import default_cpu_threads
    from motet.engine.weights.model_store import resolve_model

    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install -e '.[cluster]'") from None
    prefill, replicas = pools(args)
    config.kv_shared_dir = kv_shared_dir(args, prefill)
    config.kv_shared_gb = args.kv_shared_gb
    if config.kv_shared_dir and not config.enable_prefix_caching:
        raise ValueError(
            "--kv-shared-dir and --prefill-replicas need the prefix cache (drop --no-prefix-caching)"
        )
    if config.kv_shared_dir and config.tensor_parallel_size > 1:  # as the engine's other KV tiers
        raise ValueError("--kv-shared-dir and --prefill-replicas do not work with --tensor-parallel-size yet")
    if args.threads is None:  # the machine's cores, shared by the replicas (engine/config.py)
        config.num_threads = default_cpu_threads(replicas + prefill)
    settings = ClusterSettings(
        **CLUSTER_FLAGS.values(args),
        replicas=replicas,
        drain_timeout_s=args.drain_timeout,
        max_ongoing_requests=args.max_ongoing_requests or config.max_num_seqs + args.max_waiting,
        threads_per_replica=config.num_threads,
        prefill_replicas=prefill,
    )
    model_dir = resolve_model(config.model)
    config.model = str(model_dir)  # replicas load the same files, resolved once here
    store = SharedAdapterStore(args.adapter_store)
    replica = ReplicaSettings(
        engine_config=config,
        loras=loras,
        max_queue_len=args.max_queue_len,
        max_waiting=args.max_waiting,
        adapter_store=args.adapter_store,
    )
    return ClusterSystem(Cluster(settings, replica), store)
