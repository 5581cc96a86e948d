"""Early stopping and the best epoch in real 2-worker ps-lite jobs checkpointing to a real S3
server (SeaweedFS): the job stops once the validation accuracy has not improved for
``patience`` epochs, every worker at the same step; the exported (and registered) parameters
are the best epoch's checkpoint's, which retention kept; a job killed and resumed, on the same
or (elastic) another number of workers, makes the same decisions.

The configuration peaks early by construction of its learning rate (0.02 with dropout, measured
here): validation accuracy is best at epoch 7 (0.933) and falls at epochs 8 and 9, so with a
patience of 2 the job stops after epoch 9 of 12 (step 200; 20 steps an epoch with 2 workers).
That curve was measured on the raw pixel values, so the digits are sharded without the table
standardisation (``data.standardize``, on by default since), which changes it.
"""
import json
import logging
import re

import numpy as np
import pytest

from common import storage
from training.checkpoint.store import CheckpointStore
from training.launch.launcher import JobFailed
from testkit.local_jobs import checkpoint_params, make_job as _job, run_job as _run, shard_digits

pytestmark = pytest.mark.integration

EPOCHS, PATIENCE, STEPS_PER_EPOCH = 12, 2, 20
# The accuracy curve below is what this module is built on: the metric is named (not "auto").
OVERRIDES = {"optim": {"epochs": EPOCHS, "learning_rate": 0.02, "early_stopping_patience": PATIENCE,
                       "early_stopping_metric": "val_accuracy"},
             "model": {"hidden": (32,), "dropout": 0.2},
             # Synchronous writes: every checkpoint due is written (an asynchronous one may be
             # skipped while the previous uploads), so which ones exist is known.
             "checkpoint": {"every_n_steps": 7, "keep": 3, "async_upload": False}}


@pytest.fixture(scope="module")
def shards(s3_server, digits_csv):
    cfg, shards_prefix = shard_digits(f"s3://{s3_server.bucket}/test-early-stopping", digits_csv, standardize=False)
    return cfg.replace(**OVERRIDES), shards_prefix


def _metrics(job):
    return json.loads(storage.get_bytes(job.metrics_uri))


def _exported_params(job):
    from common.mx import import_mxnet

    blob = storage.get_bytes(storage.join(job.model_prefix, "model-0000.params"))
    return [a.asnumpy() for a in import_mxnet().nd.load_frombuffer(blob).values()]


def _exported_equal(job, params):
    """Whether the exported model holds exactly ``params`` (a checkpoint's, by structural name;
    the export names them by gluon's prefixes, so they are matched by value)."""
    exported = _exported_params(job)
    return len(exported) == len(params) and all(
        any(e.shape == p.shape and np.array_equal(e, p) for e in exported) for p in params.values())


@pytest.fixture(scope="module")
def reference(shards, s3_server, tmp_path_factory):
    """The uninterrupted job: its metrics, its final and its best checkpoint's parameters."""
    cfg, shards_prefix = shards
    prefix = f"s3://{s3_server.bucket}/test-early-stopping-reference"
    job = _job(cfg, shards_prefix, prefix)
    _run(job, prefix, tmp_path_factory.mktemp("reference"))
    metrics = _metrics(job)
    return {"job": job, "prefix": prefix, "metrics": metrics,
            "final": checkpoint_params(job, metrics["global_step"]),
            "best": checkpoint_params(job, metrics["best"]["best_step"])}


def test_validation_peaks_early_and_every_worker_stops_at_the_same_step(reference):
    metrics, best = reference["metrics"], reference["metrics"]["best"]
    accuracy = [h["val_accuracy"] for h in metrics["history"]]
    print(f"val_accuracy per epoch: {[round(a, 4) for a in accuracy]}; selection {best}")
    assert best["stopped_at_epoch"] == best["best_epoch"] + PATIENCE < EPOCHS - 1
    assert len(metrics["history"]) == best["stopped_at_epoch"] + 1
    assert metrics["global_step"] == (best["stopped_at_epoch"] + 1) * STEPS_PER_EPOCH == best["best_step"] + \
        PATIENCE * STEPS_PER_EPOCH
    assert best["best_value"] == max(accuracy) == accuracy[best["best_epoch"]]
    assert (best["metric"], best["mode"], best["exported"]) == ("val_accuracy", "max", "best")
    # Both workers ran the same steps: the job ended (a worker left pushing alone would stall it)
    # and every step's loss was recorded once.
    assert [r["step"] for r in metrics["step_history"]] == list(range(1, metrics["global_step"] + 1))


