"""A table of its own through the scaled-out deployment (``infra.topology``), then its review,
all through the REST API: the generated three-class table of ``testkit.scaled_tables`` (features
on scales 0.01 to 1000, a nonlinear label) trains with the DAG's defaults (the ``digits`` recipe:
an epoch budget with early stopping) on the ``hosts`` backend, its version is reviewed by the
``model_review`` DAG (its gate passes: no champion yet), the approval is answered Approve as a
reviewer would, and the version becomes the champion in the topology's MLflow (on PostgreSQL,
artifacts in S3). Then ``down`` leaves nothing.

Its own tier (``-m topology``, ``make test-topology``), not part of ``make test``."""
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from infra.airflow_client import AirflowClient, trigger_dag_run, wait_for_dag, wait_for_dag_run, wait_for_task_state
from infra.topology import TopologySettings, client_env, down, host_records, up
from testkit.airflow_stack import wait_until_parked
from testkit.scaled_tables import scaled_classification_table
from testkit.topology_runs import leftovers, missing_tools, run_training_dag

pytestmark = pytest.mark.topology

MODEL = "scaled-table-topology"
REVIEW = "model_review"


@pytest.mark.skipif(bool(missing_tools()), reason=missing_tools() or "ok")
@pytest.mark.timeout(2400)
def test_a_table_of_its_own_trains_on_the_topology_and_its_approved_review_makes_it_champion():
    settings = TopologySettings()
    # Not pytest's tmp_path: its mode-0700 parents keep out PostgreSQL's own user.
    root = Path(tempfile.mkdtemp(prefix="mxpipe-topology-"))
    root.chmod(0o755)
    try:
        t0 = time.monotonic()
        up(root, settings)
        up_s = time.monotonic() - t0
        table = scaled_classification_table(4000, seed=0).to_csv(index=False).encode()
        trained = run_training_dag(root, table, key="topology-test/scaled.csv",
                                   conf={"recipe": "digits", "label_column": "label", "registered_model_name": MODEL})
        assert trained["state"] == "success", trained
        version = str(trained["registered"]["version"])
        review = _review(root, version)
        from mlflow.tracking import MlflowClient

        mlflow = MlflowClient(client_env(root)["mlflow_uri"])
        champion = mlflow.get_model_version_by_alias(MODEL, "champion").version
        tags = mlflow.get_model_version(MODEL, version).tags
        print({"up_s": round(up_s, 1), "train_dag_s": trained["seconds"], "review_s": review["seconds"],
               "test_accuracy": trained["registered"]["test_accuracy"]})
    finally:
        stopped = down(root)
        shutil.rmtree(root, ignore_errors=True)
    assert trained["registered"]["test_accuracy"] > 0.6  # three balanced classes: 0.33 by chance
    assert review["state"] == "success" and review["states"]["promote"] == "success", review
    assert review["states"]["reject"] == "skipped", review
    assert "Model card" in review["body"] and "- gate: passed" in review["body"], review["body"]
    assert champion == version and tags["review"] == "approved" and tags["review.comment"] == "topology review"
    assert stopped
    assert leftovers(settings) == {"namespaces": [], "uplink": False, "processes": []}


def _review(root: Path, version: str) -> dict:
    """Trigger the review of ``version`` through the REST API, answer its approval (once the
    scheduler has taken in the pause: an instant answer races it), wait for the end."""
    url = client_env(root)["airflow_url"]
    wait_for_dag(url, REVIEW, timeout_s=300, dag_file="model_review.py")
    t0 = time.monotonic()
    run_id = trigger_dag_run(url, REVIEW, {"model_name": MODEL, "version": version})
    wait_for_task_state(url, REVIEW, run_id, "approval", "awaiting_input", timeout_s=900, poll_s=3)
    wait_until_parked(host_records(root, "airflow"), run_id, "approval")
    with AirflowClient(url) as client:
        body = client.hitl_detail(REVIEW, run_id, "approval")["body"]
        client.respond(REVIEW, run_id, "approval", ["Approve"], {"comment": "topology review"})
    state = wait_for_dag_run(url, REVIEW, run_id, timeout_s=600, poll_s=3)
    with AirflowClient(url) as client:
        states = client.task_states(REVIEW, run_id)
    return {"state": state, "states": states, "body": body, "seconds": round(time.monotonic() - t0, 1)}
