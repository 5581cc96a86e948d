"""Two warm-start runs that pass the trigger form but name a run with no valid checkpoint fail
in the shard task, before anything is provisioned, without a retry (real ``dag.test()`` runs).
Params refused at trigger time are tested through the REST API in ``test_stack_dag.py``.
Artifacts go to a temp folder (storage accepts local paths), so no S3 server is needed.
"""
import os

import pytest

from testkit.dag_runs import airflow_env, run_confs

pytestmark = pytest.mark.integration

BASE = {"dataset_uri": "/nonexistent/digits.csv", "recipe": "debug", "num_workers": 2}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    home = str(tmp_path_factory.mktemp("bad-params"))
    root = os.path.join(home, "artifacts")
    # A run that died before its first checkpoint commit: data files, no manifest.
    torn = os.path.join(root, "mxnet_training", "torn_run", "checkpoints", "step-00000010")
    os.makedirs(torn)
    with open(os.path.join(torn, "params.bin"), "wb") as fh:
        fh.write(b"half")
    env = airflow_env(home, MXPIPE_ARTIFACT_ROOT=root)
    confs = [{**BASE, "warm_start": "manual__1999-01-01T00:00:00+00:00"}, {**BASE, "warm_start": "torn_run"}]
    result, logs = run_confs(env, confs)
    return result, logs, home


def test_a_warm_start_without_a_valid_checkpoint_fails_in_shard_without_retry(outcome):
    result, logs, home = outcome
    for got in result["results"]:
        assert got.get("state") == "failed", got
        assert got["tasks"]["shard"] == {"state": "failed", "try_number": 1}, got["tasks"]
        for task in ("provision", "train", "register"):
            assert got["tasks"][task]["state"] in ("upstream_failed", "None"), (task, got["tasks"][task])
    assert "warm_start 'manual__1999-01-01T00:00:00+00:00': no run of mxnet_training" in logs
    assert "warm_start 'torn_run': no run of mxnet_training with a committed checkpoint" in logs
    # The failure callback's one-line summary (plugins/callbacks.py), from the real task runner:
    # the first of shard's two allowed attempts, ended for good by AirflowFailException.
    line = "task failed: dag=mxnet_training task=shard run=manual__"
    assert line in logs and "attempt=1/2 why=AirflowFailException: warm_start 'torn_run'" in logs, logs[-3000:]
    assert result["dag_runs"] == 2
    clusters = os.path.join(home, "clusters")
    assert not os.path.exists(clusters) or os.listdir(clusters) == []
