"""One parse of the dags folder for every DAG-tier test file (a DagBag costs seconds here)."""
import os

import pytest

from testkit import REPO


@pytest.fixture(scope="session")
def dagbag(tmp_path_factory):
    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow-home")))
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(os.path.join(REPO, "dags"))
    assert bag.import_errors == {}
    return bag


@pytest.fixture(scope="module")
def dag(dagbag):
    """The training DAG as parsed by the real DagBag."""
    return dagbag.dags["mxnet_training"]
