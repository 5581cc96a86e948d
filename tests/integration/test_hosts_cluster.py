"""The ``hosts`` backend across three hosts made of network namespaces on this machine.

Transport: ``ip netns exec`` (``infra.transport``, the ``netns`` carrier), not sshd: the hosts
backend builds one shell command per role and the carrier only differs in how it reaches the
host, so this exercises placement, per-host ``DMLC_NODE_HOST``, the remote env file, remote
process-group records and remote kill exactly as over ssh. Each namespace has its own network
stack and address (10.213.0.x on a bridge in a namespace of its own), so ps-lite traffic really
crosses hosts. Storage: the namespaces share this machine's filesystem, so the job document,
shards and checkpoints live in a local folder every host sees at the same path (what an
NFS/EFS mount is on real hosts); the S3 fixture binds 127.0.0.1, which a namespace cannot reach.
"""
import json
import os
import sys
import uuid

import pytest
from common import storage
from data_checks.shard import shard_dataset
from infra.cluster import ClusterSpec, ProvisionError, provision
from common.config import recipe
from training.launch.job import JobSpec
from training.launch.launcher import JobFailed, Supervisor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netns_hosts import hosts_pids, namespace_hosts, netns_available  # noqa: E402

pytestmark = pytest.mark.integration

_WHY_NOT = netns_available()
# Cluster ids are unique per session: suites may run side by side, and the scan sees them all.
SUFFIX = uuid.uuid4().hex[:8]
needs_netns = pytest.mark.skipif(bool(_WHY_NOT), reason=f"network namespaces unavailable: {_WHY_NOT}")


@pytest.fixture(scope="module")
def hosts():
    if _WHY_NOT:
        pytest.skip(_WHY_NOT)
    with namespace_hosts(3) as made:
        yield made


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory, digits_csv):
    root = tmp_path_factory.mktemp("hosts-data")
    (root / "digits.csv").write_bytes(digits_csv)
    cfg = recipe("debug", str(root / "digits.csv")).replace(cluster={"stall_timeout_s": 60.0})
    shard_dataset(cfg, str(root / "shards"))
    return cfg, str(root / "shards")


def _job(cfg, shards, out, **overrides):
    cfg = cfg.replace(**overrides) if overrides else cfg
    job = JobSpec(config=cfg, shards_prefix=shards, checkpoint_prefix=storage.join(out, "checkpoints"),
                  model_prefix=storage.join(out, "model"), metrics_uri=storage.join(out, "metrics.json"))
    job.save(storage.join(out, "job.json"))
    return job, storage.join(out, "job.json")


def _watch(watch, cluster, hosts):
    """The cluster's role processes, wherever they are, and anything running in a namespace host."""
    watch.tag("MXPIPE_CLUSTER", cluster.cluster_id).probe(lambda: hosts_pids(hosts))


@needs_netns
def test_job_runs_across_namespace_hosts(hosts, local_shards, tmp_path, nothing_left):
    cfg, shards = local_shards
    job, job_uri = _job(cfg, shards, str(tmp_path / "run"), optim={"epochs": 2})
    spec = ClusterSpec(run_tag=f"hosts-test--ok-{SUFFIX}", workers=2, servers=1, backend="hosts",
                       options={"hosts": hosts})
    cluster = provision(spec, home=str(tmp_path / "home"))
    _watch(nothing_left, cluster, hosts)
    assert provision(spec, home=str(tmp_path / "home")).cluster_id == cluster.cluster_id  # idempotent
    sup = Supervisor(job.config, cluster=cluster, base_env=dict(os.environ))
    try:
        sup.run(job_uri)
        placed = {r.name: r.host for r in sup.roles}
        # Scheduler and server on host 0, the workers on hosts 1 and 2: traffic crosses hosts.
        assert placed == {"scheduler": "10.213.0.1", "server-0": "10.213.0.1",
                          "worker-0": "10.213.0.2", "worker-1": "10.213.0.3"}
        metrics = json.loads(storage.get_bytes(job.metrics_uri))
        assert metrics["num_workers"] == 2 and len(metrics["history"]) == 2
        assert metrics["history"][-1]["val_accuracy"] > 0.7
    finally:
        cluster.teardown()
    nothing_left.check("the hosts cluster")
    assert not os.path.exists(cluster.state_dir)


