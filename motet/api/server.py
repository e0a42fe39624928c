"""`motet serve`: its flags, and wiring the engine, the actors and the app onto uvicorn.

Start-up checks what it can before anything listens (the model resolves to a checkpoint motet serves, the
flags' values, the port is free: `prepare`, reading configs and flags only, in well under a second): a failure
there is one line and exit status 2. Then the port opens and answers at once (GET /health: 503 with the load's
progress, motet/api/starting.py) while the API's modules are imported, its stores opened and the model loaded
beside it; "ready" is logged once /health answers 200 (motet/api/status_log.py). Heavy imports happen inside the
functions that need them: the parser (`add_serve_args`) and `prepare` import no torch, transformers or starlette.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from motet.api.fine_tuning import flags as fine_tuning_flags
from motet.api.generation_config import override_object
from motet.cluster import serve_flags
from motet.flag_types import (
    MAX_DAYS,
    host_name,
    integer,
    json_file,
    json_text,
    model_name,
    number,
    output_directory,
    path_setting,
    seconds,
    web_origin,
)

log = logging.getLogger("motet.server")

DEFAULT_DATA_DIR = "~/.local/share/motet"


def data_dir(flag: str | Path | None, model: str) -> Path:
    """The server's data directory: --data-dir, else $MOTET_DATA_DIR (either is shared by every model served
    with it), else one of `model`'s own under DEFAULT_DATA_DIR, so that one model's adapters, files, responses
    and batches never meet another's. A ValueError where it cannot be a directory (as --data-dir's check
    refuses: $MOTET_DATA_DIR a file, say)."""
    from motet.engine.weights.model_store import model_key

    if flag:
        return Path(flag).expanduser()
    if os.environ.get("MOTET_DATA_DIR"):
        return path_setting(output_directory, os.environ["MOTET_DATA_DIR"], "$MOTET_DATA_DIR")
    own = Path(DEFAULT_DATA_DIR).expanduser() / model_key(model)
    return path_setting(output_directory, str(own), "the data directory")


def warn_of_shared_data(flag: str | None, data: Path) -> None:
    """Data kept in DEFAULT_DATA_DIR itself (before data directories were per model) is not lost: say where."""
    old = Path(DEFAULT_DATA_DIR).expanduser()
    if flag or os.environ.get("MOTET_DATA_DIR") or not old.is_dir():
        return
    # the old layout: adapters/ and the stores' SQLite files (model directories hold them now)
    if not ((old / "adapters").is_dir() or any(p.is_file() for p in old.iterdir())):
        return
    log.warning("%s holds data from before each model had its own data directory (this one's: %s); pass "
                "--data-dir %s to serve it", old, data, old)  # fmt: skip


# `motet serve` flag -> (GrammarLimits field, what it bounds); the flags' defaults are the fields'.
GRAMMAR_LIMIT_FLAGS = {
    "--grammar-max-enum-values": ("max_enum_values", "values in one enum or guided_choice"),
    "--grammar-max-properties": ("max_properties", "property names in one schema, all objects together"),
    "--grammar-max-depth": ("max_depth", "nesting of a schema's objects and arrays"),
    "--grammar-max-pattern-length": ("max_pattern_length", "characters in one regex (pattern, guided_regex)"),
    "--grammar-max-schema-bytes": ("max_schema_bytes", "bytes of a schema, EBNF grammar or choice list"),
}


def grammar_limits(args):
    """The GrammarLimits the `--grammar-max-*` flags ask for."""
    from motet.grammar.limits import GrammarLimits

    return GrammarLimits(
        **{field: getattr(args, f"grammar_{field}") for field, _ in GRAMMAR_LIMIT_FLAGS.values()}
    )


def check_model(config) -> tuple[Path, int]:
    """The model's directory and context length; ModelLoadError (a ValueError) naming what is wrong with
    --model, or with a flag the model's config bounds (--tensor-parallel-size: `check_ranks`; --quantization:
    `declared_quantization`) or the memory does (`check_fits`), before anything starts. The default model is
    pulled here when it is not cached yet. Reads configs, not weights, and imports no torch (but to check a
    CUDA device or the ranks of --tensor-parallel-size): `serve` runs it before it binds its port."""
    from motet.engine.weights.model_config import load_model_config
    from motet.engine.weights.model_store import resolve_model
    from motet.engine.weights.quantization_config import declared_quantization
    from motet.engine.worker.memory import check_fits

    model_dir = resolve_model(config.model)
    model = load_model_config(model_dir, config.tokenizer)
    if config.tensor_parallel_size > 1:  # (one rank splits nothing)
        from motet.engine.worker.parallel import check_ranks

        check_ranks(config.tensor_parallel_size, model, config.enable_expert_parallel, config.torch_device)
    declared_quantization(model_dir, config.quantization)
    return model_dir, check_fits(config, model)


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound now: a port in use is a clear error before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (--host, --port)") from None
    sock.set_inheritable(True)
    return sock


ADAPTERS_PER_TENANT = 10 << 30  # --adapters-max-bytes-per-tenant's default
DISK_SHARE = 0.25  # of the data dir's free space at start-up: the most one tenant's files, or its stored
# responses, or the KV disk tier may take, so that one tenant filling its quota leaves room for the others


def fit_to_disk(args, config, data: Path) -> None:
    """Bound the per-tenant stores and the KV disk tier by the free space under `data` at start-up: a flag
    (or default) over DISK_SHARE of it is lowered, with a warning when the operator set it."""
    from motet.api.files.store import DEFAULT_MAX_BYTES_PER_TENANT as FILES_DEFAULT
    from motet.api.responses.store import DEFAULT_MAX_BYTES_PER_TENANT as RESPONSES_DEFAULT

    where = data
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    cap = int(free * DISK_SHARE)
    bounds = [
        ("--files-max-bytes-per-tenant", args, "files_max_bytes_per_tenant", FILES_DEFAULT, 1),
        ("--responses-max-bytes-per-tenant", args, "responses_max_bytes_per_tenant", RESPONSES_DEFAULT, 1),
        ("--adapters-max-bytes-per-tenant", args, "adapters_max_bytes_per_tenant", ADAPTERS_PER_TENANT, 1),
        ("--kv-disk-gb", config, "kv_disk_gb", 0.0, 2**30),
    ]
    for flag, obj, attr, default, unit in bounds:
        value = getattr(obj, attr)
        if value * unit <= cap:
            continue
        lowered = cap // unit if unit == 1 else cap / unit
        say = log.info if value == default else log.warning
        say("%s %s is over a quarter of the %.1f GiB free under %s at start-up: %s applies, so that no tenant "
            "can fill the disk the others' stores use", flag, value, free / 2**30, where, lowered)  # fmt: skip
        setattr(obj, attr, lowered)


@dataclass
class Prepared:
    """What `motet serve` decides from its flags and the model's config before its port answers (`prepare`)."""

    model_dir: Path
    max_model_len: int
    names: list[str]  # the served name, then its aliases
    sampling_defaults: dict
    loras: dict[str, Path]  # --lora: name -> directory
    data: Path  # the data directory
    load_dirs: tuple[Path, ...]  # --lora-load-dir, resolved
    auth: object  # the API keys (motet/api/auth.py Authenticator)


