"""`motet eval SUITE`: run one eval suite against a server and write a report directory.

    motet eval SUITE [--base-url URL | --model NAME_OR_PATH --server-args "..." [--port P]] [--data FILE]
                     [--limit N] [--concurrency C] [--out DIR] [--compare-url URL2 | --compare-server-args "..."]
                     [--compare-label L] [suite flags]

Without --base-url it starts `motet serve` itself on a loopback port (--port, else a free one; with
--server-args) and stops it at the end, Ctrl-C included. With a second server (--compare-url, or --compare-server-args for a
second managed server started after the first one stopped) the suite runs against both, and the report
puts them side by side. The report directory (default reports/eval/<suite>-<timestamp>/) gets
results.json, summary.md and PNG plots; the short summary and the report's path are printed last.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from urllib.parse import quote

import httpx

from motet.evals import report
from motet.evals.context import EvalContext
from motet.evals.report import Run
from motet.evals.server import ManagedServer, ServerError
from motet.flag_types import OneLineErrors, input_file, integer, output_directory


def _common_args(p: argparse.ArgumentParser, needs_server: bool) -> None:
    g = p.add_argument_group("common options")
    g.add_argument(
        "--model",
        default=None,
        help="model name sent in requests; for a server started here also its --model (name or local "
        "checkpoint dir), unless --server-args names one. Default: the server's first model (GET /v1/models); "
        "offline suites: SmolLM2-135M-Instruct",
    )
    g.add_argument(
        "--data", type=input_file, default=None, help="the suite's data file (default: its dev set)"
    )
    g.add_argument(
        "--limit", type=int, default=None, help="a slice of N items (taken across categories; see the suite)"
    )
    g.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    g.add_argument(
        "--out",
        type=output_directory,
        default=None,
        help="report directory (default: reports/eval/SUITE-TIME)",
    )
    if not needs_server:
        return
    g = p.add_argument_group("server options")
    g.add_argument(
        "--base-url", default=None, help="a running OpenAI-compatible server, e.g. http://host:8000/v1"
    )
    g.add_argument("--api-key", default=os.environ.get("MOTET_API_KEY"), help="bearer key ($MOTET_API_KEY)")
    g.add_argument("--label", default=None, help="this server's name in the report")
    g.add_argument(
        "--server-args",
        default="",
        help='flags for the `motet serve` started here, e.g. "--grammar-backend outlines" (one flag alone: '
        "--server-args=--no-prefix-caching)",
    )
    g.add_argument(
        "--port",
        type=integer(1, 65535),
        default=None,
        help="the port of the `motet serve` started here, on 127.0.0.1 (default: a free one); the compared "
        "server started after it takes the same",
    )
    g.add_argument("--server-timeout", type=float, default=600, help="seconds to wait for a started server")
    g.add_argument("--compare-url", default=None, help="a second server to run the suite against")
    g.add_argument(
        "--compare-server-args",
        default=None,
        help="start a second `motet serve` with these flags (after the first one) and compare",
    )
    g.add_argument("--compare-label", default=None, help="the second server's name in the report")


def build_parser(suites: dict[str, ModuleType], broken: dict[str, str]) -> argparse.ArgumentParser:
    epilog = "".join(f"\n  {name}: unavailable ({why})" for name, why in broken.items())
    parser = OneLineErrors(
        prog="motet eval",
        description=__doc__,
        epilog=epilog or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, module in suites.items():
        doc = (module.__doc__ or name).strip()
        p = sub.add_parser(
            name,
            help=doc.splitlines()[0],
            description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _common_args(p, module.NEEDS_SERVER)
        module.add_arguments(p)
    return parser


def _normalize_base_url(url: str) -> str:
    """`http://host:port` -> `http://host:port/v1`: OpenAI clients want the versioned root."""
    url = url.rstrip("/")
    return url if "/" in url.partition("://")[2] else f"{url}/v1"


def _checked_model(ctx: EvalContext) -> str:
    """The model to send: --model where the server has it (a clear error where it does not, before any request
    is sent), else the first model the server lists (GET /v1/models)."""
    r = httpx.get(f"{ctx.base_url}/models", headers=ctx.headers(), timeout=30)
    if ctx.model and r.status_code in (404, 405):  # a server without the listing: take --model as given
        return ctx.model
    r.raise_for_status()
    listed = [m["id"] for m in r.json().get("data") or []]
    if not ctx.model:
        if not listed:
            raise ValueError(f"{ctx.base_url}/models lists no model: pass --model")
        return listed[0]
    if ctx.model in listed:
        return ctx.model
    # a name the listing does not show but the server answers to (motet: the served name's aliases)
    one = httpx.get(f"{ctx.base_url}/models/{quote(ctx.model)}", headers=ctx.headers(), timeout=30)
    if one.status_code == 200:
        return ctx.model
    raise ValueError(
        f"the server at {ctx.base_url} has no model {ctx.model!r} (it lists: {', '.join(listed) or 'none'}): "
        "pass one of those with --model, or leave --model out for the first"
    )


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in a command line (`--flag V` or `--flag=V`; the last one given), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg.partition("=")[2]
    return value


def _target(url: str | None, server_args: str, label: str | None) -> dict:
    """A server to evaluate: {url (None: start one), server_args, label}."""
    url = _normalize_base_url(url) if url else None
    argv = shlex.split(server_args)
    return {"url": url, "server_args": argv, "label": label or url or " ".join(["motet", *argv])}


def _targets(args) -> list[dict]:
    """The servers to evaluate, in order: the main one, then the one to compare with (if any)."""
    if args.base_url and args.server_args:
        raise ValueError("--server-args is for a server motet eval starts; it does not apply with --base-url")
    if args.base_url and args.port is not None:
        raise ValueError("--port is for a server motet eval starts; it does not apply with --base-url")
    if args.compare_url and args.compare_server_args is not None:
        raise ValueError("give either --compare-url or --compare-server-args, not both")
    targets = [_target(args.base_url, args.server_args, args.label)]
    if args.compare_url or args.compare_server_args is not None:
        targets.append(_target(args.compare_url, args.compare_server_args or "", args.compare_label))
        if targets[0]["label"] == targets[1]["label"]:
            if args.label and args.compare_label:
                raise ValueError(f"both servers are labelled {args.label!r}: pass two different labels")
            targets[1]["label"] += " (2)"
    if any(
        _flag_value(t["server_args"], "--port") is not None for t in targets
    ):  # (it would wait on another)
        raise ValueError("give the managed server's port as motet eval --port, not in --server-args")
    return targets


def _run_one(module: ModuleType, args, out_dir: Path, target: dict) -> Run:
    started = time.perf_counter()
    server = None
    if target["url"] is None:
        log = out_dir / f"server-{report._slug(target['label'])}.log"
        print(
            f"starting motet serve {' '.join(target['server_args'])} (log: {log})",
            file=sys.stderr,
            flush=True,
        )
        server = ManagedServer(
            target["server_args"],
            model=args.model,
            log_path=log,
            start_timeout=args.server_timeout,
            port=args.port,
        )
        server.start()
    try:
        ctx = EvalContext(
            base_url=server.base_url if server else target["url"],
            model=args.model or "",
            api_key=args.api_key,
            data=args.data,
            limit=args.limit,
            concurrency=args.concurrency,
            out_dir=out_dir,
            args=args,
            managed=server is not None,
            label=target["label"],
            # the checkpoint a server started here serves (None: the default model)
            model_path=(_flag_value(target["server_args"], "--model") or args.model) if server else None,
        )
        ctx.model = _checked_model(ctx)
        results = module.run(ctx)
    finally:
        if server is not None:
            server.stop()
    return Run(
        label=target["label"],
        base_url=ctx.base_url,
        model=ctx.model,
        managed=ctx.managed,
        server_args=target["server_args"],
        seconds=time.perf_counter() - started,
        results=results,
    )


def _run_offline(module: ModuleType, args, out_dir: Path) -> Run:
    from motet.engine.weights.model_store import DEFAULT_MODEL

    started = time.perf_counter()
    ctx = EvalContext(
        base_url="",
        model=args.model or DEFAULT_MODEL,
        api_key=None,
        data=args.data,
        limit=args.limit,
        concurrency=args.concurrency,
        out_dir=out_dir,
        args=args,
        managed=False,
        label="offline",
    )
    results = module.run(ctx)
    return Run("offline", "", ctx.model, False, seconds=time.perf_counter() - started, results=results)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def main(argv: list[str] | None = None) -> int:
    from motet.evals.suites import discover

    argv = list(sys.argv[1:] if argv is None else argv)
    suites, broken = discover()
    args = build_parser(suites, broken).parse_args(argv)
    module = suites[args.suite]
    out_dir = args.out or Path("reports") / "eval" / f"{args.suite}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # (what --out's check cannot see: a directory it may not write in)
        print(f"motet eval: error: --out {out_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so a started server is stopped on the way out.
    previous = signal.signal(signal.SIGTERM, _interrupt) if _main_thread() else None
    try:
        if module.NEEDS_SERVER:
            runs = [_run_one(module, args, out_dir, t) for t in _targets(args)]
        else:
            runs = [_run_offline(module, args, out_dir)]
        text = report.write(out_dir, module, runs, argv)
        failures = [f"[{r.label}] {why}" for r in runs if (why := report.failure(module, r.results))]
    except KeyboardInterrupt:
        print("\nmotet eval: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, ServerError, httpx.HTTPError) as e:  # user-facing: one clear line
        print(f"motet eval: error: {e}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(text)
    print(f"report: {out_dir}/summary.md")
    for line in failures:  # a run whose requests all failed measured nothing: not a success
        print(f"motet eval: error: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
