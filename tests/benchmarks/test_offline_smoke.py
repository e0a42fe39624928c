"""The offline benchmarks and the simulations end to end at their smallest settings, on the tiny random model (or
no model): each writes its report into tmp_path, and the report has its rows and keys with finite, positive
figures. No speed is asserted: these runs check that the scripts still run against today's code."""

from __future__ import annotations

import json
import lzma

import pytest

from benchmarks import (
    cpu_gemm,
    fine_tuning_batch,
    grammar_overhead,
    grammar_report,
    jsonschema_heldout,
    kv_tiers,
    load_peak,
    moe_decode,
    pd_sim,
    prefill_peak,
    quant_bandwidth,
    routing_fit,
    routing_sim,
    spec_threshold,
    strict_report,
    tensor_parallel,
)
from motet.evals.datasets import dev_set_path
from motet.kernels import cpu_isa
from tests.benchmarks.smoke import TorchThreads, finite, only_json, positive
from tests.engine.test_gguf_model_file import write_gguf_file
from tests.kernels.test_quantization import GGUF_TYPES
from tests.peft_adapters import TINY_ADAPTERS, save_peft_adapters

pytestmark = [pytest.mark.smoke, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]


@pytest.fixture(autouse=True)
def threads():
    with TorchThreads():
        yield


def test_cpu_gemm(tmp_path, monkeypatch):
    """One shape, one row count, both quantized formats, in every tier this CPU runs (the script forces each
    as MOTET_CPU_ISA does: put back after)."""
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    try:
        cpu_gemm.main(["--rows", "1", "4", "--shapes", "o", "--quantized", "int8", "int4", "--threads", "1",
                       "--seconds", "0.005", "--out", str(tmp_path)])  # fmt: skip
    finally:
        cpu_isa.selected.cache_clear()
    report = json.loads((tmp_path / "results.json").read_text())
    cols = report["o"]
    tiers = [t.name for t in cpu_isa.TIERS if t.name != "scalar" and not cpu_isa.missing(t)]
    want = {"torch bf16", "torch fp32"} | {
        f"{t} {f}" for t in tiers for f in ("bf16", "fp32", "int8", "int4")
    }
    assert report["fma_peak_gflops"] is None or positive(report["fma_peak_gflops"])  # (None: no C++ compiler)
    assert set(cols) == want
    assert all(set(by_rows) == {"1", "4"} and positive(*by_rows.values()) for by_rows in cols.values())
    assert "| torch fp32 |" in (tmp_path / "summary.md").read_text()


def test_grammar_overhead(tiny_model_dir, tmp_path):
    report = grammar_overhead.main(["--model", str(tiny_model_dir), "--requests", "3", "--max-tokens", "8",
                                    "--repeats", "1", "--threads", "1", "--out", str(tmp_path)])  # fmt: skip
    assert json.loads((tmp_path / "grammar_overhead.json").read_text())["requests"] == 3
    for run in ("constrained", "unconstrained", "constrained_jump_forward"):
        r = report[run]
        assert len(r["lengths"]) == 3 and positive(r["tokens_per_s"], r["seconds"], r["output_tokens"])
    assert report["unconstrained"]["lengths"] == report["constrained"]["lengths"]  # forced to the same length
    assert report["constrained"]["grammar"]["rows"] > 0 and report["unconstrained"]["grammar"]["rows"] == 0
    assert positive(report["ratio"]) and 0 <= report["valid"] <= 3


def test_kv_tiers(tiny_model_dir, tmp_path):
    kv_tiers.main(["--model", str(tiny_model_dir), "--dtype", "float32", "--history", "48", "--conversations", "3",
                   "--system-prompt", "48", "--threads", "1", "--data-dir", str(tmp_path), "--out", str(tmp_path / "r")])  # fmt: skip
    report = json.loads((tmp_path / "r" / "results.json").read_text())
    conv = report["conversations"]
    assert set(conv["rows"]) == {"ram", "disk", "recompute"} and all(
        len(r) == 3 for r in conv["rows"].values()
    )
    assert positive(*conv["ttft_p50_s"].values(), conv["speedup_ram"], conv["speedup_disk"])
    # the history came back from each tier (the whole blocks of it), and nothing from the engine without tiers
    for tier in ("ram", "disk"):
        assert all(r["cached_tokens"] >= 32 and r[f"{tier}_hit_tokens"] >= 32 for r in conv["rows"][tier])
    assert all(r["cached_tokens"] == 0 for r in conv["rows"]["recompute"])
    after = report["system_prompt"]["after_restart"]
    assert after["cached_tokens"] == after["disk_hit_tokens"] == 48 and positive(
        report["system_prompt"]["speedup"]
    )
    assert "| disk |" in (tmp_path / "r" / "summary.md").read_text()


