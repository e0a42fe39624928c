"""What strict mode refuses on JSONSchemaBench, and whether xgrammar enforces what it lets through.

    python -m benchmarks.strict_report [--data FILE (default: the shipped JSONSchemaBench dev set)] [--limit N]

For each schema: is it refused under `strict: true` (grammar.enforceable), and why; then, for the
schemas that pass, every invalid test instance is fed through xgrammar's matcher twice, compiled from
the schema as given and from its rewrite (`simplify`), counting the invalid instances each accepts.
The rewrite must not change validity: each test instance's jsonschema verdict is compared too.
Prints a Markdown report.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
from collections import Counter
from pathlib import Path

import jsonschema
from jsonschema.validators import validator_for

from motet.evals.datasets import dev_set_path, read_jsonl
from motet.grammar.enforceable import simplify, unenforceable
from motet.grammar.schema_normalize import normalize_schema
from motet.grammar.specs import DEFAULT_MAX_WHITESPACE

DATA = dev_set_path("jsonschemabench")


def _kind(problem: str) -> str:
    """ "'anyOf' beside 'type', 'required' at #/x" -> "'anyOf' beside other keywords" """
    kind = re.sub(r" \(.*\)$", "", problem.rsplit(" at ", 1)[0]).split(" with ")[0]
    return kind.split(" beside ")[0] + " beside other keywords" if " beside '" in kind else kind


def _alarm(_signum, _frame):
    raise TimeoutError


def main(argv: list[str] | None = None) -> None:
    from xgrammar.testing import _is_grammar_accept_string

    from motet.grammar.xgrammar_backend import json_schema_grammar  # the backend's own settings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--timeout", type=int, default=10, help="seconds per schema compile")
    args = p.parse_args(argv)
    signal.signal(signal.SIGALRM, _alarm)

    reasons: Counter = Counter()
    n = refused = same = differ = 0
    accepted = {"as given": 0, "rewritten": 0}
    rejected = {"as given": 0, "rewritten": 0}
    failed = Counter()
    for rec in read_jsonl(args.data)[: args.limit]:
        try:
            schema = normalize_schema(rec["schema"])
        except Exception:
            continue
        n += 1
        rewritten = simplify(schema)
        cls = validator_for(schema, default=jsonschema.Draft202012Validator)
        for t in rec["tests"]:
            if cls(schema).is_valid(t["data"]) == cls(rewritten).is_valid(t["data"]):
                same += 1
            else:
                differ += 1
        problems = unenforceable(rewritten)
        if problems:
            refused += 1
            reasons.update({_kind(p) for p in problems})
            continue
        for name, variant in (("as given", schema), ("rewritten", rewritten)):
            signal.alarm(args.timeout)
            try:
                g = json_schema_grammar(variant, strict=True, max_whitespace=DEFAULT_MAX_WHITESPACE)
                for t in rec["tests"]:
                    if not t["valid"]:
                        hit = _is_grammar_accept_string(g, json.dumps(t["data"]))
                        (accepted if hit else rejected)[name] += 1
            except Exception as e:  # compile errors and timeouts
                failed[name, type(e).__name__] += 1
            finally:
                signal.alarm(0)

    print(f"# Strict mode on {args.data.name}: {n} schemas\n")
    print(f"- refused under strict: {refused} ({refused / max(n, 1):.1%})")
    print(f"- rewrite keeps every verdict: {same} test instances agree, {differ} differ\n")
    print("| compiled from | invalid instances accepted | rejected |\n|---|---:|---:|")
    for name in accepted:
        print(f"| schema {name} | {accepted[name]} | {rejected[name]} |")
    if failed:
        print("\nNot compiled: " + ", ".join(f"{k[0]} {k[1]}: {v}" for k, v in failed.items()))
    print("\n| refused for | schemas |\n|---|---:|")
    for reason, count in reasons.most_common():
        print(f"| {reason} | {count} |")


if __name__ == "__main__":
    main()
