"""Every artifact path of a run is a string under the run's partition (what job documents hold)."""
import pytest

from common.paths import RunPaths

pytestmark = pytest.mark.unit


def test_every_run_path_is_a_string_under_the_run():
    paths = RunPaths(root="s3://b/root", dag_id="d", run_id="r")
    names = [n for n, v in vars(RunPaths).items() if isinstance(v, property)]
    assert {"config", "checkpoints", "model", "code", "job_status"} <= set(names)
    for name in names:
        value = getattr(paths, name)
        assert isinstance(value, str) and value.startswith("s3://b/root/d/r"), (name, value)
