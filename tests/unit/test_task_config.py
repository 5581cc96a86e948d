"""The training DAG's config: resolved once from the Params (the ``backend`` Param included),
carried as a plain dict in XCom and rebuilt downstream into the same config."""
import json

import pytest

pytestmark = pytest.mark.unit

PARAMS = {"dataset_uri": "s3://b/d.csv", "label_column": "label", "recipe": "debug", "model": "mlp", "epochs": 2,
          "batch_size": 32, "learning_rate": 0.005, "optimizer": "adam", "num_workers": 2, "num_servers": 1,
          "kvstore": "dist_sync", "checkpoint_every_n_steps": 10, "backend": "hosts",
          "data_options": {"classes": [0, 1, 2], "feature_range": [0, 16]}}


@pytest.fixture
def tasks():
    pytest.importorskip("airflow.sdk")
    from plugins import pipeline_tasks

    return pipeline_tasks


def test_the_backend_param_is_the_configs_cluster_backend(tasks):
    assert tasks.resolve_config(PARAMS).cluster.backend == "hosts"
    assert tasks.resolve_config({**PARAMS, "backend": ""}).cluster.backend == "local"


def test_an_unknown_backend_fails_naming_the_field(tasks):
    from airflow.sdk.exceptions import AirflowFailException

    with pytest.raises(AirflowFailException, match=r"invalid configuration: cluster\.backend must be one of"):
        tasks.resolve_config({**PARAMS, "backend": "k8s"})


def test_the_config_xcom_rebuilds_the_same_config(tasks):
    cfg = tasks.resolve_config(PARAMS)
    xcom = json.loads(json.dumps(tasks.config_xcom(cfg)))  # what XCom stores and hands back
    again = tasks.load_config(xcom)
    assert again == cfg and again.digest() == cfg.digest()
