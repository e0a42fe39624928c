"""The local Ray that `motet serve --replicas` starts: its workers get what the replicas need (motet's source on
PYTHONPATH, the tokenizers' own threads off) from the environment its processes start in, not through a job
runtime_env (for which Ray would start workers of their own, leaving idle the ones it prestarted: two processes
more per start on two cores), and the server's own environment is left as it was."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")


def test_a_local_ray_passes_the_replicas_environment_without_a_runtime_env(monkeypatch):
    from motet.cluster.launch import SOURCE_ROOT, Cluster, ClusterSettings

    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    before = os.environ.get("PYTHONPATH")

    @ray.remote(num_cpus=0)
    def environment() -> dict[str, str]:
        return dict(os.environ)

    Cluster(ClusterSettings(replicas=1), None).connect()
    try:
        assert os.environ.get("PYTHONPATH") == before and "TOKENIZERS_PARALLELISM" not in os.environ
        # the job's runtime_env: none, so the workers Ray prestarted serve it
        assert not ray.get_runtime_context().runtime_env
        env = ray.get(environment.remote())
        assert env["TOKENIZERS_PARALLELISM"] == "false"
        assert str(SOURCE_ROOT) in env["PYTHONPATH"].split(os.pathsep)
    finally:
        ray.shutdown()
