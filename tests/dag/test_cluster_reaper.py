"""The reaper DAG: parses light, runs on a schedule, and (``dag.test()`` with a real Airflow
metadata DB) tears down a cluster left past its TTL, killing the role it had left running."""
import os
import uuid

import pytest

from testkit.dag_runs import airflow_env, run_dag

pytestmark = pytest.mark.dag


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
    # The records where the cluster above wrote its own (a home of its own: no S3 here).
    env = airflow_env(home, AIRFLOW_HOME=str(tmp_path / "airflow"), MXPIPE_CLUSTER_RECORDS=str(home / "clusters"))
    env.pop("MXPIPE_EC2_FILE", None)
    result, _ = run_dag(env, None, dag_id="cluster_reaper", xcom_tasks=("reap",), timeout=300)
    assert result["dag"]["timetable"] == "CronTriggerTimetable", result["dag"]
    assert result["dag"]["task_ids"] == ["reap"]
    assert result["state"] == "success"
    assert result["xcom"]["reap"]["clusters"] == [cluster.cluster_id]
