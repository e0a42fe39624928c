"""Soak: minutes of mixed load against a real `motet serve`, with a disk that fills and frees, replica kills
(with --replicas 2) and clients that cut streams; then the checks an operator cares about.

    python -m benchmarks.soak [--minutes 30] [--replicas 2] [--concurrency 8] [--disk-mb 96] [--model M]
                              [--out benchmarks/reports/soak]

Not part of the test suite: a separate command. The load, from three tenants at once (`--concurrency`
clients): chat completions (whole, streamed, and streams the client cuts after a few chunks, on the base
model or the tenant's adapters), Responses (stored or not, streamed or not, continuing the tenant's
conversations with `previous_response_id`, read back and deleted), adapter uploads and deletes, vLLM's
load_lora_adapter / unload_lora_adapter, and model lists. `--data-dir` is a small tmpfs (`--disk-mb`; mounted
here when running as root, else inside `unshare -rm`, a user and mount namespace of our own) that a filler
file fills to the last byte every `--disk-cycle` seconds for `--disk-full` seconds, then frees; without a
small filesystem to fill, that phase is skipped (never the real disk). With `--replicas N >= 2` a random engine
replica is killed (SIGKILL) every `--kill-every` seconds.

Every answer is classified: ok, a 4xx (counted by status and code), documented (503 and 507, and streams that
end with a clean error event for a lost replica or a failed store), or a failure (any other 5xx, a transport
error, a stream cut without its terminal event, a stored response that cannot be continued). At the end:
every response acknowledged as stored (`store: true` in the final Response) reads back with the same output,
the server goes idle (nothing running, waiting or queued on /metrics), it exits with 0 on SIGTERM and no
process it started is left. Writes results.json and summary.md under --out; exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.peft_adapters import random_peft_adapters
from motet.evals.report import table
from motet.evals.server import ManagedServer

ROOT = Path(__file__).resolve().parents[1]
TENANTS = {"sk-soak-a": "tenant-a", "sk-soak-b": "tenant-b", "sk-soak-c": "tenant-c"}
ADMIN_KEY = "sk-soak-admin"
DOCUMENTED = (503, 507)  # a full disk, a lost replica, starting or draining: documented, with Retry-After
NAMESPACE_ENV = "MOTET_SOAK_IN_NAMESPACE"  # set when this script re-ran itself inside `unshare`
PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "List three prime numbers.",
    "Explain what a tenant is in one sentence.",
    "Say hello in Spanish.",
    "Give me a word that rhymes with cat.",
]
# op -> weight
OPS = {
    "chat": 18,
    "chat_stream": 12,
    "chat_cut": 10,
    "responses": 24,
    "responses_get": 8,
    "responses_delete": 2,
    "adapter_upload": 4,
    "adapter_delete": 2,
    "lora_load": 3,
    "lora_unload": 2,
    "models": 2,
}


# -- the small disk ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_disk(size_mb: int):
    """A tmpfs of `size_mb` mounted on a fresh directory (root only: here, or inside our namespace); None
    when none can be mounted."""
    path = Path(tempfile.mkdtemp(prefix="motet-soak-disk-"))
    mounted = False
    if os.geteuid() == 0:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        mounted = r.returncode == 0 and os.path.ismount(path)
        if not mounted:
            print(f"soak: cannot mount a tmpfs ({r.stderr.strip()}); the disk-full phase is skipped")
    try:
        yield path if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)
        shutil.rmtree(path, ignore_errors=True)


def reexec_in_namespace() -> None:
    """Not root: run this script again inside a user and mount namespace, where it may mount a tmpfs."""
    if os.geteuid() == 0 or os.environ.get(NAMESPACE_ENV) or shutil.which("unshare") is None:
        return
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        return
    env = {**os.environ, NAMESPACE_ENV: "1"}
    os.execvpe("unshare", ["unshare", "-rm", sys.executable, "-m", "benchmarks.soak", *sys.argv[1:]], env)


class DiskFiller:
    """Fills the tmpfs at `mount` to its last byte with one file, and frees it. Refuses anything that is not
    a mount point: the real disk is never filled."""

    def __init__(self, mount: Path):
        if not os.path.ismount(mount):
            raise ValueError(f"{mount} is not a mount point: not filling it")
        self.path = mount / "filler"
        self.cycles = 0
        self.full = False

    def fill(self) -> int:
        written = 0
        with open(self.path, "ab", buffering=0) as f:
            for chunk in (1 << 20, 1 << 12, 1):
                block = b"\0" * chunk
                while True:
                    try:
                        written += f.write(block)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
        self.full, self.cycles = True, self.cycles + 1
        return written

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.full = False


# -- adapters ------------------------------------------------------------------------------------------------
def adapter_files(path: Path) -> list:
    return [
        ("files", (f, (path / f).read_bytes())) for f in ("adapter_config.json", "adapter_model.safetensors")
    ]


# -- the ledger ----------------------------------------------------------------------------------------------
@dataclass
class Ledger:
    counts: Counter = field(default_factory=Counter)  # (op, outcome) -> n
    failures: list = field(default_factory=list)
    stored: dict = field(default_factory=dict)  # response id -> (tenant key, its output)
    heads: dict = field(default_factory=dict)  # tenant key -> ids a conversation may continue from
    uploaded: dict = field(default_factory=dict)  # tenant key -> adapter names it has
    kills: int = 0
    started: float = field(default_factory=time.monotonic)

    def note(self, op: str, outcome: str, detail: str = "") -> None:
        self.counts[(op, outcome)] += 1
        if outcome.startswith("failure"):
            at = time.monotonic() - self.started
            self.failures.append({"op": op, "outcome": outcome, "detail": detail[:300], "at_s": round(at, 1)})

    def status(self, op: str, r: httpx.Response) -> bool:
        """Classify an HTTP answer; True for a 2xx."""
        if r.is_success:
            self.note(op, "ok")
            return True
        code = ""
        with contextlib.suppress(Exception):
            code = r.json()["error"].get("code") or ""
        if r.status_code in DOCUMENTED:
            self.note(op, f"documented:{r.status_code}{':' + code if code else ''}")
        elif r.status_code >= 500:
            self.note(op, f"failure:{r.status_code}", r.text)
        else:
            self.note(op, f"4xx:{r.status_code}{':' + code if code else ''}")
        return False


def stream_error_outcome(message: str) -> str:
    """A stream that ended with a clean error event: documented for a lost replica or the store failing."""
    low = message.lower()
    if "replica" in low:
        return "documented:stream_error:replica_lost"
    if any(w in low for w in ("disk", "storage", "space", "store", "full")):
        return "documented:stream_error:storage"
    return "failure:stream_error"


# -- the load ------------------------------------------------------------------------------------------------
class Load:
    def __init__(self, args, server: ManagedServer, model: str, loadable: list[Path], uploads: list[Path]):
        self.args, self.server, self.model = args, server, model
        self.loadable, self.uploads = loadable, uploads
        self.ledger = Ledger()
        self.rng = random.Random(args.seed)
        self.clients = {
            key: httpx.AsyncClient(
                base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=args.request_timeout
            )
            for key in TENANTS
        }

    async def close(self) -> None:
        for c in self.clients.values():
            await c.aclose()

    def pick_model(self, key: str) -> str:
        mine = self.ledger.uploaded.get(key, [])
        return self.rng.choice(mine) if mine and self.rng.random() < 0.5 else self.model

    def chat_body(self, key: str, **extra) -> dict:
        return {
            "model": self.pick_model(key),
            "messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}],
            "max_tokens": self.rng.randint(4, self.args.max_tokens),
            "temperature": 0.7,
            **extra,
        }

    async def run(self, deadline: float) -> None:
        workers = [self.worker(i, deadline) for i in range(self.args.concurrency)]
        await asyncio.gather(*workers)

    async def worker(self, i: int, deadline: float) -> None:
        """Each op once on the worker's own tenant (in OPS' order: an adapter added, then removed), then ops drawn
        by weight until the deadline: however short the run, every op was exercised."""
        keys = list(TENANTS)
        ops, weights = list(OPS), list(OPS.values())
        opening = [(keys[i % len(keys)], op) for op in ops]
        while opening or time.monotonic() < deadline:
            if opening:
                key, op = opening.pop(0)
            else:
                key = keys[i % len(keys)] if self.rng.random() < 0.7 else self.rng.choice(keys)
                op = self.rng.choices(ops, weights)[0]
            try:
                await getattr(self, f"op_{op}")(key, op)
            except httpx.TransportError as e:
                self.ledger.note(op, f"failure:transport:{type(e).__name__}", repr(e))

    # chat ----------------------------------------------------------------------------------------------
    async def op_chat(self, key: str, op: str) -> None:
        r = await self.clients[key].post("/v1/chat/completions", json=self.chat_body(key))
        self.ledger.status(op, r)

    async def op_chat_stream(self, key: str, op: str, cut_after: int | None = None) -> None:
        body = self.chat_body(key, stream=True)
        if cut_after is not None:
            body["max_tokens"] = max(body["max_tokens"], 32)
        async with self.clients[key].stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self.ledger.status(op, r)
                return
            events, error = 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    outcome = stream_error_outcome(error) if error is not None else "ok"
                    self.ledger.note(op, outcome, error or "")
                    return
                events += 1
                payload = json.loads(data)
                if "error" in payload:
                    error = payload["error"].get("message", "")
                if cut_after is not None and events >= cut_after:
                    self.ledger.note(op, "ok:cut")
                    return  # leaving the block closes the connection mid-stream
            self.ledger.note(op, "failure:stream_cut_by_server", f"after {events} events, no [DONE]")

    async def op_chat_cut(self, key: str, op: str) -> None:
        await self.op_chat_stream(key, op, cut_after=self.rng.randint(1, 4))

    # responses -----------------------------------------------------------------------------------------
    async def op_responses(self, key: str, op: str) -> None:
        store = self.rng.random() < 0.8
        body = {
            "model": self.pick_model(key),
            "input": self.rng.choice(PROMPTS),
            "max_output_tokens": self.rng.randint(4, self.args.max_tokens),
            "store": store,
        }
        heads = self.ledger.heads.setdefault(key, [])
        previous = self.rng.choice(heads) if heads and self.rng.random() < 0.5 else None
        if previous is not None:
            body["previous_response_id"] = previous
        stream = self.rng.random() < 0.4
        op = f"{op}{'_stream' if stream else ''}{'_continue' if previous else ''}"
        client = self.clients[key]
        try:
            if stream:
                final = await self.responses_stream(client, body, op)
            else:
                r = await client.post("/v1/responses", json=body)
                if not self.ledger.status(op, r):
                    self.check_continuation(op, r, previous)
                    return
                final = r.json()
        except httpx.TransportError as e:  # noted under this request's own kind
            self.ledger.note(op, f"failure:transport:{type(e).__name__}", repr(e))
            return
        if final is None:
            return
        if final.get("store") and final.get("status") in ("completed", "incomplete"):
            self.ledger.stored[final["id"]] = (key, final.get("output"))
            if previous is not None and previous in heads:
                heads.remove(previous)
            heads.append(final["id"])
            del heads[: -self.args.conversations_per_tenant]

    def check_continuation(self, op: str, r: httpx.Response, previous: str | None) -> None:
        """Continuing from an acknowledged stored response must work: not found is a lost response."""
        if previous is None or r.status_code != 400:
            return
        with contextlib.suppress(Exception):
            if (
                r.json()["error"].get("code") == "previous_response_not_found"
                and previous in self.ledger.stored
            ):
                self.ledger.note(op, "failure:acknowledged_response_missing", previous)

    async def responses_stream(self, client: httpx.AsyncClient, body: dict, op: str) -> dict | None:
        async with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                self.ledger.status(op, r)
                self.check_continuation(op, r, body.get("previous_response_id"))
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                kind = event.get("type")
                if kind in ("response.completed", "response.incomplete"):
                    self.ledger.note(op, "ok")
                    return event["response"]
                if kind == "response.failed":
                    message = ((event.get("response") or {}).get("error") or {}).get("message", "")
                    self.ledger.note(op, stream_error_outcome(message), message)
                    return None
                if kind == "error":
                    message = event.get("message") or json.dumps(event)
                    self.ledger.note(op, stream_error_outcome(message), message)
                    return None
            self.ledger.note(op, "failure:stream_cut_by_server", "no response.completed / failed")
            return None

    async def op_responses_get(self, key: str, op: str) -> None:
        mine = [rid for rid, (k, _) in self.ledger.stored.items() if k == key]
        if not mine:
            return await self.op_models(key, "models")
        rid = self.rng.choice(mine)
        r = await self.clients[key].get(f"/v1/responses/{rid}")
        if r.status_code == 404 and rid in self.ledger.stored:
            self.ledger.note(op, "failure:acknowledged_response_missing", rid)
        elif self.ledger.status(op, r) and r.json().get("output") != self.ledger.stored[rid][1]:
            self.ledger.note(op, "failure:stored_output_differs", rid)

    async def op_responses_delete(self, key: str, op: str) -> None:
        mine = [rid for rid, (k, _) in self.ledger.stored.items() if k == key]
        if not mine:
            return
        rid = self.rng.choice(mine)
        entry = self.ledger.stored.pop(rid)  # no longer acknowledged: forgotten before the call
        heads = self.ledger.heads.get(key, [])
        if rid in heads:
            heads.remove(rid)
        r = await self.clients[key].delete(f"/v1/responses/{rid}")
        if not self.ledger.status(op, r) and r.status_code in DOCUMENTED:
            self.ledger.stored[rid] = entry  # not deleted: still there, and must stay readable

    # adapters ------------------------------------------------------------------------------------------
    # Two ways in (an upload, vLLM's load_lora_adapter) and out; one list of the tenant's adapters either way.
    async def op_adapter_upload(self, key: str, op: str) -> None:
        def upload(client: httpx.AsyncClient, name: str):
            files = adapter_files(self.rng.choice(self.uploads))
            return client.post("/v1/adapters", data={"name": name}, files=files)

        await self._add_adapter(key, op, "up", upload, "adapter_delete")

    async def op_adapter_delete(self, key: str, op: str) -> None:
        await self._remove_adapter(key, op, lambda client, name: client.delete(f"/v1/adapters/{name}"))

    async def op_lora_load(self, key: str, op: str) -> None:
        def load(client: httpx.AsyncClient, name: str):
            path = str(self.rng.choice(self.loadable))
            return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

        await self._add_adapter(key, op, "ld", load, "lora_unload")

    async def op_lora_unload(self, key: str, op: str) -> None:
        await self._remove_adapter(
            key, op, lambda client, name: client.post("/v1/unload_lora_adapter", json={"lora_name": name})
        )

    async def _add_adapter(self, key: str, op: str, prefix: str, request, remove_op: str) -> None:
        """A new adapter named `prefix` + a random number by `request(client, name)`; at the tenant's limit,
        the op `remove_op` instead."""
        mine = self.ledger.uploaded.setdefault(key, [])
        if len(mine) >= self.args.adapters_per_tenant:
            return await getattr(self, f"op_{remove_op}")(key, remove_op)
        name = f"{prefix}{self.rng.randrange(10**6)}"
        r = await request(self.clients[key], name)
        if self.ledger.status(op, r):
            mine.append(name)

    async def _remove_adapter(self, key: str, op: str, request) -> None:
        """One of the tenant's adapters, drawn at random, removed by `request(client, name)`; after a documented
        refusal (DOCUMENTED) it is still there."""
        mine = self.ledger.uploaded.get(key, [])
        if not mine:
            return
        name = mine.pop(self.rng.randrange(len(mine)))
        r = await request(self.clients[key], name)
        if not self.ledger.status(op, r) and r.status_code in DOCUMENTED:
            mine.append(name)

    async def op_models(self, key: str, op: str) -> None:
        self.ledger.status(op, await self.clients[key].get("/v1/models"))


# -- disturbances --------------------------------------------------------------------------------------------
async def cycle_disk(filler: DiskFiller, args, deadline: float, events: list) -> None:
    try:
        while time.monotonic() + args.disk_cycle < deadline:
            await asyncio.sleep(args.disk_cycle - args.disk_full)
            written = await asyncio.to_thread(filler.fill)
            events.append({"at": time.time(), "event": "disk full", "filler_bytes": written})
            await asyncio.sleep(args.disk_full)
            filler.free()
            events.append({"at": time.time(), "event": "disk freed"})
    finally:
        filler.free()


def replica_processes(pid: int) -> list:
    import psutil

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "ServeReplica" in " ".join(p.cmdline()):
                out.append(p)
    return out


async def kill_replicas(server: ManagedServer, load: Load, args, deadline: float, events: list) -> None:
    rng = random.Random(args.seed + 1)
    while time.monotonic() + args.kill_every < deadline:
        await asyncio.sleep(args.kill_every)
        replicas = replica_processes(server.proc.pid)
        if not replicas:
            continue
        victim = rng.choice(replicas)
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.pid, signal.SIGKILL)
            load.ledger.kills += 1
            events.append({"at": time.time(), "event": "replica killed", "pid": victim.pid})


# -- the checks at the end -----------------------------------------------------------------------------------
def admin_metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    r.raise_for_status()
    return {
        s.name: s.value
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
        if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "motet_queue_depth")
    }


def wait_idle(url: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = admin_metrics(url)
        if m and all(v == 0 for v in m.values()):
            return {"idle": True, "metrics": m}
        if time.monotonic() > deadline:
            return {"idle": False, "metrics": m}
        time.sleep(1)


def read_back(url: str, stored: dict) -> dict:
    """Every acknowledged stored response, read back: its output unchanged."""
    missing, differs, errors = [], [], []
    with httpx.Client(base_url=url, timeout=60) as c:
        for rid, (key, output) in stored.items():
            r = c.get(f"/v1/responses/{rid}", headers={"Authorization": f"Bearer {key}"})
            if r.status_code == 404:
                missing.append(rid)
            elif r.status_code != 200:
                errors.append(f"{rid}: {r.status_code} {r.text[:200]}")
            elif r.json().get("output") != output:
                differs.append(rid)
    return {"acknowledged": len(stored), "missing": missing, "differs": differs, "errors": errors}


def stop_and_check_processes(server: ManagedServer, timeout: float = 120) -> dict:
    """SIGTERM, the exit status, and every process the server started gone."""
    import psutil

    descendants = psutil.Process(server.proc.pid).children(recursive=True)
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        code = None
    server.stop()  # closes its log (and kills it, had it not exited)
    _, alive = psutil.wait_procs(descendants, timeout=60)
    stray = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            stray.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
            p.kill()
    return {"exit_code": code, "descendants": len(descendants), "stray": stray}


# -- the report ----------------------------------------------------------------------------------------------
def summarize(ledger: Ledger) -> dict:
    by_outcome: Counter = Counter()
    for (_, outcome), n in ledger.counts.items():
        by_outcome[outcome.split(":", 1)[0]] += n
    return {
        "requests": sum(ledger.counts.values()),
        "ok": by_outcome["ok"],
        "4xx": by_outcome["4xx"],
        "documented": by_outcome["documented"],
        "failures": by_outcome["failure"],
    }


def markdown(results: dict) -> str:
    s, c = results["summary"], results["checks"]
    lines = [
        "# Soak",
        "",
        f"`{results['command']}`",
        "",
        f"{results['minutes']:g} minutes, {results['config']['concurrency']} clients, replicas: "
        f"{results['config']['replicas'] or 1}, disk: {results['disk']}; {results['kills']} replica kills, "
        f"{results['disk_cycles']} disk-full cycles.",
        "",
        table(
            ["requests", "ok", "4xx", "documented 503/507", "failures"],
            [[s["requests"], s["ok"], s["4xx"], s["documented"], s["failures"]]],
        ),
        "",
        "## Checks",
        "",
        table(
            ["check", "result"],
            [
                ["acknowledged stored responses", c["read_back"]["acknowledged"]],
                [
                    "... missing / differing / errors",
                    " / ".join(str(len(c["read_back"][k])) for k in ("missing", "differs", "errors")),
                ],
                ["idle at the end", c["idle"]["idle"]],
                ["exit code on SIGTERM", c["processes"]["exit_code"]],
                ["stray processes", len(c["processes"]["stray"])],
                ["no 5xx but 503/507, no transport errors", s["failures"] == 0],
                ["passed", results["passed"]],
            ],
            align="lr",
        ),  # fmt: skip
        "",
        "## Outcomes by operation",
        "",
        table(["operation", "outcome", "count"], [[op, o, n] for (op, o), n in sorted(results["_counts"])]),
    ]
    if results["failures"]:
        lines += ["", "## Failures (first 20)", ""]
        lines += [
            f"- {f['at_s']} s `{f['op']}` {f['outcome']}: {f['detail'][:200]}"
            for f in results["failures"][:20]
        ]
    return "\n".join(lines) + "\n"


# -- main ----------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default: 30)")
    p.add_argument(
        "--replicas", type=int, default=None, help="serve with --replicas N (N >= 2: replica kills)"
    )
    p.add_argument("--concurrency", type=int, default=8, help="clients sending at once (default: 8)")
    p.add_argument("--model", default=None, help="the served model (default: motet's default model)")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens a request asks for (default: 32)")
    p.add_argument("--disk-mb", type=int, default=96, help="the data dir's tmpfs size in MiB (default: 96)")
    p.add_argument(
        "--disk-cycle", type=float, default=90.0, help="seconds per fill-and-free cycle (default: 90)"
    )
    p.add_argument("--disk-full", type=float, default=30.0, help="seconds the disk stays full (default: 30)")
    p.add_argument(
        "--kill-every", type=float, default=120.0, help="seconds between replica kills (default: 120)"
    )
    p.add_argument(
        "--adapters-per-tenant", type=int, default=3, help="uploaded/loaded adapters a tenant keeps"
    )
    p.add_argument("--conversations-per-tenant", type=int, default=4)
    p.add_argument("--request-timeout", type=float, default=600.0, help="client timeout per request (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-arg", action="append", default=[], help="an extra `motet serve` argument")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "reports" / "soak")
    args = p.parse_args(argv)
    if args.disk_full >= args.disk_cycle:
        p.error("--disk-full must be shorter than --disk-cycle")
    return args


async def drive(args, server: ManagedServer, model: str, loadable, uploads, filler) -> tuple[Load, list]:
    load = Load(args, server, model, loadable, uploads)
    deadline = time.monotonic() + args.minutes * 60
    events: list = []
    tasks = [load.run(deadline)]
    if filler is not None:
        tasks.append(cycle_disk(filler, args, deadline, events))
    if (args.replicas or 0) >= 2:
        tasks.append(kill_replicas(server, load, args, deadline, events))
    try:
        await asyncio.gather(*tasks)
    finally:
        await load.close()
    return load, events


def main(argv=None) -> int:
    reexec_in_namespace()
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="motet-soak-"))
    with small_disk(args.disk_mb) as disk:
        data_dir = (disk or work) / "data"
        keys = {**TENANTS, ADMIN_KEY: {"admin": True}}
        (work / "keys.json").write_text(json.dumps(keys))
        from motet.engine.config import EngineConfig
        from motet.engine.weights.model_store import resolve_model

        model = args.model or EngineConfig.model
        print(f"soak: making adapters for {model}")
        model_dir = resolve_model(model)
        loadable = random_peft_adapters(model_dir, work / "loadable", 2)
        uploads = random_peft_adapters(model_dir, work / "uploads", 2)
        server_args = [
            "--model", model, "--api-keys", str(work / "keys.json"), "--data-dir", str(data_dir),
            "--lora-load-dir", str(work / "loadable"), "--max-loras", "2", "--log-level", "info",
            *(["--replicas", str(args.replicas)] if args.replicas else []), *args.server_arg,
        ]  # fmt: skip
        server = ManagedServer(server_args, log_path=args.out / "server.log", start_timeout=1800)
        print(f"soak: starting motet serve {' '.join(server_args)}")
        server.start()
        served = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer sk-soak-a"}).json()
        served_name = served["data"][0]["id"]
        filler = DiskFiller(disk) if disk is not None else None
        print(
            f"soak: {args.minutes:g} min of load on {server.url} (disk: {'tmpfs' if disk else 'not filled'})"
        )
        t0 = time.time()
        try:
            load, events = asyncio.run(drive(args, server, served_name, loadable, uploads, filler))
        except BaseException:
            server.stop()
            raise
        if filler is not None:
            filler.free()
        idle = wait_idle(server.url, 180)
        read = read_back(server.url, load.ledger.stored)
        processes = stop_and_check_processes(server)
    shutil.rmtree(work, ignore_errors=True)
    summary = summarize(load.ledger)
    checks = {"read_back": read, "idle": idle, "processes": processes}
    passed = (
        summary["failures"] == 0
        and not (read["missing"] or read["differs"] or read["errors"])
        and idle["idle"]
        and processes["exit_code"] == 0
        and not processes["stray"]
    )
    results = {
        "command": " ".join(["python -m benchmarks.soak", *(argv if argv is not None else sys.argv[1:])]),
        "minutes": args.minutes,
        "started": t0,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "disk": f"tmpfs {args.disk_mb} MiB" if disk else "not filled (no tmpfs could be mounted)",
        "kills": load.ledger.kills,
        "disk_cycles": filler.cycles if filler else 0,
        "summary": summary,
        "counts": {f"{op} {o}": n for (op, o), n in sorted(load.ledger.counts.items())},
        "checks": checks,
        "failures": load.ledger.failures,
        "events": events,
        "passed": passed,
    }
    results["_counts"] = list(load.ledger.counts.items())
    md = markdown(results)
    del results["_counts"]
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    (args.out / "summary.md").write_text(md)
    print(md)
    print(f"soak: {'PASSED' if passed else 'FAILED'}; report in {args.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
