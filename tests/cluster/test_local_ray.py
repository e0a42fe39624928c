"""The local Ray that `motet serve --replicas` starts: its workers get what the replicas need (motet's source on
PYTHONPATH, the tokenizers' own threads off) from the environment its processes start in, not through a job
runtime_env (for which Ray would start workers of their own, leaving idle the ones it prestarted: two processes
more per start on two cores), and the server's own environment is left as it was. On the same Ray, a fine-tuning
job sent where no node holds the resource the operator named fails at once, naming the resource and how to give a
node one (it would otherwise wait for a worker that never comes)."""

from __future__ import annotations

import os

import anyio
import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the module's tests, started as the server starts it; the PYTHONPATH before its start."""
    from motet.cluster.launch import Cluster, ClusterSettings

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TOKENIZERS_PARALLELISM", raising=False)
        before = os.environ.get("PYTHONPATH")
        Cluster(ClusterSettings(replicas=1), None).connect()
        try:
            yield before
        finally:
            ray.shutdown()


def test_a_local_ray_passes_the_replicas_environment_without_a_runtime_env(local_ray):
    from motet.cluster.launch import SOURCE_ROOT

    @ray.remote(num_cpus=0)
    def environment() -> dict[str, str]:
        return dict(os.environ)

    assert os.environ.get("PYTHONPATH") == local_ray and "TOKENIZERS_PARALLELISM" not in os.environ
    # the job's runtime_env: none, so the workers Ray prestarted serve it
    assert not ray.get_runtime_context().runtime_env
    env = ray.get(environment.remote())
    assert env["TOKENIZERS_PARALLELISM"] == "false"
    assert str(SOURCE_ROOT) in env["PYTHONPATH"].split(os.pathsep)


def test_a_missing_resource_fails_the_launch_naming_it(local_ray, tmp_path):
    from motet.cluster.training_jobs import RayTrainWorker
    from motet.training.launch import LaunchError

    with pytest.raises(
        LaunchError, match=r"no node of the Ray cluster holds the resource 'gpu-box'.*ray start"
    ):
        anyio.run(RayTrainWorker.start, "gpu-box", tmp_path, 1, 0)
