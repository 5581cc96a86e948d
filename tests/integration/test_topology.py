"""The scaled-out deployment on network-namespace hosts (``infra.topology``), brought up as
``make topology`` does, the training DAG run on digits through the REST API (``hosts`` backend:
the supervisor and roles on the training hosts, the tasks on the two Celery workers), and
brought down: no namespace, uplink or process of the topology is left. Between the two, a
cluster provisioned on one Celery worker's host is found and released (its supervisor stopped
over ssh) by the other's reaper: no worker reads what another wrote on its disk.

Each host starts with its home empty (its configuration is in its environment and the shared
``etc/``), and a process of one worker cannot read what the other wrote into its home: the
DAG run passes with every host seeing its own home only.

Its own tier (``-m topology``, ``make test-topology``): several minutes and most of the
machine, so not part of ``make test``."""
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from common import storage
from infra import topology
from infra.topology import HOSTS, TopologySettings, down, host_home, up
from testkit.topology_runs import (cross_host_reads, cross_worker_release, leftovers, missing_tools, run_training_dag,
                                   worker_files)

pytestmark = pytest.mark.topology


@pytest.mark.skipif(bool(missing_tools()), reason=missing_tools() or "ok")
# Beyond the default 900 s: bringing it up and down takes minutes of its own, and the DAG run
# is bounded by 900 s by itself.
@pytest.mark.timeout(2400)
def test_training_dag_runs_on_the_topology_and_down_leaves_nothing(digits_csv, monkeypatch):
    settings = TopologySettings()
    # Not pytest's tmp_path: its mode-0700 parents keep out PostgreSQL's own user.
    root = Path(tempfile.mkdtemp(prefix="mxpipe-topology-"))
    root.chmod(0o755)
    # What each home holds when its host's first process starts (every start goes through
    # infra.topology._launch): nothing, since nothing but the host itself writes there.
    at_start: dict[str, list[str]] = {}
    launch = topology._launch

    def spy(root: Path, settings: TopologySettings, host: str, *args, **kwargs):
        at_start.setdefault(host, sorted(p.name for p in host_home(root, host).iterdir()))
        return launch(root, settings, host, *args, **kwargs)

    monkeypatch.setattr(topology, "_launch", spy)
    try:
        up(root, settings)
        # Checked before the DAG run spends minutes: a host sees its own home only.
        reads = cross_host_reads(root)
        print(json.dumps({"homes_at_start": at_start, "cross_host_reads": reads}))
        assert at_start == {host: [] for host in HOSTS}, at_start
        assert reads["written"] and reads["read_on_worker2"] == "ok: worker2 wrote this", reads
        assert reads["record_exists"], reads
        assert (reads["worker1_reads_worker2_file"], reads["worker1_lists_worker2_home"],
                reads["worker1_reads_worker2_records"], reads["worker1_reads_worker2_temp_file"]) == \
            ("FileNotFoundError",) * 4, reads
        assert reads["temp_in_own_home"], reads
        assert reads["worker1_lists_homes"] == "listed: worker1", reads
        result = run_training_dag(root, digits_csv, backend="hosts", timeout_s=900)
        # The release (on either worker) removed the run's cluster record from S3.
        records = list(storage.list_uris(f"s3://{settings.bucket}/clusters"))
        # No disk shared by the workers: what one provisioned, the other's reaper finds and
        # releases, stopping the job's supervisor on the training host; and neither home holds
        # a record of a cluster or job (they are in S3).
        cross = cross_worker_release(root)
        files = worker_files(root)
        print(json.dumps({"dag_run": {k: result[k] for k in ("seconds", "hostnames", "train_log_workers")},
                          "cross_worker": cross}))
    finally:
        stopped = down(root)
        shutil.rmtree(root, ignore_errors=True)
    assert result["state"] == "success", result
    states = dict(result["states"])
    assert states.pop("reuse") == "skipped"  # the branch not taken: this run trains
    assert set(states.values()) == {"success"}, states
    assert result["registered"]["test_accuracy"] > 0.85
    # The tasks ran on the workers' hosts, named by their addresses (a skipped task has none).
    workers = {settings.address("worker1"), settings.address("worker2")}
    assert {h for h in result["hostnames"].values() if h} <= workers, result["hostnames"]
    assert records == [], records
    assert cross["supervisor_started"] and cross["seen_by_worker2"] and cross["reaped_by_worker2"], cross
    assert (cross["supervisor_left"], cross["record_left"], cross["seen_by_worker1_after"]) == ([], False, False), cross
    assert files == {"worker1": [], "worker2": []}, files
    assert stopped
    assert leftovers(settings) == {"namespaces": [], "uplink": False, "processes": []}
