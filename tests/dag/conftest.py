"""The training DAG as parsed by a real DagBag, shared by the dag-tier tests."""
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def dag(tmp_path_factory):
    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow-home")))
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(os.path.join(REPO, "dags"))
    assert bag.import_errors == {}
    return bag.dags["mxnet_training"]
