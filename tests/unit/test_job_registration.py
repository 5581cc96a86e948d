"""What the training DAG's register step records besides the model (``training.tracking.job_registration``):
the run's tags, the lineage a review and a warm start read back, and the headline test metrics."""
import pytest

from common.config import recipe
from training.tracking.job_registration import TrainedJob, headline_metrics, run_tags
from training.tracking.review import SHARDS_TAG

pytestmark = pytest.mark.unit


def _job(**changes):
    fields = dict(config=recipe("debug", "s3://b/d.csv"), dag_id="mxnet_training", run_id="manual__1", try_number=2,
                  registered_model_name="digits", tracking_uri="http://mlflow", shards_prefix="s3://b/shards/abc",
                  manifest_digest="d1g", source_fingerprint="f1n",
                  model_prefix="s3://b/model", metrics_uri="s3://b/metrics/train.json", resumed_from_step=0,
                  train_attempts=1)
    return TrainedJob(**{**fields, **changes})


def test_the_run_is_tagged_with_its_dag_run_attempt_and_lineage(monkeypatch):
    monkeypatch.setenv("MXPIPE_GIT_SHA", "c0ffee")
    assert run_tags(_job()) == {
        "airflow.dag_id": "mxnet_training", "airflow.run_id": "manual__1", "airflow.try_number": "2",
        "dataset.manifest_digest": "d1g", "mlflow.source.git.commit": "c0ffee",
        "dataset.shards_prefix": "s3://b/shards/abc", "dataset.fingerprint": "f1n"}
    assert SHARDS_TAG in run_tags(_job())  # where a review finds the test data


def test_the_headline_metric_follows_the_task():
    scores = {"test_accuracy": 0.9, "test_rmse": 1.5, "test_r2": 0.7, "accuracy_score": 0.9}
    assert headline_metrics("classification", scores) == {"test_accuracy": 0.9}
    assert headline_metrics("regression", scores) == {"test_rmse": 1.5, "test_r2": 0.7}


def test_the_register_task_hands_the_card_its_lineage(monkeypatch):
    """``plugins.pipeline_tasks.register`` passes the card's inputs on: the job's checkpoints, the
    Airflow run's page, the instance type Param and a custom network's code digest."""
    from plugins import pipeline_tasks
    from training.tracking import job_registration

    seen = {}
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.test")
    monkeypatch.setattr(job_registration, "register_trained_job", lambda job: seen.setdefault("job", job))
    config = pipeline_tasks.config_xcom(recipe("debug", "s3://b/d.csv"))
    shards = {"shards_prefix": "s3://b/shards/abc", "manifest_digest": "d1g", "fingerprint": "f1n",
              "model_code": {"uri": "s3://b/code/model_code.tar.gz", "sha256": "c0de"}}
    trained = {"model_prefix": "s3://b/model", "metrics_uri": "s3://b/m.json", "resumed_from_step": 0, "attempt": 1,
               "checkpoint_prefix": "s3://b/run/checkpoints"}
    pipeline_tasks.register(config, {"registered_model_name": "digits", "instance_type": "c5.large"}, shards,
                            trained, {}, {"manifest_digest": "d1g", "config_digest": "c0nf"}, "mxnet_training",
                            "manual__1", 1,
                            airflow_run_url="http://airflow/dags/mxnet_training/runs/manual__1")
    job = seen["job"]
    assert job.input_tags["mxpipe.input.manifest_digest"] == "d1g"
    assert (job.checkpoints_prefix, job.airflow_run_url, job.instance_type, job.model_code_sha256) == (
        "s3://b/run/checkpoints", "http://airflow/dags/mxnet_training/runs/manual__1", "c5.large", "c0de")