def test_moe_decode(tmp_path):
    """A one-layer Mixtral-shaped model of 4 experts, motet against HF generate at one batch."""
    moe_decode.main(["--hidden", "64", "--layers", "1", "--experts", "4", "--top-k", "2", "--expert-inter", "64",
                     "--batches", "2", "--prompt", "8", "--quick", "--dtypes", "float32", "--threads", "1",
                     "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    (row,) = report["rows"]
    assert (row["dtype"], row["batch"]) == ("float32", 2)
    assert positive(
        row["motet"]["tokens_per_s"], row["hf"]["tokens_per_s"], row["speedup"], report["params_m"]
    )
    assert "| float32 | 2 |" in (tmp_path / "summary.md").read_text()


def test_moe_decode_expert_formats(tmp_path):
    """A one-layer GPT-OSS-shaped model, motet alone with its experts in each format (no Hugging Face side)."""
    moe_decode.main(["--arch", "gpt_oss", "--hidden", "64", "--layers", "1", "--experts", "4", "--top-k", "2",
                     "--expert-inter", "64", "--batches", "2", "--prompt", "8", "--quick", "--dtypes", "--formats",
                     *moe_decode.FORMATS, "--threads", "1", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["rows"] == []
    assert [(r["format"], r["batch"]) for r in report["format_rows"]] == [(f, 2) for f in moe_decode.FORMATS]
    assert positive(*(r["step_ms"] for r in report["format_rows"]), report["params_m"])
    assert "| mxfp4 | 2 |" in (tmp_path / "summary.md").read_text()


def test_fine_tuning_batch(tiny_model_dir, tmp_path, monkeypatch):
    from motet.engine.llm import LLM

    monkeypatch.setenv("MOTET_WEIGHTS_CACHE_DIR", str(tmp_path / "weights"))
    # (its prepared weights: the shared base)
    LLM(str(tiny_model_dir), device="cpu", block_size=8, num_kv_blocks=64)
    fine_tuning_batch.main(["--model", str(tiny_model_dir), "--jobs", "2", "--batch", "2", "--tokens", "9",
                            "--answer-tokens", "3", "--repeats", "2", "--shared-base",
                            "--output-dir", str(tmp_path / "out")])  # fmt: skip
    b = only_json(tmp_path / "out")["batch"]
    shared = b["shared_base"]
    assert positive(
        shared["shared"]["wall_s"], shared["private"]["wall_s"], shared["speed"], shared["cpu_speed"]
    )
    assert b["jobs"] == 2 and b["batch"] == 2
    one, together = b["one_job_micro_batch"], b["jobs_in_one_micro_batch"]
    assert positive(one["wall_s"], one["cpu_s"], together["wall_s"], together["cpu_s"])
    assert b["ratio"] == together["wall_s"] / (2 * one["wall_s"])
    assert b["cpu_ratio"] == together["cpu_s"] / (2 * one["cpu_s"])


def test_quant_bandwidth(tiny_model_dir, tmp_path):
    """Every format, gguf from a GGUF file written beside a copy of the tiny checkpoint."""
    model = tmp_path / "tiny"
    model.mkdir()
    for f in tiny_model_dir.iterdir():
        (model / f.name).symlink_to(f)
    write_gguf_file(tiny_model_dir, model / "tiny.gguf", GGUF_TYPES)
    quant_bandwidth.main(["--model", str(model), "--threads", "1", "--tokens", "4", "--repeats", "1",
                          "--ceiling-mib", "8", "--out", str(tmp_path / "r")])  # fmt: skip
    report = json.loads((tmp_path / "r" / "results.json").read_text())
    assert [r["format"] for r in report["rows"]] == ["bf16", "int8", "int4", "gguf"]
    assert positive(report["ceiling_gbs"], *report["bandwidth_gbs"].values())
    for r in report["rows"]:
        assert positive(r["ms_per_token"], r["bytes_per_token"], r["achieved_gbs"], *r["ms_range"])
    bf16 = report["rows"][0]["bytes_per_token"]
    assert all(r["bytes_per_token"] < bf16 for r in report["rows"][1:])  # packed formats stream fewer bytes


def test_spec_threshold(tiny_model_dir, tmp_path):
    out = tmp_path / "spec_threshold.json"
    spec_threshold.main(["--model", str(tiny_model_dir), "--batches", "2", "--drafts", "1", "2", "--prompt-tokens",
                         "16", "--reps", "2", "--threads", "1", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["batch"] == 2 and set(row["step_ms"]) == {"0", "1", "2"} and set(row["ratio"]) == {"1", "2"}
    assert positive(*row["step_ms"].values(), *row["ratio"].values())
    assert finite(report["overhead_tokens"])  # a fit over three noisy points: its sign is not the script's


def test_tensor_parallel(tiny_model_dir, tmp_path):
    tensor_parallel.main(["--model", str(tiny_model_dir), "--batches", "2", "--tokens", "3", "--threads", "2",
                          "--repeats", "1", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    one, two = report["results"]["tp1"], report["results"]["tp2"]
    assert (one["tensor_parallel_size"], two["tensor_parallel_size"]) == (1, 2)
    assert positive(one["2"]["decode_tok_s"], two["2"]["decode_tok_s"], report["minimum_bytes_per_token"])
    assert positive(two["2"]["rank0_collective_bytes_per_token"], two["2"]["loopback_bytes_per_token"])
    assert two["2"]["same_tokens_as_tp1"]  # greedy tokens over two ranks equal one rank's
    assert "| 2 |" in (tmp_path / "summary.md").read_text()


def test_load_peak(tiny_model_dir, tmp_path):
    load_peak.main(["--model", str(tiny_model_dir), "--dtypes", "float32", "--quantization", "int8",
                    "--out", str(tmp_path)])  # fmt: skip
    row = json.loads((tmp_path / "results.json").read_text())["results"]["float32"]
    assert positive(
        row["weights"], row["load_peak"], row["runner_peak"], row["load_ratio"], row["runner_ratio"]
    )
    assert "| float32 |" in (tmp_path / "summary.md").read_text()


def test_jsonschema_heldout(tmp_path):
    """A maskbench-like folder: a dev-set schema is left out, the others taken round robin over their categories."""
    from motet.evals.datasets import read_jsonl

    dev_id = next(iter(read_jsonl(dev_set_path("jsonschemabench"))))["id"]
    folder = tmp_path / "data"
    folder.mkdir()
    schema = {
        "schema": {"type": "object"},
        "tests": [{"data": {}, "valid": True}],
        "description": "",
        "meta": {},
    }
    for name in (dev_id, "Github_easy---a", "Github_easy---b", "Kubernetes---c", "BFCL_simple_3"):
        (folder / f"{name}.json").write_text(json.dumps(schema))
    out = tmp_path / "heldout.jsonl.xz"
    jsonschema_heldout.main([str(folder), "--n", "3", "--out", str(out)])
    with lzma.open(out, "rt") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 3 and dev_id not in {r["id"] for r in records}
    assert {r["category"] for r in records} == {"BFCL_simple", "Github_easy", "Kubernetes"}


def test_prefill_peak(tiny_model_dir, tmp_path):
    prefill_peak.main(["--model", str(tiny_model_dir), "--dtype", "float32", "--prompts", "2", "--prompt-tokens",
                       "24", "--threads", "1", "--rounds", "1", "--peak-seconds", "0.01", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    assert positive(report["best"]["tokens_per_s"], report["best"]["gflops"], report["best"]["pct_of_peak"])
    assert "share of torch's peak" in (tmp_path / "summary.md").read_text()


def test_routing_fit(tiny_model_dir, tmp_path):
    """The service-time model fitted to a few of the tiny model's steps; a PEFT adapter of its own is read."""
    save_peft_adapters(tiny_model_dir, tmp_path, TINY_ADAPTERS[:1], std=0.1)
    out = tmp_path / "routing_fit.json"
    routing_fit.main(["--model", str(tiny_model_dir), "--adapter", str(tmp_path / TINY_ADAPTERS[0][0]),
                      "--smoke", "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    model = report["model"]
    assert positive(model["adapter_load_s"]) and finite(*model.values())
    assert all(model[k] >= 0 for k in ("overhead_s", "token_s", "row_s", "attention_s"))  # kept non-negative
    assert positive(model["overhead_s"] + model["token_s"] + model["row_s"])  # something explains a step
    prefills = [s for s in report["samples"] if s[1] == 1 and s[0] in (32, 64)]
    assert len(prefills) == 2 and all(positive(*s) for s in report["samples"])


def test_routing_sim(tmp_path):
    """Every policy on four simulated replicas (its trace, replicas and policies: routing_trace, sim_replica,
    routing_policies)."""
    routing_sim.main(["--replicas", "4", "--duration", "60", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    by_policy = report["by_replicas"]["4"]
    assert set(by_policy) == set(routing_sim.POLICIES)
    for row in by_policy.values():
        assert row["requests"] > 0 and 0 < row["prefix_hit_rate"] <= 1
        assert positive(
            row["adapter_loads_per_1000"], row["load_imbalance"], row["ttft_p50_s"], row["ttft_p99_s"]
        )
    assert "| motet |" in (tmp_path / "summary.md").read_text()


def test_pd_sim(tmp_path):
    pd_sim.main(["--replicas", "2", "--ratios", "1:1", "--duration", "120", "--goodput-at", "2",
                 "--goodput-duration", "60", "--bisections", "2", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    modes = report["by_replicas"]["2"]
    assert set(modes) == {"colocated", "pd 1+1"}
    for m in modes.values():
        assert m["requests"] > 0 and 0 <= m["attainment"] <= 1 and positive(m["goodput_per_replica"])
        for cls in ("long_prompt", "long_decode"):
            assert positive(*m[cls].values())
    assert "| 2 | pd 1+1 |" in (tmp_path / "summary.md").read_text()


@pytest.fixture(scope="module")
def schemas(tmp_path_factory):
    """Three JSONSchemaBench records from the shipped dev set that have both valid and invalid instances."""
    picked = []
    with lzma.open(dev_set_path("jsonschemabench"), "rt") as f:
        for line in f:
            rec = json.loads(line)
            if {t["valid"] for t in rec["tests"]} == {True, False}:
                picked.append(line)
            if len(picked) == 3:
                break
    path = tmp_path_factory.mktemp("schemas") / "schemas.jsonl"
    path.write_text("".join(picked))
    return path


def test_grammar_report(schemas, tiny_model_dir, tmp_path):
    report = grammar_report.main(["--data", str(schemas), "--model-dir", str(tiny_model_dir), "--timeout", "10",
                                  "--out", str(tmp_path)])  # fmt: skip
    assert json.loads((tmp_path / "grammar_report.json").read_text())["schemas"] == 3
    overall = report["overall"]
    assert {"xgrammar", "llguidance", "outlines", "fallback", "xgrammar_nonstrict"} <= set(overall)
    for name, row in overall.items():
        assert row["schemas"] == 3 and row["valid_instances"] > 0 and row["invalid_instances"] > 0, name
        if row["compiled"]:
            assert positive(row["compile_ms_p50"], row["mask_us_p50"]) and row["mask_mismatches"] == 0, name
    assert "| xgrammar |" in (tmp_path / "grammar_report.md").read_text()


def test_strict_report(schemas, capsys):
    """It prints its report (no files)."""
    strict_report.main(["--data", str(schemas)])
    out = capsys.readouterr().out
    assert out.startswith("# Strict mode on schemas.jsonl: 3 schemas")
    assert "| schema as given |" in out and "| schema rewritten |" in out
    assert "0 differ" in out  # the rewrite keeps every instance's verdict
