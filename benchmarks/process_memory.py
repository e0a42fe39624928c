"""A process tree's proportional set size (PSS: each page a process maps counted as its share among the processes
that map it, so pages the tree's processes share, libraries and one mapping of a weights file, count once in the
sum), and where one process's PSS lies: fine_tuning.py's memory measure (issue 66: one copy of the base).

    python -m benchmarks.process_memory worker-stages RUN_DIR --threads N     # (internal) a worker's PSS by stage

`worker-stages` trains a copy of a job's run directory as the server's worker does (motet/training/worker.py's
`run_job`) and prints, as its last line, its own PSS after the interpreter's start, after the trainer's imports,
once the trainer is built (its `started` event: the base loaded, the adapter made) and the peak over its steps,
with the mappings' breakdown at the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

WEIGHT_SUFFIXES = (
    ".bin",
    ".safetensors",
    ".gguf",
    ".pt",
)  # a mapped weights file (the prepared cache's weights.bin)


def rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup's Pss, Pss_Anon, Pss_File and Rss, in bytes ({} once the process is gone)."""
    out = {}
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("Pss", "Pss_Anon", "Pss_File", "Rss"):
            out[key] = int(value.split()[0]) * 1024
    return out


def children(pid: int) -> list[int]:
    """`pid` and its descendants."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += parents.get(p, [])
    return tree


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def tree_pss(pid: int) -> dict:
    """The tree's summed PSS (bytes) and each process's rollup with its command line."""
    procs = {p: rollup(p) | {"cmd": command(p)[:120]} for p in children(pid)}
    return {"pss": sum(r.get("Pss", 0) for r in procs.values()), "processes": procs}


def mappings(pid: int) -> dict[str, int]:
    """PSS of one process by what its pages are (bytes): weights files mapped, shared libraries, other files,
    anonymous memory (heap, the tensors the process allocates, its threads' stacks)."""
    out = {"weights_files": 0, "libraries": 0, "other_files": 0, "anonymous": 0}
    kind = "anonymous"
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:  # a mapping's header
            path = fields[5] if len(fields) > 5 else ""
            if not path.startswith("/"):
                kind = "anonymous"
            elif ".so" in Path(path).name:
                kind = "libraries"
            elif path.endswith(WEIGHT_SUFFIXES):
                kind = "weights_files"
            else:
                kind = "other_files"
        elif fields and fields[0] == "Pss:":
            out[kind] += int(fields[1]) * 1024
    return out


class PeakSampler:
    """A thread that samples a process tree's PSS every `interval` seconds: the peak and each process's rollup
    and mappings then."""

    def __init__(self, pid: int, interval: float = 0.25, watch: int | None = None):
        self.pid, self.interval, self.watch = pid, interval, watch
        self.peak: dict = {"pss": 0, "processes": {}}
        self.peak_mappings: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            found = tree_pss(self.pid)
            self.samples += 1
            if found["pss"] > self.peak["pss"]:
                self.peak = found
                if self.watch is not None or len(found["processes"]) > 1:
                    pid = self.watch or max(
                        (p for p in found["processes"] if p != self.pid),
                        key=lambda p: found["processes"][p].get("Pss", 0),
                    )
                    self.peak_mappings = mappings(pid) | {"pid": pid}


def worker_stages(run_dir: Path, threads: int) -> dict:
    """This process's PSS at each stage of a worker's run of `run_dir` (a copy: its checkpoints are written)."""
    me = os.getpid()
    stages = {"interpreter": rollup(me)}
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    stages["torch imported"] = rollup(me)
    import datasets  # noqa: F401 (the trainer's imports, as its run makes them)
    import peft  # noqa: F401
    import transformers  # noqa: F401
    import trl  # noqa: F401

    from motet.training.trainer import TrainingRun, train
    from motet.training.worker import RUN_SPEC

    stages["trainer's libraries imported"] = rollup(me)
    run = TrainingRun.of(json.loads((run_dir / RUN_SPEC).read_text()))
    steps = []

    def on_event(event: dict) -> None:
        if event["type"] == "started":
            stages["trainer built (base loaded, adapter made)"] = rollup(me)
        elif event["type"] == "step":
            steps.append(rollup(me))

    with PeakSampler(me, interval=0.05, watch=me) as sampler:
        outcome = train(run, on_event)
    stages["peak over the steps"] = sampler.peak["processes"].get(me, {})
    return {"stages": stages, "peak_mappings": sampler.peak_mappings, "steps": len(steps), "outcome": outcome}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser(
        "worker-stages", help="(internal) a worker's PSS by stage, on a copy of a run directory"
    )
    w.add_argument("run_dir", type=Path)
    w.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    result = worker_stages(args.run_dir, args.threads)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