def prepare(args, config, model_dir: Path | None = None, max_model_len: int | None = None) -> Prepared:
    """Every refusal the flags and the model's config decide (a ValueError naming the flag), made before the port
    answers: the model (`check_model`; `model_dir` and `max_model_len` as it found them, else found here), the
    served names, the sampling defaults, --lora, the data directory and --lora-load-dir, the API keys. Reads
    configs and flags; imports none of the engine's or the API's heavy modules."""
    from motet.api.generation_config import sampling_defaults
    from motet.api.served_names import served_names, shared_loras
    from motet.api.vllm_flags import authenticator
    from motet.engine.config import default_cpu_threads
    from motet.lora.names import check_load_dirs

    if model_dir is None or max_model_len is None:
        model_dir, max_model_len = check_model(config)
    if config.num_threads is None:
        config.num_threads = default_cpu_threads()
    if args.tenant_weights:  # (read and checked as the flag was parsed)
        config.tenant_weights = args.tenant_weights
    names = served_names(args, config)
    defaults = sampling_defaults(args.generation_config, model_dir, args.override_generation_config)
    if defaults:
        log.info(
            "requests that omit them sample with %s (the model's generation_config.json%s)",
            ", ".join(f"{k}={v}" for k, v in defaults.items()),
            " and --override-generation-config" if args.override_generation_config else "",
        )
    loras = shared_loras(args.lora, names)
    data = data_dir(args.data_dir, config.model)
    fit_to_disk(args, config, data)
    # before anything starts: no load dir may overlap a place tenants' own adapters are kept
    private = {"--data-dir": data, **serve_flags.adapter_dirs(args)}
    load_dirs = check_load_dirs(args.lora_load_dir or (), private)
    auth = authenticator(args)
    return Prepared(model_dir, max_model_len, names, defaults, loras, data, load_dirs, auth)