def test_the_export_is_the_best_checkpoint_which_retention_kept(reference):
    job, metrics = reference["job"], reference["metrics"]
    best_step = metrics["best"]["best_step"]
    committed = CheckpointStore(job.checkpoint_prefix).committed_steps()
    # The newest 3 (200: the epoch end; 196, 189 periodic) and the best epoch's end, older than them.
    assert committed == [200, 196, 189, best_step], committed
    assert _exported_equal(job, reference["best"])
    assert not _exported_equal(job, reference["final"])


def test_a_job_resumed_after_it_stopped_trains_nothing_and_exports_the_best_again(reference, tmp_path, caplog):
    job = reference["job"]
    storage.delete_prefix(job.model_prefix)
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    _run(job, reference["prefix"], tmp_path)
    assert "nothing left to train" in caplog.text
    assert _metrics(job)["best"] == reference["metrics"]["best"]
    assert _exported_equal(job, reference["best"])


# Killed after step 150 (resumes at 147, epoch 7: before the best epoch's end) or 190 (at 189,
# epoch 9: the best epoch and one without a new best are in the checkpoint's state).
@pytest.mark.parametrize("kill_step,newest", [(150, 147), (190, 189)], ids=["before-the-best", "after-the-best"])
def test_a_killed_worker_and_a_resume_make_the_same_decisions(shards, reference, s3_prefix, tmp_path, caplog,
                                                             kill_step, newest):
    cfg, shards_prefix = shards
    # No restart in place: the killed job ends, and the next one (the retry's) resumes.
    job = _job(cfg, shards_prefix, s3_prefix, cluster={"max_restarts_without_progress": 0})
    with pytest.raises(JobFailed, match="SIGKILL"):
        _run(job, s3_prefix, tmp_path, env={"MXPIPE_FAULT_KILL_STEP": str(kill_step), "MXPIPE_FAULT_KILL_RANK": "1"})
    assert CheckpointStore(job.checkpoint_prefix).committed_steps()[0] == newest
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    caplog.clear()
    _run(job, s3_prefix, tmp_path)
    resumed = re.findall(r"resumed from step (\d+)", caplog.text)
    assert resumed and int(resumed[0]) == newest, caplog.text[-3000:]
    metrics = _metrics(job)
    assert metrics["best"] == reference["metrics"]["best"]
    assert metrics["global_step"] == reference["metrics"]["global_step"]
    final = checkpoint_params(job, metrics["global_step"])  # bit-identical to the uninterrupted run's
    assert final.keys() == reference["final"].keys()
    assert all(np.array_equal(final[k], reference["final"][k]) for k in final)
    assert _exported_equal(job, reference["best"])


def test_elastic_resume_on_one_worker_keeps_the_best_so_far_and_its_patience(shards, reference, s3_prefix, tmp_path):
    cfg, shards_prefix = shards
    job2 = _job(cfg, shards_prefix, s3_prefix, checkpoint={"elastic": True},
                cluster={"max_restarts_without_progress": 0})
    with pytest.raises(JobFailed):
        _run(job2, s3_prefix, tmp_path, env={"MXPIPE_FAULT_KILL_STEP": "190", "MXPIPE_FAULT_KILL_RANK": "1"})
    # The newest checkpoint is 189, in epoch 9, after the best epoch (7) and one epoch without a
    # new best (8).
    assert CheckpointStore(job2.checkpoint_prefix).committed_steps()[0] == 189
    job1 = _job(cfg, shards_prefix, s3_prefix, cluster={"num_workers": 1}, checkpoint={"elastic": True})
    _run(job1, s3_prefix, tmp_path)
    metrics, ref = _metrics(job1), reference["metrics"]
    best = metrics["best"]
    assert metrics["num_workers"] == 1
    assert [h["val_accuracy"] for h in metrics["history"][:9]] == [h["val_accuracy"] for h in ref["history"][:9]]
    accuracy = [h["val_accuracy"] for h in metrics["history"]]
    # The epochs on one worker are another trajectory; the decisions follow from the whole
    # history, the two workers' epochs included: the first best is kept unless beaten, and the
    # job stops exactly PATIENCE epochs after the best.
    assert best["best_value"] == max(accuracy) and best["best_epoch"] == accuracy.index(max(accuracy))
    assert best["best_value"] >= ref["best"]["best_value"]
    stopped = best["stopped_at_epoch"]
    assert stopped == best["best_epoch"] + PATIENCE or (stopped is None and len(accuracy) == EPOCHS)
    assert _exported_equal(job1, checkpoint_params(job1, best["best_step"]))


