"""Peak host memory while a model loads, against the bytes of the weights it loaded (issue 30, item 5).

    python -m benchmarks.load_peak [--model NAME] [--dtypes bf16 fp32] [--quantization int8] [--out DIR]

For each dtype a fresh subprocess builds the `ModelRunner` on the CPU (KV cache of --num-kv-blocks blocks, so
that it is negligible) and reads its peak resident set (VmHWM, reset through /proc/self/clear_refs where it
starts): over `ModelRunner._load_model` (the model built and its checkpoint read: "load"), and over the whole
construction (the load, the KV cache and the compiled step's packing of the weights: "runner"). Each peak is
the growth over the resident set where it started, divided by `weights_bytes` of the loaded model
(motet/engine/worker/memory.py), read as `_load_model` returns. Mapped checkpoint pages count: they are resident while
mapped.

The subprocess imports `motet` from the current directory: run it from an older checkout (with this file's
path) to measure that version. Writes results.json and summary.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20

# The measurement, in the subprocess; only names every version of motet has.
CHILD = r"""
import json, sys
import torch
import torch._dynamo  # torch imports it on the first init on the meta device: ~90 MB of code, not the load's
from motet.engine.weights.model_config import load_model_config
from motet.engine.config import EngineConfig
from motet.engine.worker.memory import weights_bytes
from motet.engine.worker.model_runner import ModelRunner
from motet.engine.weights.model_store import resolve_model

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out

def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    return status()["VmRSS"]

config = EngineConfig(**json.loads(sys.argv[1]))
model_dir = resolve_model(config.model)
model_config = load_model_config(model_dir)
found = {}
load_model = ModelRunner._load_model

def measured_load(self, path):
    found["before_load_peak"] = status()["VmHWM"]
    start = reset_peak()
    model = load_model(self, path)
    found["load_peak"] = status()["VmHWM"] - start
    found["weights"] = weights_bytes(model, self.device)
    return model

ModelRunner._load_model = measured_load
start = reset_peak()
runner = ModelRunner(model_dir, model_config, config)
end = status()
found["runner_peak"] = max(found["before_load_peak"], end["VmHWM"]) - start
found["runner_resident"] = end["VmRSS"] - start
found["rss_file"] = end["RssFile"]
print(json.dumps(found))
"""


def measure(dtype: str, model: str | None, quantization: str | None, num_kv_blocks: int) -> dict:
    config = {"dtype": dtype, "device": "cpu", "num_kv_blocks": num_kv_blocks, "quantization": quantization}
    if model:
        config["model"] = model
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(config)], capture_output=True, text=True, cwd=os.getcwd()
    )
    if done.returncode:
        raise SystemExit(f"the measurement for {dtype} failed:\n{done.stderr}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["load_ratio"] = found["load_peak"] / found["weights"]
    found["runner_ratio"] = found["runner_peak"] / found["weights"]
    return found


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the engine's default model")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--quantization", default=None)
    p.add_argument("--num-kv-blocks", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("benchmarks/reports/load_peak"))
    args = p.parse_args(argv)
    rows = {dtype: measure(dtype, args.model, args.quantization, args.num_kv_blocks) for dtype in args.dtypes}
    lines = [
        f"# Peak memory while loading ({args.model or 'default model'}, quantization {args.quantization})",
        "",
        "| dtype | weights MiB | load peak MiB | load / weights | runner peak MiB | runner / weights |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, r in rows.items():
        lines.append(
            f"| {dtype} | {r['weights'] / MIB:.1f} | {r['load_peak'] / MIB:.1f} | {r['load_ratio']:.2f} "
            f"| {r['runner_peak'] / MIB:.1f} | {r['runner_ratio']:.2f} |"
        )
    summary = "\n".join(lines) + "\n"
    from benchmarks import write_report

    write_report(args.out, {"args": {k: str(v) for k, v in vars(args).items()}, "results": rows}, summary)


if __name__ == "__main__":
    main()