def build_state(
    args,
    config,
    model_dir: Path | None = None,
    max_model_len: int | None = None,
    prepared: Prepared | None = None,
):
    """The server's state: its stores and serving system (the engine loads once the system runs), from what
    `prepare` decided (decided here if not given)."""
    from motet.actors.system import ServingSystem
    from motet.actors.training_lease import TrainingLease
    from motet.api.adapters.store import AdapterStore
    from motet.api.batches.priority import LowPriority
    from motet.api.batches.runner import BatchRunner
    from motet.api.batches.store import BatchStore
    from motet.api.files.store import FileStore
    from motet.api.metrics import Metrics
    from motet.api.rate_limits import RateLimiter
    from motet.api.responses.store import ResponseStore
    from motet.api.state import ServerState
    from motet.api.usage import UsageStore
    from motet.engine.llm_engine import LLMEngine

    ready = prepared or prepare(args, config, model_dir, max_model_len)
    model_dir, names, loras, data = ready.model_dir, ready.names, ready.loras, ready.data
    lease = None  # (behind Ray no engine is in this process: a job's worker runs on a node of its own)
    if serve_flags.wants_cluster(args):  # engine replicas on Ray Serve behind this same app
        system = serve_flags.cluster_system(args, config, loras)
    else:
        lease = TrainingLease(args.fine_tuning_share)  # the cores, lent to fine-tuning jobs between steps
        system = ServingSystem(
            lambda: LLMEngine(config, model_dir),
            max_queue_len=args.max_queue_len,
            max_waiting=args.max_waiting,
            loras=loras,
            lease=lease,
        )
    adapters = AdapterStore(
        system,
        data,
        shared=loras,
        reserved=tuple(names),
        max_bytes=args.max_adapter_bytes,
        max_bytes_per_tenant=args.adapters_max_bytes_per_tenant,
        load_dirs=ready.load_dirs,
    )
    responses = ResponseStore(
        data,
        max_age_s=args.responses_max_age_days * 86400,
        max_per_tenant=args.responses_max_per_tenant,
        max_bytes_per_tenant=args.responses_max_bytes_per_tenant,
    )
    files = FileStore(data, args.files_max_bytes, args.files_max_bytes_per_tenant)
    batches = BatchRunner(BatchStore(data), files, LowPriority(args.batch_max_in_flight))
    usage = UsageStore(data)
    fine_tuning = fine_tuning_flags.runner(args, data, files, adapters, usage, config.num_threads, lease)
    state = ServerState(
        system=system,
        model_names=names,
        auth=ready.auth,
        max_body_bytes=args.max_body_bytes,
        adapters=adapters,
        responses=responses,
        files=files,
        batches=batches,
        fine_tuning=fine_tuning,
        reasoning_parser=args.reasoning_parser,
        metrics=Metrics(names[0], ready.max_model_len),
        trust_request_chat_template=args.trust_request_chat_template,
        tool_call_parser=getattr(args, "tool_call_parser", None),
        sampling_defaults=ready.sampling_defaults,
        usage=usage,
        grammar_limits=grammar_limits(args),
        limiter=RateLimiter(wait_s=args.tenant_wait_timeout),
    )
    state.limiter.reload(state.auth.tenant_limits())
    log.info("data directory: %s", data)  # (once every flag was accepted: a refusal stays one line)
    warn_of_shared_data(args.data_dir, data)
    if serve_flags.wants_cluster(args):  # each replica's figures beside the sums
        state.metrics.registry.register(system.replica_metrics())
    return state


