"""The Ray cluster benchmarks end to end at their smallest settings, on the tiny random model (one thread per
replica): pd.py (colocated against prefill/decode pools) and cluster_routing.py (a shared-prefix, multi-adapter
workload through `motet serve --replicas 2`). Each writes its report into tmp_path, with finite, positive
figures; no speed is asserted. Slow: every server here starts a Ray cluster and two replicas (a minute or more
on two busy cores), as tests/cluster/test_cluster.py's."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.smoke import positive

pytest.importorskip("ray")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.smoke,
    pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning"),
]


def test_pd(tiny_model_dir, tmp_path):
    """One long decode and one long prompt, colocated (one replica: the path of two, one replica start less)
    then disaggregated (one prefill replica, one decode replica)."""
    from benchmarks import pd

    pd.main(["--model", str(tiny_model_dir), "--decodes", "1", "--decode-tokens", "4", "--prefills", "1",
             "--prompt-words", "20", "--prefill-tokens", "2", "--prefill-delay", "0.1", "--prefill-gap", "0.1",
             "--max-num-seqs", "2", "--colocated-replicas", "1", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    for mode in ("colocated", "disaggregated"):
        for cls in ("decode", "prefill"):
            s = report[mode][cls]
            assert s["completed"] == s["requests"] == 1, (mode, cls)
            assert positive(s["ttft_s"]["p50"], s["goodput"])
        assert positive(report[mode]["decode"]["tpot_s"]["p99"])
    assert positive(report["tpot_p99_ratio"])
    # the prompt went through the prefill replica and its blocks through the shared tier
    prefills = [
        line for line in report["disaggregated"]["pd_metrics"] if line.startswith("motet_pd_prefills")
    ]
    assert prefills and float(prefills[0].rsplit(" ", 1)[1]) >= 1
    assert "| disaggregated | decode |" in (tmp_path / "summary.md").read_text()


def test_cluster_routing(tiny_model_dir, tmp_path):
    """Two two-turn conversations of one tenant on its adapter and the base model, through motet's router (the
    study's other router, Ray's pow2, is the same code path with another --router: left out to save a cluster)."""
    from benchmarks import cluster_routing

    cluster_routing.main(["--model", str(tiny_model_dir), "--conversations", "2", "--rate", "10", "--tenants", "1",
                          "--adapters-per-tenant", "1", "--system-words", "8", "--max-turns", "2", "--max-tokens",
                          "4", "--think", "0.05", "--kv-blocks", "64", "--routers", "motet", "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "results.json").read_text())
    r = report["routers"]["motet"]
    assert r["requests"] == 4 and len(r["ttfts_s"]) == 4
    # the replicas' counters were read (a second turn finds its first turn's prompt cached)
    assert 0 < r["prefix_hit_rate"] <= 1 and 0 < r["cached_prompt_share"] <= 1
    assert positive(r["ttft_p50_s"], r["ttft_p99_s"], r["seconds"])
    assert "| motet | 4 |" in (tmp_path / "summary.md").read_text()