@needs_netns
def test_a_custom_network_reaches_the_remote_workers_through_storage(hosts, local_shards, tmp_path, nothing_left):
    """The user's folder is gone once its code is staged: the workers on the other hosts build the
    network from the staged archive, fetched and verified through storage."""
    import dataclasses
    import shutil

    from common import model_code

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from custom_nets import write_package

    cfg, shards = local_shards
    code_dir = write_package(str(tmp_path / "user-nets"))
    out = str(tmp_path / "run")
    staged = model_code.stage(code_dir, storage.join(out, "code"))
    shutil.rmtree(code_dir)
    job, job_uri = _job(cfg, shards, out, optim={"epochs": 1},
                        model={"name": "mynet.arch:build", "code_uri": code_dir, "options": {"width": 24}})
    job = dataclasses.replace(job, model_code_uri=staged.uri, model_code_sha256=staged.sha256)
    job.save(job_uri)
    spec = ClusterSpec(run_tag=f"hosts-test--custom-{SUFFIX}", workers=2, servers=1, backend="hosts",
                       options={"hosts": hosts})
    cluster = provision(spec, home=str(tmp_path / "home"))
    _watch(nothing_left, cluster, hosts)
    sup = Supervisor(job.config, cluster=cluster, base_env=dict(os.environ))
    try:
        sup.run(job_uri)
        assert {r.host for r in sup.roles if r.kind == "worker"} == {"10.213.0.2", "10.213.0.3"}
        metrics = json.loads(storage.get_bytes(job.metrics_uri))
        assert metrics["num_workers"] == 2 and metrics["history"][-1]["val_accuracy"] > 0.5
    finally:
        cluster.teardown()
    nothing_left.check("the hosts cluster")


@needs_netns
def test_killed_remote_worker_is_reported_with_its_host_and_everything_stops(hosts, local_shards, tmp_path,
                                                                            nothing_left):
    cfg, shards = local_shards
    job, job_uri = _job(cfg, shards, str(tmp_path / "run"), optim={"epochs": 2})
    spec = ClusterSpec(run_tag=f"hosts-test--kill-{SUFFIX}", workers=2, servers=1, backend="hosts",
                       options={"hosts": hosts})
    cluster = provision(spec, home=str(tmp_path / "home"))
    _watch(nothing_left, cluster, hosts)
    env = {**os.environ, "MXPIPE_FAULT_KILL_STEP": "8", "MXPIPE_FAULT_KILL_RANK": "1"}
    try:
        with pytest.raises(JobFailed) as failed:
            Supervisor(job.config, cluster=cluster, base_env=env).run(job_uri)
        # Roles left alive by the failure were stopped on their hosts before run() returned.
        nothing_left.check("the supervisor")
    finally:
        cluster.teardown()
    err = failed.value
    assert err.role.startswith("worker-") and "killed by SIGKILL" in str(err)
    assert err.host in ("10.213.0.2", "10.213.0.3") and err.host in str(err)
    assert "last lines of worker-" in str(err)
    nothing_left.check("the hosts cluster")


@needs_netns
def test_unreachable_host_fails_provision_with_its_name(tmp_path):
    bad = {"name": "ghost", "address": "10.213.9.9", "transport": "netns", "netns": "mxpipe-no-such-ns",
           "python": "python3", "workdir": "/"}
    with pytest.raises(ProvisionError, match="ghost"):
        provision(ClusterSpec(run_tag=f"hosts-test--bad-{SUFFIX}", workers=1, servers=1, backend="hosts",
                              options={"hosts": [bad]}), home=str(tmp_path))
    assert not os.path.exists(tmp_path / "clusters" / f"hosts-test--bad-{SUFFIX}")