def api_app(args, state):
    """The API's app with its middleware: the slow-client limits (motet/api/slow_clients.py), the rate limits, the
    request log and traces where asked for, the origin guard, CORS where asked for."""
    from motet.api.app import create_app
    from motet.api.origin_guard import OriginGuard, flat_list
    from motet.api.rate_limits import RateLimits
    from motet.api.slow_clients import BodyTimeout

    app = create_app(state)
    app.add_middleware(BodyTimeout, timeout=args.request_body_timeout, min_rate=args.request_body_min_rate)
    if args.request_log:
        from motet.api.rate_limits import LIMITED_ROUTES
        from motet.api.usage import RequestLog

        app.add_middleware(RequestLog, paths=LIMITED_ROUTES)
    app.add_middleware(RateLimits, state=state, limiter=state.limiter)  # not on the batch lines' calls
    if args.otlp_traces_endpoint:
        from motet.api import tracing
        from motet.api.rate_limits import LIMITED_ROUTES

        provider = tracing.setup(args.otlp_traces_endpoint)
        app.add_middleware(tracing.Tracing, provider=provider, paths=LIMITED_ROUTES)
        state.on_stop.append(provider.shutdown)  # the last spans are sent before the process ends
    app.add_middleware(
        OriginGuard,
        bind_host=args.host,
        allowed_hosts=args.allowed_hosts,
        allowed_origins=args.allowed_origins,
    )
    if args.allowed_origins:  # CORS only for the pages the operator named (outermost: it answers preflights)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=flat_list(args.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After", "x-request-id"],
        )
    return app


def uvicorn_server(args, app, state=None, on_tick=None):
    """`app` on uvicorn, draining on SIGTERM, with the slow clients' header timeout; `on_tick` runs on the server's
    ticks (the status log); `state`: the ServerState, where it is built already (else `attach`ed once it is)."""
    import uvicorn

    from motet.api.draining import DrainingServer
    from motet.api.slow_clients import header_timeout_protocol

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # uvicorn logs through the root handler, in motet's format
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        access_log=args.access_log,
        http=header_timeout_protocol(args.request_header_timeout),
    )
    return DrainingServer(config, state, args.drain_timeout, on_tick=on_tick)


def read_keys(args):
    """SIGHUP's read (in a thread of its own, under a deadline): the API keys file again (keys, tenants,
    limits) as (authenticator, limits); a file that does not load is a ValueError and the running keys stay."""
    from motet.api.vllm_flags import authenticator

    auth = authenticator(args)
    return auth, auth.tenant_limits()


def apply_keys(state, loaded) -> None:
    """SIGHUP's apply (on the loop): the keys `read_keys` read replace the running ones (`state`: None while the
    server starts, which then reads the keys file again as it builds)."""
    if state is None:
        log.warning("SIGHUP while starting: the keys are read as the server is built")
        return
    auth, limits = loaded
    state.auth = auth
    state.limiter.reload(limits)
    log.info("SIGHUP: reloaded the API keys: %d keys, %d tenants with limits", len(auth.keys), len(limits))


