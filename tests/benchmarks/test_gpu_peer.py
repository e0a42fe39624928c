"""benchmarks/gpu_peer.py: its CPU smoke run end to end (a subprocess, as the GPU machine runs it), and the
profile's counting on a hand-made device trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.gpu_peer import trace_counts
from tests.live_server import ROOT


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("gpu_peer")
    cmd = [sys.executable, "-m", "benchmarks.gpu_peer", "--device", "cpu", "--shapes", "tiny",
           "--batches", "1", "2", "--adapters", "2", "--steps", "3", "--warmup", "2", "--profile-steps", "1",
           "--prompt-len", "16", "--dtype", "float32", "--work-dir", str(out), "--out", str(out / "report")]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((out / "report" / "results.json").read_text())
    return report, (out / "report" / "summary.md").read_text(), done.stdout


@pytest.mark.smoke
def test_smoke_report_has_every_configuration(smoke):
    report, summary, stdout = smoke
    assert report["args"]["peer_compile"] == "trace"  # the peer's step traced whole (fullgraph) on a CPU
    assert {(r["batch"], r["mode"]) for r in report["peer"]} == {
        (b, m) for b in (1, 2) for m in ("synced", "pipelined")
    }
    # base at each batch, 2 adapters only where the batch holds 2 rows
    assert [(r["batch"], r["adapters"]) for r in report["motet"]] == [(1, 0), (2, 0), (2, 2)]
    for r in report["motet"]:
        assert r["tokens_per_step"] == r["batch"]  # plain decode steps of the whole batch
    for r in report["motet"] + report["peer"]:
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["limit_share"] > 0
        assert r["profile"]["unit"] == "cpu ops" and r["profile"]["launches_per_step"] > 0
    rows = {(r["batch"], r["adapters"]): r for r in report["rows"]}
    two = rows[(2, 2)]
    assert two["over_synced"] == pytest.approx(two["tokens_per_s"] / two["peer_synced_tokens_per_s"])
    assert two["share_of_base"] == pytest.approx(two["tokens_per_s"] / rows[(2, 0)]["tokens_per_s"])
    assert set(report["shapes"]["tiny"]) >= {"weight_bytes", "kv_bytes_per_token", "adapter_bytes"}
    assert "| tiny | 2 | 2 |" in summary and "motet/pipelined" in summary and "report:" in stdout


@pytest.mark.smoke
def test_smoke_motet_greedy_tokens_equal_hf(smoke):
    """motet's base greedy tokens against the HF peer's (a static cache, argmax per step) on the same weights."""
    report, _, _ = smoke
    assert [g["batch"] for g in report["greedy"]] == [1, 2]
    for g in report["greedy"]:
        assert g["tokens_compared"] >= 1 + 2 + 3 + 1  # the prefill's token, warm-up, timed and profiled steps
        assert g["rows_equal"] == g["rows"], g
        assert g["peer_modes_agree"]


def test_trace_counts_on_a_device_trace():
    """Two steps of a hand-made Kineto trace: kernels, a device-to-host copy, a memset, overlapping kernels
    on two streams, and the host's runtime calls."""

    def dev(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [
        dev("kernel", "gemm", 0, 10),
        dev("kernel", "rmsnorm", 5, 10),  # overlaps the gemm: busy 0-15
        dev("gpu_memset", "Memset (Device)", 20, 2),
        dev("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 30, 1),
        dev("kernel", "gemm", 100, 10),
        dev("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 110, 4),
        dev("cuda_runtime", "cudaGraphLaunch", 0, 3),
        dev("cuda_runtime", "cudaMemcpyAsync", 29, 1),
        dev("cuda_runtime", "cudaStreamSynchronize", 30, 5),
        dev("cuda_runtime", "cudaLaunchKernel", 99, 1),
        dev("cpu_op", "aten::mm", 0, 50),
    ]
    got = trace_counts(events, steps=2)
    assert got == {
        "unit": "kernels",
        "launches_per_step": 3.0,  # 6 device events over 2 steps; CPU ops and runtime calls are not launches
        "copies_per_step": 1.0,
        "d2h_copies_per_step": 0.5,
        "host_waits_per_step": 0.5,  # the synchronize; the async copy does not wait
        "busy_ms_per_step": (15 + 2 + 1 + 10 + 4) / 1e3 / 2,
    }
