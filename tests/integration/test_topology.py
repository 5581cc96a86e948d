"""The scaled-out deployment on network-namespace hosts (``infra.topology``), brought up as
``make topology`` does, the training DAG run on digits through the REST API (``hosts`` backend:
the supervisor and roles on the training hosts, the tasks on the two Celery workers), and
brought down: no namespace, uplink or process of the topology is left.

Its own tier (``-m topology``, ``make test-topology``): several minutes and most of the
machine, so not part of ``make test``."""
import shutil
import tempfile
from pathlib import Path

import pytest
from infra.topology import TopologySettings, down, up
from testkit.topology_runs import leftovers, missing_tools, run_training_dag

pytestmark = pytest.mark.topology


@pytest.mark.skipif(bool(missing_tools()), reason=missing_tools() or "ok")
def test_training_dag_runs_on_the_topology_and_down_leaves_nothing(digits_csv):
    settings = TopologySettings()
    # Not pytest's tmp_path: its mode-0700 parents keep out PostgreSQL's own user.
    root = Path(tempfile.mkdtemp(prefix="mxpipe-topology-"))
    root.chmod(0o755)
    try:
        up(root, settings)
        result = run_training_dag(root, digits_csv, backend="hosts", timeout_s=900)
    finally:
        stopped = down(root)
        shutil.rmtree(root, ignore_errors=True)
    assert result["state"] == "success", result
    # The reuse branch is skipped: the run trains (no earlier version has its inputs).
    assert {t: s for t, s in result["states"].items() if s != "success"} == {"reuse": "skipped"}
    assert result["registered"]["test_accuracy"] > 0.85
    # The tasks ran on the workers' hosts, named by their addresses (the skipped reuse task ran
    # nowhere: its hostname is empty).
    workers = {settings.address("worker1"), settings.address("worker2")}
    assert {h for t, h in result["hostnames"].items() if t != "reuse"} <= workers, result["hostnames"]
    assert stopped
    assert leftovers(settings) == {"namespaces": [], "uplink": False, "processes": []}
