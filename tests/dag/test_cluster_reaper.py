"""The reaper DAG: parses light, runs on a schedule, and (``dag.test()`` with a real Airflow
metadata DB) tears down a cluster left past its TTL, killing the role it had left running."""
import json
import os
import subprocess
import sys
import uuid

import pytest

pytestmark = pytest.mark.dag

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RUNNER = """
import json, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(sys.argv[1])
assert not bag.import_errors, bag.import_errors
dag = bag.dags["cluster_reaper"]
assert type(dag.timetable).__name__ == "CronTriggerTimetable", dag.timetable
assert [t.task_id for t in dag.tasks] == ["reap"]
dr = dag.test()
ti = dr.get_task_instances()[0]
print("REAPER_RESULT " + json.dumps({"state": str(dr.state), "xcom": ti.xcom_pull(task_ids="reap")}))
"""


def test_reaper_dag_tears_down_an_expired_cluster(tmp_path, nothing_left):
    from infra.cluster import ClusterSpec
    from infra.local_cluster import LocalCluster

    home = tmp_path / "home"
    run_tag = f"mxnet_training--escaped-{uuid.uuid4().hex[:8]}"  # unique: suites may run side by side
    cluster = LocalCluster(run_tag, ClusterSpec(run_tag=run_tag, workers=1, servers=1, ttl_s=0.01), str(home))
    cluster.write_record()
    orphan = cluster.spawner().spawn("worker-0", ["sleep", "300"], {**os.environ, "MXPIPE_CLUSTER": cluster.cluster_id})
    # Also kills the stand-in role at the end if the reaper did not, whatever failed.
    nothing_left.tag("MXPIPE_CLUSTER", cluster.cluster_id)
    _reap_through_airflow(tmp_path, home, cluster)
    orphan.wait(timeout=10)  # the reaper killed it (a TimeoutExpired here means it did not)
    nothing_left.check("the reaper")
    assert not os.path.exists(cluster.state_dir)


def _reap_through_airflow(tmp_path, home, cluster):
    env = {**os.environ, "MXPIPE_HOME": str(home), "AIRFLOW_HOME": str(tmp_path / "airflow"),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_FOLDER": os.path.join(REPO, "dags"),
           "PYTHONPATH": REPO, "MXPIPE_SCHEDULE": "none"}
    env.pop("MXPIPE_EC2_FILE", None)
    airflow = os.path.join(os.path.dirname(sys.executable), "airflow")
    subprocess.run([airflow, "db", "migrate"], env=env, check=True, capture_output=True, timeout=300)
    out = subprocess.run([sys.executable, "-c", RUNNER, os.path.join(REPO, "dags")], env=env, capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("REAPER_RESULT ")]
    assert lines, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(lines[-1].split(" ", 1)[1])
    assert result["state"] == "success"
    assert result["xcom"]["clusters"] == [cluster.cluster_id]
