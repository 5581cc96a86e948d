"""Which failures of a training job are retried: only a ``common.errors.DeterministicError``
(bad input, config, data) ends a job "do not retry"; anything else raised inside the job, a
library's plain ``ValueError`` included, is a failure a retry may fix.

Each job here is real: digits shards, a user's network (``model.code_uri``), one worker
``python -m training worker`` on the local backend under a detached supervisor. The verdict is
read the way the training operator reads it: the status record, judged by its trigger, mapped
by ``execute_complete`` to ``TrainingFailed`` (Airflow retries) or ``AirflowFailException``
(it does not)."""
from __future__ import annotations

import os
import time

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits

import pandas as pd
import pytest

from common import model_code, storage
from common.config import recipe
from common.errors import DataError, DeterministicError
from common.events import DETERMINISTIC_EXIT_CODES, EXIT_BAD_INPUT
from training.launch.job import JobSpec

pytestmark = pytest.mark.unit

# Two factories with the same ValueError: raised while the network is built, it is the config's
# fault (the pipeline names it a ModelBuildError); raised in the first training step, it stands
# for a bug in a library the network calls, which the config cannot be blamed for.
NETWORK = '''
from mxnet import autograd, gluon
from mxnet.gluon import nn


class FailsInTraining(gluon.HybridBlock):
    def __init__(self, num_outputs, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.out = nn.Dense(num_outputs)

    def hybrid_forward(self, F, x):
        if autograd.is_training():
            raise ValueError("operands could not be broadcast together")
        return self.out(x)


def build(num_outputs, input_shape, options):
    return FailsInTraining(num_outputs)


def refuses(num_outputs, input_shape, options):
    raise ValueError("operands could not be broadcast together")
'''


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits")
    digits = load_digits()
    table = pd.DataFrame(digits.data, columns=[f"px{i}" for i in range(digits.data.shape[1])])
    table["label"] = digits.target
    source = str(folder / "digits.csv")
    table.to_csv(source, index=False)
    from data_checks.shard import shard_dataset

    cfg = recipe("debug", source)
    shard_dataset(cfg, str(folder / "shards"))
    return cfg, str(folder / "shards")


def _run(shards, tmp_path, env, factory):
    """Run the job with the network ``faulty:<factory>``; its ``JobFailed`` and the operator's
    verdict on its status record (the exception class ``execute_complete`` raised)."""
    pytest.importorskip("airflow.sdk")
    from airflow.sdk.exceptions import AirflowFailException

    from plugins.train_operator import TrainingFailed, TrainJobOperator
    from plugins.train_trigger import TrainJobTrigger, read_job_status
    from training.launch.detached import local_cluster, run_detached
    from training.launch.launcher import JobFailed

    base, shards_prefix = shards
    code = tmp_path / "user-code"
    code.mkdir()
    (code / "faulty.py").write_text(NETWORK)
    cfg = base.replace(model={"name": f"faulty:{factory}", "code_uri": str(code)},
                       cluster={"num_workers": 1, "num_servers": 1, "kvstore": "local", "start_timeout_s": 120,
                                "stall_timeout_s": 120, "job_timeout_s": 300,
                                # The verdict on one failure, as the operator sees it (a restart
                                # in place would repeat it first: tests/unit/test_restart_in_place.py).
                                "max_restarts_without_progress": 0})
    staged = model_code.stage(str(code), str(tmp_path / "staged"))
    out = str(tmp_path / "out")
    job = JobSpec(config=cfg, shards_prefix=shards_prefix, checkpoint_prefix=storage.join(out, "checkpoints"),
                  model_prefix=storage.join(out, "model"), metrics_uri=storage.join(out, "metrics.json"),
                  model_code_uri=staged.uri, model_code_sha256=staged.sha256,
                  status_uri=storage.join(out, "job_status.json"),
                  cluster=local_cluster(f"retry-{factory}", cfg, home=str(tmp_path / "home")))
    uri = storage.join(out, "job.json")
    job.save(uri)
    with pytest.raises(JobFailed) as failed:
        run_detached(uri, env={**os.environ, **env}, timeout_s=600, job_id="1-retry")
    trigger = TrainJobTrigger(job={"job_id": "1-retry", "status_uri": job.status_uri, "submitted_at": time.time()},
                              cluster=job.cluster, aws_conn_id="aws_default", poll_s=1, stale_after_s=60,
                              stop_grace_s=5)
    event = trigger.judge(read_job_status(job.status_uri, "aws_default"), time.time())
    with pytest.raises((TrainingFailed, AirflowFailException)) as verdict:
        TrainJobOperator(task_id="train", cluster={}, shards={}, config={},
                         warm_start={"reference": "", "checkpoint": None}).execute_complete({}, event.payload)
    return failed.value, type(verdict.value).__name__


def test_a_plain_value_error_inside_the_job_is_retried(shards, tmp_path, nothing_left):
    from plugins.train_operator import TrainingFailed

    failed, verdict = _run(shards, tmp_path, nothing_left.env, "build")
    assert "ValueError: operands could not be broadcast together" in str(failed)  # its traceback, relayed
    assert failed.exit_code == 1 and failed.exit_code not in DETERMINISTIC_EXIT_CODES and not failed.deterministic
    assert verdict == TrainingFailed.__name__
    nothing_left.check("the failed job")


def test_a_deterministic_error_inside_the_job_is_not_retried(shards, tmp_path, nothing_left):
    from airflow.sdk.exceptions import AirflowFailException

    failed, verdict = _run(shards, tmp_path, nothing_left.env, "refuses")
    assert "the factory raised ValueError: operands could not be broadcast together" in str(failed)
    assert failed.exit_code == EXIT_BAD_INPUT and failed.deterministic
    assert verdict == AirflowFailException.__name__
    nothing_left.check("the failed job")


def test_every_bad_input_error_is_a_deterministic_error_and_a_plain_value_error_is_not():
    from common.config import ConfigError
    from data_checks.errors import DataValidationError
    from infra.cluster_settings import ClusterSettingsError
    from training.checkpoint.crypto import CheckpointKeyError
    from training.tracking.gate import GateConfigError
    from training.tracking.mlflow_params import ParamConflictError
    from training.tracking.warm_start import WarmStartError

    for kind in (ConfigError, DataError, DataValidationError, ClusterSettingsError, CheckpointKeyError,
                 GateConfigError, ParamConflictError, WarmStartError):
        assert issubclass(kind, DeterministicError) and issubclass(kind, ValueError), kind
    assert not issubclass(ValueError, DeterministicError)
