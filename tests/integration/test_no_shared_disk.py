"""Two Airflow workers share no disk: a cluster provisioned on one is found, stopped, released
and reaped from the other (``hosts`` backend, records in a real S3, SeaweedFS from testkit).

Two ``MXPIPE_HOME`` folders in one test stand for the two workers' disks: the first provisions
and starts the job's supervisor, then its folder is moved out of reach; the second, empty,
does everything else. The hosts use the ``local`` transport (their commands run on this
machine, their state in folders of their own): what is under test is which disk each step
reads, not the network.
"""
import logging
import os
import shutil
import sys
import time
import uuid

import pytest

from common import storage
from infra import hosts_cluster
from infra.cluster import ClusterSpec, attach, find_leaked, provision, reap

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stand_in_supervisor(python: str, job_uri: str, job_id: str, attempt: int) -> list[str]:
    """What the hosts backend starts detached in the supervisor's place: a process that lives
    until it is stopped (the stop under test is the backend's, not the supervisor's)."""
    return [python, "-c", "import time; time.sleep(300)"]


def _started(cluster, job_id: str) -> None:
    """The start returned once the stand-in had recorded itself on the first host (a stop
    finds it by that record only)."""
    record = os.path.join(cluster.hosts[0].state_dir, "jobs", cluster.cluster_id, "procs", f"{job_id}.json")
    assert os.path.exists(record), record


def _on_worker(monkeypatch: pytest.MonkeyPatch, home: os.PathLike) -> None:
    monkeypatch.setenv("MXPIPE_HOME", str(home))


def test_a_cluster_provisioned_on_one_worker_is_stopped_released_and_reaped_from_another(
        tmp_path, s3_prefix, monkeypatch, nothing_left, caplog):
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", f"{s3_prefix}/runs")
    monkeypatch.delenv("MXPIPE_CLUSTER_RECORDS", raising=False)
    monkeypatch.setattr(hosts_cluster, "supervise_argv", _stand_in_supervisor)
    hosts = [{"name": f"train{i}", "address": "127.0.0.1", "transport": "local", "python": sys.executable,
              "workdir": REPO, "state_dir": str(tmp_path / f"train{i}")} for i in range(2)]
    spec = ClusterSpec(run_tag=f"mxnet_training--noshared-{uuid.uuid4().hex[:8]}", workers=1, servers=1,
                       backend="hosts", ttl_s=60, options={"hosts": hosts})
    worker1, worker2 = tmp_path / "worker1", tmp_path / "worker2"
    worker1.mkdir()
    worker2.mkdir()

    # Worker 1: provision (the record goes to S3, beside the artifact root) and start the job.
    _on_worker(monkeypatch, worker1)
    t0 = time.monotonic()
    cluster = provision(spec)
    desc = cluster.describe()
    cluster.start_supervisor("s3://unused/job.json", job_id="job-1", attempt=1, env=dict(nothing_left.env))
    _started(cluster, "job-1")
    # Out of reach from here on: whatever worker 1 wrote on its own disk.
    shutil.move(worker1, tmp_path / "worker1-unreachable")

    # Worker 2, its home empty: a retry's provision finds the cluster instead of making another.
    _on_worker(monkeypatch, worker2)
    with caplog.at_level(logging.INFO, logger="infra.hosts_cluster"):
        again = provision(spec)
    assert again.cluster_id == cluster.cluster_id
    assert "already provisioned; reusing it" in caplog.text
    # Its reaper sees the cluster (once its TTL has run out).
    assert [leak.cluster_id for leak in find_leaked(now=time.time() + 120)] == [cluster.cluster_id]
    # on_kill / a retry's stop of the job worker 1 started: the supervisor on the first host ends.
    assert attach(desc).stop_job(grace_s=5) == ["job-1"]
    nothing_left.check("a stop from the other worker")
    # The release: the record (one S3 object beside the artifact root) is gone for every worker.
    assert cluster.record_uri == f"{s3_prefix}/clusters/{cluster.cluster_id}.json"
    assert storage.exists(cluster.record_uri)
    attach(desc).teardown()
    assert not storage.exists(cluster.record_uri)
    assert find_leaked(now=time.time() + 120) == []
    assert reap(now=time.time() + 120) == []
    assert list(worker2.rglob("*")) == []  # nothing of the cluster was ever on this worker's disk

    # Back on worker 1 (its disk as it left it): its reaper has nothing left to reap either.
    shutil.move(tmp_path / "worker1-unreachable", worker1)
    _on_worker(monkeypatch, worker1)
    assert find_leaked(now=time.time() + 120) == []
    logging.getLogger(__name__).info("provision to release across two homes: %.1fs", time.monotonic() - t0)


def test_the_reaper_on_either_worker_tears_down_an_expired_cluster(tmp_path, s3_prefix, monkeypatch, nothing_left):
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", f"{s3_prefix}/runs")
    monkeypatch.delenv("MXPIPE_CLUSTER_RECORDS", raising=False)
    monkeypatch.setattr(hosts_cluster, "supervise_argv", _stand_in_supervisor)
    hosts = [{"name": "train0", "address": "127.0.0.1", "transport": "local", "python": sys.executable,
              "workdir": REPO, "state_dir": str(tmp_path / "train0")}]
    spec = ClusterSpec(run_tag=f"mxnet_training--escaped-{uuid.uuid4().hex[:8]}", workers=1, servers=1,
                       backend="hosts", ttl_s=0.01, options={"hosts": hosts})
    _on_worker(monkeypatch, tmp_path / "worker1")
    cluster = provision(spec)
    cluster.start_supervisor("s3://unused/job.json", job_id="job-1", attempt=1, env=dict(nothing_left.env))
    _started(cluster, "job-1")
    _on_worker(monkeypatch, tmp_path / "worker2")  # never created: nothing of worker 1 here
    assert reap() == [cluster.cluster_id]
    nothing_left.check("the reaper on the other worker")
    assert not storage.exists(cluster.record_uri)
    assert not os.path.exists(tmp_path / "train0" / cluster.cluster_id)
