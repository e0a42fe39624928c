"""A fine-tuning job sent to a Ray cluster where no node holds the resource the operator named fails at once, naming
the resource and how to give a node one (it would otherwise wait for a worker that never comes)."""

from __future__ import annotations

import anyio
import pytest

ray = pytest.importorskip("ray")


def test_a_missing_resource_fails_the_launch_naming_it(tmp_path):
    from motet.cluster.training_jobs import RayTrainWorker
    from motet.training.launch import LaunchError

    ray.init(num_cpus=1, include_dashboard=False, resources={"trainer": 1})
    try:
        with pytest.raises(
            LaunchError, match=r"no node of the Ray cluster holds the resource 'gpu-box'.*ray start"
        ):
            anyio.run(RayTrainWorker.start, "gpu-box", tmp_path, 1, 0)
    finally:
        ray.shutdown()