@contextlib.contextmanager
def settled_heap():
    """No collection while the server's modules are imported and its app built (the collector's full passes
    over the objects imports make, growing by a quarter each time, took a second of every start); then one pass,
    and what survives it is frozen (`gc.freeze`: the modules, classes and functions of the libraries live as long
    as the process), so that no later full pass walks the million objects again (0.3 s each, while serving)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        if enabled:
            gc.enable()


def serve(args, config) -> int:
    """Serve until SIGTERM; `config` is the engine's (motet/api/cli.py builds it from the flags). What the flags and
    the model's config decide is checked first (`check_model`, the port bound, `prepare`: a refusal is one line,
    exit 2, before anything answers); then the port answers at once (motet/api/starting.py: /health 503 with the
    load's progress) while the API is built and the model loads beside it; a failure there is one line and a
    non-zero exit."""
    from motet.api.starting import StartingApp
    from motet.api.status_log import StatusLog
    from motet.engine.config import loaded_dtype
    from motet.engine.weights import load_progress

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    model_dir, max_model_len = check_model(config)  # a wrong --model ends here, before anything starts
    sock = listen(args.host, args.port)  # (bound: a port in use is refused; nothing answers before `run`)
    ready = prepare(args, config, model_dir, max_model_len)  # the flags' refusals, and what they decided
    if not serve_flags.wants_cluster(args):  # (the engine's tokenizer, loading beside the imports from here)
        from motet.engine.tokenizer import load_tokenizer_early

        load_tokenizer_early(config.tokenizer or model_dir)
    url = f"http://{args.host}:{args.port}"
    status = StatusLog(None, url, args.log_stats_interval, stats=not args.disable_log_stats)
    server = None

    def build():  # (in a worker thread, the port answering meanwhile)
        load_progress.phase("importing the server's modules")
        with settled_heap():
            state = build_state(args, config, prepared=ready)
            app = api_app(args, state)
        load_progress.phase("starting the serving system")
        server.attach(state)
        status.state = state
        return app

    def failed(error: BaseException) -> None:
        log.error("start-up failed: %s: %s", type(error).__name__, error)
        server.fail(error)

    server = uvicorn_server(args, StartingApp(build, failed), on_tick=status.tick)
    # uvicorn's start-up chatter ("Application startup complete.") would read as ready while the model loads (after
    # uvicorn's Config, which sets its loggers' level)
    if args.log_level != "debug":
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    server.reload_on_sighup(lambda: read_keys(args), lambda loaded: apply_keys(server.state, loaded))
    log.info(
        "loading %s in %s on %s (GET /health answers 503 with the load's progress until it has loaded)",
        ready.names[0],
        loaded_dtype(config, args.dtype),
        url,
    )
    load_progress.told()  # (the heartbeat speaks where no line came for 5 s: from here)
    server.run(sockets=[sock])
    log.info("stopped")
    # Everything has been closed: the interpreter's last collections need not walk the millions of objects of
    # the model's libraries (seconds, which a SIGTERM would wait for).
    gc.freeze()
    atexit.register(quiet_teardown)
    if server.start_error is not None:  # a refusal of the flags' (a ValueError) as the command's own: 2
        return 2 if isinstance(server.start_error, ValueError) else 1
    return 1 if server.state is not None and server.state.fatal is not None else 0


def quiet_teardown() -> None:
    """After "stopped", the interpreter's teardown writes to /dev/null. The frozen collector keeps every cycle
    alive past its module, so nanobind, tearing down triton's bindings (torch's dynamo imports triton wherever it
    is installed, a CPU host too), reports each of their types as leaked: 31 lines after "stopped" that read as
    a crash, about a leak made on purpose, the process ending. triton silences its own workers' teardown the
    same way (triton/_compile_warmup_pool.py); nanobind's switch for it (`set_leak_warnings`) is not one that
    triton's bindings expose. Registered last, it runs first of the exit handlers, after everything was
    logged."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def add_serve_args(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        type=model_name,
        default=None,
        metavar="NAME",
        help="the model's name in the API (the first; the others are aliases; each 1 to 256 characters, no "
        "spaces); default: --model (a GGUF file's stem)",
    )
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="the port to listen on")
    p.add_argument(
        "--allowed-hosts",
        nargs="+",
        type=host_name,
        default=[],
        metavar="HOST",
        help="Host names the server answers to besides loopback names, IP addresses, --host and this machine's "
        "hostname (a DNS-rebinding page is refused); '*': any",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        type=web_origin,
        default=[],
        metavar="ORIGIN",
        help="web pages (scheme://host[:port]) allowed to call the API from a browser, with CORS; default: only "
        "the server's own pages; '*': any",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export a trace span per chat/completions/responses request (children: queue, prefill, decode) "
        "over OTLP/HTTP to URL, e.g. http://localhost:4318/v1/traces",
    )
    p.add_argument(
        "--request-log",
        action="store_true",
        help="log one JSON line per chat/completions/responses request (logger motet.requests): tenant, model, "
        "prompt, cached and completion tokens, TTFT, status, duration",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|FOLDER",
        help="sampling defaults for requests that omit temperature, top_p, top_k, min_p, repetition_penalty or "
        "max_tokens: auto, the model's generation_config.json; vllm, none (the OpenAI defaults); or a folder "
        "holding a generation_config.json (default: auto)",
    )
    p.add_argument(
        "--override-generation-config",
        type=json_text(override_object),
        default=None,
        metavar="JSON",
        help="sampling defaults over --generation-config's, e.g. '{\"temperature\": 0.5}'",
    )
    p.add_argument("--api-keys", default=None, help='JSON file {"key": "tenant"}; none: authentication off')
    p.add_argument(
        "--data-dir",
        type=output_directory,
        default=None,
        help=f"where tenants' uploaded adapters, stored responses, files and batches live, and the KV disk "
        f"tier (--kv-disk-gb) under kv-cache/; one given here or as $MOTET_DATA_DIR is shared by every model "
        f"served with it (default: $MOTET_DATA_DIR, else the model's own: {DEFAULT_DATA_DIR}/<model>-<hash of "
        f"its path>, or {DEFAULT_DATA_DIR}/SmolLM2-135M-Instruct)",
    )
    from motet.api.responses.store import (
        DEFAULT_MAX_AGE_DAYS,
        DEFAULT_MAX_BYTES_PER_TENANT,
        DEFAULT_MAX_PER_TENANT,
    )

    p.add_argument(
        "--responses-max-age-days",
        type=number(0, MAX_DAYS, above=True),
        default=DEFAULT_MAX_AGE_DAYS,
        help=f"stored Responses API responses are kept this long (default: {DEFAULT_MAX_AGE_DAYS:g})",
    )
    p.add_argument(
        "--responses-max-per-tenant",
        type=integer(1),
        default=DEFAULT_MAX_PER_TENANT,
        help=f"stored responses per tenant; a response past it is refused with 400 (store: false still "
        f"works), never made room for by evicting older ones (default: {DEFAULT_MAX_PER_TENANT})",
    )
    p.add_argument(
        "--responses-max-bytes-per-tenant",
        type=integer(1),
        default=DEFAULT_MAX_BYTES_PER_TENANT,
        help="bytes of stored responses per tenant (their JSON, as the model sees the conversation); a response "
        f"past it is refused with 400, never made room for by evicting (default: {DEFAULT_MAX_BYTES_PER_TENANT})",
    )
    from motet.api.batches.priority import DEFAULT_MAX_IN_FLIGHT
    from motet.api.files.store import DEFAULT_MAX_BYTES_PER_TENANT as FILES_PER_TENANT
    from motet.api.files.store import DEFAULT_MAX_FILE_BYTES

    p.add_argument(
        "--files-max-bytes",
        type=integer(1),
        default=DEFAULT_MAX_FILE_BYTES,
        help=f"largest file POST /v1/files takes (a batch's input); larger uploads get 413 "
        f"(default: {DEFAULT_MAX_FILE_BYTES})",
    )
    p.add_argument(
        "--files-max-bytes-per-tenant",
        type=integer(1),
        default=FILES_PER_TENANT,
        help="bytes of files per tenant (uploads and batch results); an upload past it gets 400 "
        f"(default: {FILES_PER_TENANT})",
    )
    p.add_argument(
        "--batch-max-in-flight",
        type=integer(1),
        default=DEFAULT_MAX_IN_FLIGHT,
        help="batch (/v1/batches) requests running at once, all batches together; they are sent only while no "
        f"live request waits (default: {DEFAULT_MAX_IN_FLIGHT})",
    )
    fine_tuning_flags.add_args(p)
    p.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="serve a PEFT adapter directory to every tenant as model NAME (repeatable)",
    )
    p.add_argument(
        "--lora-load-dir",
        action="append",
        metavar="DIR",
        help="a server directory POST /v1/load_lora_adapter may read adapters from (repeatable; default: none, "
        "loading from server paths is off)",
    )
    p.add_argument(
        "--max-adapter-bytes", type=integer(1), default=512 << 20, help="larger adapter uploads get 413"
    )
    p.add_argument(
        "--adapters-max-bytes-per-tenant",
        type=integer(1),
        default=ADAPTERS_PER_TENANT,
        help="a tenant's stored adapters together (uploads and fine-tuned models; at most a quarter of the data "
        "dir's free space at start-up): an adapter past it is refused with 400 storage_quota_exceeded",
    )
    p.add_argument(
        "--max-queue-len", type=integer(1), default=256, help="requests waiting per adapter queue (then 429)"
    )
    p.add_argument(
        "--max-waiting",
        type=integer(1),
        default=16,
        help="requests admitted to the engine but not running (and as many more, each tenant's first)",
    )
    from motet.engine.core.fairness import check_tenant_weights

    p.add_argument(
        "--tenant-weights",
        type=json_file(check_tenant_weights),
        default=None,
        metavar="FILE",
        help='JSON file {"tenant": weight}: each tenant\'s share of a busy server follows its weight (positive '
        "numbers; tenants not named weigh 1; a regular file of at most 16 MiB; default: all equal)",
    )
    p.add_argument("--max-body-bytes", type=integer(1), default=4 << 20, help="larger request bodies get 413")
    p.add_argument(
        "--drain-timeout", type=seconds(0), default=30.0, help="seconds in-flight requests get on SIGTERM"
    )
    from motet.api.tenant_line import DEFAULT_WAIT_S, LINE_PER_PLACE

    p.add_argument(
        "--tenant-wait-timeout",
        type=seconds(0),
        default=DEFAULT_WAIT_S,
        help=f"seconds a request over its tenant's max_concurrent_requests (--api-keys) waits in the tenant's line "
        f"for a place (at most {LINE_PER_PLACE} waiting a place) before its 429; 0: 429 at once (default: "
        f"{DEFAULT_WAIT_S:g})",
    )
    from motet.api.slow_clients import DEFAULT_BODY_MIN_RATE, DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S

    p.add_argument(
        "--request-header-timeout",
        type=seconds(0, above=True),
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="a request's headers must be complete this many seconds after its connection opens or its first "
        f"byte arrives, else 408 and the connection is closed (default: {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--request-body-timeout",
        type=seconds(0, above=True),
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds the server waits for a request's body, plus 1 s per --request-body-min-rate bytes "
        f"received; then 408 and the connection is closed (default: {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--request-body-min-rate",
        type=number(0, above=True),
        default=DEFAULT_BODY_MIN_RATE,
        help=f"bytes/s a slow request body must average beyond --request-body-timeout (default: "
        f"{DEFAULT_BODY_MIN_RATE})",
    )
    from motet.grammar.reasoning import REASONING_FORMATS

    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["none", *REASONING_FORMATS],
        help="how the model writes its reasoning, by vLLM's names: think / qwen3 (<think>...</think>), "
        "deepseek_r1 (the same, the output beginning inside it), granite (Here is my thought process: ...), "
        "openai_gptoss / gpt_oss (GPT-OSS's analysis channel); returned as reasoning_content, and grammars apply "
        "after it (default: the model family's, e.g. qwen3 for Qwen3, openai_gptoss for GPT-OSS, else the chat "
        "template's; none: off)",
    )
    from motet.grammar.limits import GrammarLimits

    for flag, (field, what) in GRAMMAR_LIMIT_FLAGS.items():
        default = getattr(GrammarLimits, field)
        p.add_argument(
            flag,
            dest=f"grammar_{field}",
            type=integer(1),
            default=default,
            help=f"structured output over this gets 400 before compiling: {what} (default: {default})",
        )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the server's log level",
    )
    p.add_argument(
        "--disable-access-log",
        "--disable-uvicorn-access-log",  # vLLM's name
        dest="access_log",
        action="store_false",
        help="do not log each HTTP request (method, path, status) at info",
    )
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="do not log the periodic throughput / load line (vLLM's flag)",
    )
    from motet.api.status_log import DEFAULT_INTERVAL_S

    p.add_argument(
        "--log-stats-interval",
        type=seconds(0, above=True),
        default=DEFAULT_INTERVAL_S,
        metavar="SECONDS",
        help="how often the throughput / load line is logged (at info while requests run, at debug when idle)",
    )
    serve_flags.add_args(p)
    from motet.api.vllm_flags import add_vllm_serve_args

    add_vllm_serve_args(p)  # vLLM's names for what motet serve does
