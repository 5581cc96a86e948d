"""Invalid trigger Params are refused with a readable message, burn no retry, provision nothing.

Real ``dag.test()`` triggers (Airflow validates the conf against the Param schema when it
creates the run), then two warm-start runs that pass the form but name a run with no valid
checkpoint: those fail in the shard task, before anything is provisioned, without a retry.
Artifacts go to a temp folder (storage accepts local paths), so no S3 server is needed.
"""
import os

import pytest

from testkit.dag_runs import airflow_env, run_confs

pytestmark = pytest.mark.integration

BASE = {"dataset_uri": "/nonexistent/digits.csv", "recipe": "debug", "num_workers": 2}

# (what is wrong, conf overrides, text the rejection must contain)
REFUSED_AT_TRIGGER = [
    ("wrong type: string epochs", {"epochs": "ten"}, "epochs"),
    ("wrong type: fractional batch size", {"batch_size": 2.5}, "batch_size"),
    ("out of range: too many workers", {"num_workers": 17}, "num_workers"),
    ("out of range: zero learning rate", {"learning_rate": 0}, "learning_rate"),
    ("unknown optimizer", {"optimizer": "adamw"}, "adamw"),
    ("unknown model", {"model": "vgg19"}, "vgg19"),
    ("unknown kvstore mode", {"kvstore": "local"}, "kvstore"),
    ("unknown backend", {"backend": "k8s"}, "k8s"),
    ("malformed S3 URI (one slash)", {"dataset_uri": "s3:/mxpipe/data.csv"}, "dataset_uri"),
    ("malformed S3 URI (bucket name)", {"dataset_uri": "s3://Bad_Bucket/data.csv"}, "dataset_uri"),
    ("warm start that is no run id", {"warm_start": "no such run!"}, "warm_start"),
    ("wrong type in config: 'false' for a boolean", {"config": {"checkpoint": {"elastic": "false"}}},
     "On instance['checkpoint']['elastic']"),
    ("wrong type in config: fractional workers", {"config": {"cluster": {"num_workers": 2.5}}},
     "2.5 is not of type 'integer'"),
    ("unknown key in config", {"config": {"optim": {"epochz": 3}}}, "'epochz' was unexpected"),
    ("malformed import path of a custom network", {"config": {"model": {"name": "my-net.arch:build"}}},
     "'my-net.arch:build' does not match"),
    ("config file that is neither JSON nor YAML", {"config_uri": "/etc/run.txt"}, "config_uri"),
]


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
    confs = [{**BASE, **o} for _, o, _ in REFUSED_AT_TRIGGER]
    confs += [{**BASE, "warm_start": "manual__1999-01-01T00:00:00+00:00"}, {**BASE, "warm_start": "torn_run"}]
    result, logs = run_confs(env, confs)
    return result, logs, home


@pytest.mark.parametrize("index", range(len(REFUSED_AT_TRIGGER)), ids=[k for k, _, _ in REFUSED_AT_TRIGGER])
def test_refused_when_triggered_with_a_readable_message(outcome, index):
    result, _, _ = outcome
    got = result["results"][index]
    assert got.get("rejected") == "ParamValidationError", got
    assert REFUSED_AT_TRIGGER[index][2] in got["message"], got["message"]


def test_a_warm_start_without_a_valid_checkpoint_fails_in_shard_without_retry(outcome):
    result, logs, home = outcome
    for got in result["results"][len(REFUSED_AT_TRIGGER):]:
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
    # Only the two warm-start runs were created; the refused triggers made no DAG run at all.
    assert result["dag_runs"] == 2
    clusters = os.path.join(home, "clusters")
    assert not os.path.exists(clusters) or os.listdir(clusters) == []
