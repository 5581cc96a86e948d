"""A DAG run's training job, attempt by attempt (``training.train_job``), on local storage and a
real local cluster: the job document an attempt writes, the cluster a retry provisions again,
and the result a succeeded job hands on to registration."""
import dataclasses
import json
import uuid

import pytest

from common import storage
from common.config import recipe
from common.paths import RunPaths
from infra.cluster import ClusterSpec
from infra.local_cluster import LocalCluster
from training.launch.job import JobSpec
from training.launch.status import JobStatus
from training.train_job import AttemptRequest, job_result, prepare_attempt

pytestmark = pytest.mark.unit


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("MXPIPE_LIVE_TRACKING", "0")
    tag = f"dag--run-{uuid.uuid4().hex[:8]}"
    cluster = LocalCluster(tag, ClusterSpec(run_tag=tag, workers=1, servers=1), str(tmp_path / "home"))
    cluster.write_record()  # what provision does after its host check
    paths = RunPaths(root=str(tmp_path / "artifacts"), dag_id="dag", run_id="run")
    request = AttemptRequest(config=recipe("debug", "s3://b/d.csv"), paths=paths, attempt=1,
                             shards_prefix="s3://b/shards/abc", model_code={"uri": "s3://b/code.zip", "sha256": "f00"})
    yield cluster, request
    cluster.remove_record()


def test_an_attempt_writes_its_job_document_and_returns_its_pointers(run):
    cluster, request = run
    out = prepare_attempt(request, cluster)
    paths = request.paths
    job = JobSpec.load(out["job_uri"])
    assert out["job_uri"] == storage.join(paths.config, "job.json")
    assert job.config == request.config and job.shards_prefix == "s3://b/shards/abc"
    assert (job.checkpoint_prefix, job.model_prefix, job.status_uri) == (paths.checkpoints, paths.model,
                                                                         paths.job_status)
    assert (job.model_code_uri, job.model_code_sha256, job.warm_start_prefix) == ("s3://b/code.zip", "f00", "")
    assert job.run_name == "dag/run" and job.tracking == {}  # MXPIPE_LIVE_TRACKING=0
    assert job.cluster == cluster.job_cluster()
    assert out == {"job_uri": out["job_uri"], "status_uri": paths.job_status, "metrics_uri": job.metrics_uri,
                   "model_prefix": paths.model, "checkpoint_prefix": paths.checkpoints, "resumed_from_step": 0,
                   "attempt": 1, "cluster": cluster.describe(), "tracking": {}}


def test_a_retry_provisions_its_cluster_again_before_it_writes_the_job(run):
    cluster, request = run
    assert cluster.for_attempt(1) is cluster  # the first attempt runs on the cluster provision made
    cluster.remove_record()  # e.g. the machines the first attempt ran on were lost
    out = prepare_attempt(dataclasses.replace(request, attempt=2), cluster)
    assert cluster.exists()  # provisioned again: the host checked, the record written anew
    assert out["attempt"] == 2 and out["cluster"] == cluster.describe()


def test_a_succeeded_job_hands_on_its_pointers_and_metrics(tmp_path):
    metrics_uri = str(tmp_path / "train.json")
    best = {"metric": "val_accuracy", "best_epoch": 1}
    storage.put_bytes(metrics_uri, json.dumps({"global_step": 40, "best": best, "history": [
        {"epoch": 0, "val_accuracy": 0.5}, {"epoch": 1, "val_accuracy": 0.75}]}).encode())
    status_uri = str(tmp_path / "job_status.json")
    storage.put_bytes(status_uri, JobStatus(state="succeeded", job_id="2-x", restarts=2).to_json())
    job = {"metrics_uri": metrics_uri, "model_prefix": "m/", "checkpoint_prefix": "c/", "resumed_from_step": 20,
           "attempt": 2, "job_uri": "j", "cluster": {}, "status_uri": status_uri}
    assert job_result(job) == {"model_prefix": "m/", "metrics_uri": metrics_uri, "checkpoint_prefix": "c/",
                               "resumed_from_step": 20, "attempt": 2, "restarts": 2, "global_step": 40,
                               "final_val_accuracy": 0.75, "best": best, "epochs_run": 2, "pruned": None}
    # After a restart in place the step resumed from is the last round's, which rank 0 reports.
    storage.put_bytes(metrics_uri, json.dumps({"global_step": 40, "resumed_from": 35, "history": [
        {"epoch": 0, "val_accuracy": 0.5}]}).encode())
    assert job_result(job)["resumed_from_step"] == 35
