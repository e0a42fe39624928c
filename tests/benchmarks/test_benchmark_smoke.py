"""Every benchmark still imports and parses its flags, each is run end to end by a smoke test (SMOKE_RUNS says
which), and step_profile runs end to end on the tiny model here: none rots between the runs that measure (they
need the real model and a quiet machine)."""

from __future__ import annotations

import importlib
import inspect
import json
import sys

import pytest
from safetensors import safe_open

from tests.live_server import ROOT

MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__")

# Each module of benchmarks/ -> the test (under tests/benchmarks/) that runs it end to end at its smallest settings;
# a library of the others -> the test of a script that runs it. A new benchmark needs its line here.
SMOKE_RUNS = {
    "adapter_scale": "test_served_smoke.py::test_adapter_scale",
    "cluster_routing": "test_cluster_smoke.py::test_cluster_routing",
    "cold_start": "test_served_smoke.py::test_cold_start",
    "cpu_gemm": "test_offline_smoke.py::test_cpu_gemm",
    "first_requests": "test_served_smoke.py::test_first_requests",
    "gguf_spm": "test_served_smoke.py::test_gguf_spm",
    "gpu_bench": "test_gpu_smoke.py::test_gpu_bench",  # on CUDA only
    "gpu_common": "test_gpu_peer.py::test_smoke_report_has_every_configuration",
    "gpu_peer": "test_gpu_peer.py::test_smoke_report_has_every_configuration",
    "fine_tuning": "test_served_smoke.py::test_fine_tuning",
    "fine_tuning_quality": "test_served_smoke.py::test_fine_tuning_quality",
    "fine_tuning_batch": "test_offline_smoke.py::test_fine_tuning_batch",
    "grammar_overhead": "test_offline_smoke.py::test_grammar_overhead",
    "grammar_report": "test_offline_smoke.py::test_grammar_report",
    "jsonschema_heldout": "test_offline_smoke.py::test_jsonschema_heldout",
    "kv_tiers": "test_offline_smoke.py::test_kv_tiers",
    "llamacpp": "test_served_smoke.py::test_llamacpp",
    "load_peak": "test_offline_smoke.py::test_load_peak",
    "moe_decode": "test_offline_smoke.py::test_moe_decode",
    "moe_gpu_bench": "test_gpu_smoke.py::test_moe_gpu_bench",
    "moe_upcycle": "test_moe_upcycle.py::test_exact_copies_compute_the_dense_model",
    "pd": "test_cluster_smoke.py::test_pd",
    "pd_sim": "test_offline_smoke.py::test_pd_sim",
    "prefill_peak": "test_offline_smoke.py::test_prefill_peak",
    "process_memory": "test_served_smoke.py::test_fine_tuning_memory",
    "peers": "test_served_smoke.py::test_llamacpp",
    "peft_adapters": "test_served_smoke.py::test_soak",
    "quant_bandwidth": "test_offline_smoke.py::test_quant_bandwidth",
    "quant_gpu_bench": "test_gpu_smoke.py::test_quant_gpu_bench",  # on CUDA only
    "quant_quality": "test_quant_quality.py::test_a_run_over_every_format",
    "routing_fit": "test_offline_smoke.py::test_routing_fit",
    "routing_policies": "test_offline_smoke.py::test_routing_sim",
    "routing_sim": "test_offline_smoke.py::test_routing_sim",
    "routing_trace": "test_offline_smoke.py::test_routing_sim",
    "sim_replica": "test_offline_smoke.py::test_routing_sim",
    "served_flops": "test_served_flops.py::test_served_flops_runs_on_the_tiny_model",
    "soak": "test_served_smoke.py::test_soak",
    "spec_bench": "test_served_smoke.py::test_spec_bench",
    "spec_threshold": "test_offline_smoke.py::test_spec_threshold",
    "step_profile": "test_benchmark_smoke.py::test_step_profile_runs_on_the_tiny_model",
    "strict_report": "test_offline_smoke.py::test_strict_report",
    "tenant_fairness": "test_served_smoke.py::test_tenant_fairness",
    "tensor_parallel": "test_offline_smoke.py::test_tensor_parallel",
    "tracing_overhead": "test_served_smoke.py::test_tracing_overhead",
    "vllm_cpu": "test_served_smoke.py::test_vllm_cpu",
}


