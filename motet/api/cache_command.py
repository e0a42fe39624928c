"""`motet cache`: the prepared-weights cache's entries listed and removed (motet/engine/weights/prepared_store.py).

Each model served on a CPU leaves its weights as the native step reads them (packed, requantized) in an entry under
$MOTET_WEIGHTS_CACHE_DIR (else <MOTET_CACHE_DIR or ~/.cache/motet>/weights), which later starts map instead of
preparing them again; `motet serve --weights-cache-gb` bounds them (the least recently used evicted).

    motet cache ls [--json]        the entries, the most recently used first
    motet cache rm KEY | --all     remove one entry (its key or a prefix of it) or every one
"""

from __future__ import annotations

import datetime
import json
import sys


def add_cache_parser(sub, **fmt) -> None:
    p = sub.add_parser(
        "cache",
        help="list or remove the prepared-weights cache's entries",
        description=__doc__.split("\n\n")[1],
    )
    p.set_defaults(func=lambda args: p.print_help() or 2)
    actions = p.add_subparsers(dest="action")
    ls = actions.add_parser("ls", help="the entries, the most recently used first", **fmt)
    ls.add_argument("--json", action="store_true", help="one JSON object an entry, a line each")
    ls.set_defaults(func=cmd_ls)
    rm = actions.add_parser("rm", help="remove an entry (a later start prepares its weights again)", **fmt)
    which = rm.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "key", nargs="?", metavar="KEY", help="an entry's key, or a prefix of it (`motet cache ls`)"
    )
    which.add_argument("--all", action="store_true", help="every entry")
    rm.set_defaults(func=cmd_rm)


def cmd_ls(args) -> int:
    from motet.engine.weights.prepared_store import PreparedStore

    store = PreparedStore()
    entries = store.entries()
    if args.json:
        for e in entries:
            row = {"key": e.key, "path": str(e.path), "label": e.label, "bytes": e.nbytes,
                   "last_used": e.last_used, "source": e.source, "settings": e.settings}  # fmt: skip
            print(json.dumps(row))
        return 0
    total = sum(e.nbytes for e in entries)
    print(f"{store.root}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, {_size(total)}")
    if entries:
        print(f"{'KEY':<12}  {'SIZE':>9}  {'LAST USED':<19}  {'DTYPE':<8}  {'ISA':<10}  MODEL")
    for e in entries:
        used = datetime.datetime.fromtimestamp(e.last_used).strftime("%Y-%m-%d %H:%M:%S")
        s = e.settings
        model = ", ".join(e.source[-1:]) or e.label
        print(f"{e.key[:12]:<12}  {_size(e.nbytes):>9}  {used:<19}  {s.get('dtype', '?'):<8}  "
              f"{s.get('isa', '?'):<10}  {model}")  # fmt: skip
    return 0


def cmd_rm(args) -> int:
    from motet.engine.weights.prepared_store import PreparedStore

    store = PreparedStore()
    if not args.all:
        matches = [e for e in store.entries() if e.key.startswith(args.key)]
        if len(matches) != 1:
            what = "no entry" if not matches else f"{len(matches)} entries"
            print(f"motet cache rm: {what} with a key beginning {args.key!r} (`motet cache ls` lists them)",
                  file=sys.stderr)  # fmt: skip
            return 2
    removed = store.remove(None if args.all else args.key)
    for e in removed:
        print(f"removed {e.key[:12]} ({_size(e.nbytes)}, {e.label})")
    return 0


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