def test_the_registered_model_and_its_run_record_the_selection(reference, mlflow_server, tmp_path):
    import pandas as pd
    from mlflow import MlflowClient

    from training.tracking.job_registration import download_model
    from training.tracking.registry import ModelRunRequest, log_model_run

    job, best = reference["job"], reference["metrics"]["best"]
    model_dir = tmp_path / "model"
    download_model(job.model_prefix, str(model_dir))
    columns = json.loads((model_dir / "model_meta.json").read_text())["feature_columns"]
    result = log_model_run(ModelRunRequest(
        tracking_uri=mlflow_server.tracking_uri, experiment="early-stopping", run_name="early-stopping",
        tags={"airflow.dag_id": "test"}, params={"config": job.config.to_dict()},
        epoch_metrics=reference["metrics"]["history"],
        final_metrics={"global_step": reference["metrics"]["global_step"]},
        model_dir=str(model_dir), registered_model_name="early-stopping-test",
        input_example=pd.DataFrame(np.zeros((2, len(columns))), columns=columns),
        selection=best))
    client = MlflowClient(mlflow_server.tracking_uri)
    expected = {"best.metric": "val_accuracy", "best.epoch": str(best["best_epoch"]),
                "best.step": str(best["best_step"]), "best.value": repr(best["best_value"]),
                "model.epoch_exported": "best", "early_stopped_at": str(best["stopped_at_epoch"])}
    version = client.get_model_version(result["registered_model_name"], result["version"])
    run = client.get_run(result["run_id"])
    assert expected.items() <= version.tags.items() and expected.items() <= run.data.tags.items()
    assert run.data.metrics["best_epoch"] == best["best_epoch"]
    assert run.data.metrics["best_val_accuracy"] == pytest.approx(best["best_value"])
    assert run.data.metrics["early_stopped_epoch"] == best["stopped_at_epoch"]


def test_regression_stops_on_val_rmse_and_exports_the_best_epoch(s3_server, tmp_path):
    """model.task='regression' with the watched metric left at 'auto': the job watches val_rmse
    (lower is better) on scikit-learn's diabetes table, standardised by default; a learning rate
    that overfits within the epochs makes it stop, and the export is the best epoch's checkpoint."""
    from sklearn.datasets import load_diabetes

    from common.config import recipe
    from data_checks.shard import shard_dataset

    prefix = f"s3://{s3_server.bucket}/test-early-stopping-regression"
    source = storage.join(prefix, "diabetes.csv")
    storage.put_bytes(source, load_diabetes(as_frame=True).frame.to_csv(index=False).encode())
    cfg = recipe("debug", source).replace(
        data={"label_column": "target"}, model={"task": "regression", "loss": "l2", "hidden": (64, 32)},
        optim={"epochs": 60, "learning_rate": 0.05, "early_stopping_patience": 3},
        checkpoint={"every_n_steps": 1000, "async_upload": False})
    shard_dataset(cfg, storage.join(prefix, "shards"))
    job = _job(cfg, storage.join(prefix, "shards"), storage.join(prefix, "run"))
    _run(job, storage.join(prefix, "run"), tmp_path)
    metrics = _metrics(job)
    best, rmse = metrics["best"], [h["val_rmse"] for h in metrics["history"]]
    print(f"val_rmse per epoch: {[round(r, 2) for r in rmse]}; selection {best}")
    assert (best["metric"], best["mode"], best["exported"]) == ("val_rmse", "min", "best")
    assert best["stopped_at_epoch"] == best["best_epoch"] + 3 == len(rmse) - 1 < 59
    assert best["best_value"] == min(rmse) == rmse[best["best_epoch"]]
    assert _exported_equal(job, checkpoint_params(job, best["best_step"]))