def test_benchmarks_are_found():
    assert {"llamacpp", "step_profile", "vllm_cpu"} <= set(MODULES)


def test_every_benchmark_has_a_smoke_run():
    """SMOKE_RUNS names every module of benchmarks/, each a test that exists (read from its file: the file is not
    imported, so a test module that needs Ray is not loaded here)."""
    assert sorted(SMOKE_RUNS) == MODULES
    for name, where in SMOKE_RUNS.items():
        path, test = where.split("::")
        assert f"def {test}(" in (ROOT / "tests" / "benchmarks" / path).read_text(), name


@pytest.mark.parametrize("name", MODULES)
def test_imports_and_parses_help(name, monkeypatch, capsys):
    """Import the module; where it is a script, its parser answers --help (built as its main builds it, never
    running anything: soak's main re-executes itself in a namespace first, so its own parse_args is asked)."""
    module = importlib.import_module(f"benchmarks.{name}")
    if hasattr(module, "build_parser"):
        ask = lambda: module.build_parser().parse_args(["--help"])  # noqa: E731
    elif hasattr(module, "parse_args"):
        ask = lambda: module.parse_args(["--help"])  # noqa: E731
    elif hasattr(module, "main"):
        monkeypatch.setattr(sys, "argv", [f"benchmarks.{name}", "--help"])
        takes_argv = bool(inspect.signature(module.main).parameters)
        ask = (lambda: module.main(["--help"])) if takes_argv else module.main
    else:
        assert "__main__" not in inspect.getsource(module), f"{name} runs as a script without a main()"
        return  # a library of the others
    with pytest.raises(SystemExit) as done:
        ask()
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.fixture(scope="module")
def step_profile_report(tiny_model_dir, tmp_path_factory):
    from benchmarks import step_profile

    out = tmp_path_factory.mktemp("step_profile")
    step_profile.main(["--model", str(tiny_model_dir), "--dtype", "float32", "--batches", "1", "--steps", "2",
                       "--adapters", "0", "--no-eager", "--serve-levels", "--peak-seconds", "0.01", "--out", str(out)])  # fmt: skip
    return json.loads((out / "results.json").read_text()), (out / "summary.md").read_text()


@pytest.mark.smoke
def test_step_profile_runs_on_the_tiny_model(step_profile_report):
    report, summary = step_profile_report
    assert [(r["batch"], r["load"], r["compiled"]) for r in report["offline"]] == [
        (1, "base", True),
        (1, "JSON schema", True),
    ]
    for row in report["offline"]:
        phases = row["phases_ms"]
        # each stage was timed where the step runs it today (the native step's clocks split the forward)
        for phase in ("schedule", "inputs", "linear", "attention", "logits", "sampling", "commit_tokens"):
            assert phases[phase] > 0, (row["load"], phase)
        assert row["forward_ms"] >= phases["linear"] + phases["attention"]
        assert row["gflops"]["forward"] > 0 and row["gflops"]["linear"] >= row["gflops"]["forward"]
        assert row["pct_of_peak"]["forward"] > 0 and row["peak_gflops"]["decoder"] > 0
    assert report["offline"][1]["phases_ms"]["grammar"] > 0  # the schema's rows are masked
    assert set(report["peak"]["1"]["shapes"]) == {"q", "k", "v", "o", "gate", "up", "down", "lm_head"}
    assert report["cpu"]["model"] and "avx512_bf16" in report["cpu"]["flags"]
    assert "Achieved GFLOPS" in summary


def test_flops_count_the_checkpoints_projections(tiny_model_dir):
    """2 FLOPs per parameter of the decoder's projections a token goes through, and per lm_head weight a logit
    row: counted from the checkpoint's own tensors."""
    from benchmarks.step_profile import flop_counts
    from motet.engine.weights.model_config import load_model_config

    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    decoder = sum(s[0] * s[1] for k, s in shapes.items() if k.split(".")[-2] in projections)
    vocab, hidden = shapes["model.embed_tokens.weight"]  # (tied: the lm_head is the embedding)
    counts = flop_counts(load_model_config(tiny_model_dir))
    assert counts == {"decoder": 2 * decoder, "lm_head": 2 * vocab * hidden}
