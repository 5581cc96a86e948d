"""The ``hosts`` backend across three hosts made of network namespaces on this machine.

Each namespace has its own network stack and address (on a bridge in a namespace of its own),
so ps-lite traffic really crosses hosts; this machine is linked to the bridge too, as the
machine running the supervisor sits on the hosts' network (``netns_hosts``). Every job test
runs over both transports of ``infra.transport``:

- ``ssh``: a real OpenSSH server in each namespace (Debian's ``openssh-server``), key
  authentication with a client key made for this module, host keys made for it and pinned in a
  generated ``known_hosts`` (``StrictHostKeyChecking=yes``); every sshd is stopped by its process
  group at the end;
- ``netns``: ``ip netns exec``, the same shell command per role without sshd.

Every job runs as the train task runs it: its supervisor detached on the first host
(``training.launch.detached``), its lines relayed into this process's log, where the tests read
where each role ran.

Storage: the first tests read the job and shards from a folder every host sees at the same
path (what an NFS/EFS mount is on real hosts). The S3 tests instead run SeaweedFS bound to this
machine's bridge address, credentials enforced: the hosts download their shards and commit
their checkpoints through it over their veths, and an outage of that server is ridden out.
"""
import dataclasses
import json
import logging
import os
import re
import uuid

import pytest
from common import storage
from data_checks.shard import shard_dataset
from infra.cluster import ClusterSpec, ProvisionError, provision
from common.config import recipe
from training.launch.job import JobSpec
from training.launch.detached import run_detached
from training.launch.launcher import JobFailed
from testkit.netns_hosts import (controller_address, hosts_pids, link_stats, namespace_hosts,
                                 netns_available, ssh_hosts, sshd_available)

pytestmark = pytest.mark.integration

_WHY_NOT = netns_available()
_WHY_NOT_SSH = sshd_available()
# Cluster ids are unique per session: suites may run side by side, and the scan sees them all.
SUFFIX = uuid.uuid4().hex[:8]
needs_netns = pytest.mark.skipif(bool(_WHY_NOT), reason=f"network namespaces unavailable: {_WHY_NOT}")
needs_sshd = pytest.mark.skipif(bool(_WHY_NOT_SSH), reason=f"sshd in namespaces unavailable: {_WHY_NOT_SSH}")
TRANSPORTS = [pytest.param("netns", marks=needs_netns), pytest.param("ssh", marks=needs_sshd)]
OUTAGE_S = 20.0
JOB_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def topology(tmp_path_factory):
    """The namespace hosts by transport: ``netns`` always, ``ssh`` where sshd can run."""
    if _WHY_NOT:
        pytest.skip(_WHY_NOT)
    with namespace_hosts(3, controller=True) as made:
        if _WHY_NOT_SSH:
            yield {"netns": made}
            return
        with ssh_hosts(made, tmp_path_factory.mktemp("ssh")) as over_ssh:
            # The same hosts: their sshd is part of them, not a role left behind, either way.
            yield {"netns": [{**h, "extra": s["extra"]} for h, s in zip(made, over_ssh)], "ssh": over_ssh}


@pytest.fixture
def hosts(topology, request):
    return topology[request.param]


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory, digits_csv):
    root = tmp_path_factory.mktemp("hosts-data")
    (root / "digits.csv").write_bytes(digits_csv)
    cfg = recipe("debug", str(root / "digits.csv")).replace(cluster={"stall_timeout_s": 60.0})
    shard_dataset(cfg, str(root / "shards"))
    return cfg, str(root / "shards")


@pytest.fixture(scope="module")
def bridge_s3(topology, tmp_path_factory):
    """SeaweedFS on this machine's bridge address (credentials enforced), this process's and
    every role's S3 while the module's S3 tests run."""
    from testkit.chaos_jobs import ChaosStack

    stack = ChaosStack(tmp_path_factory.mktemp("bridge-s3"), address=controller_address(topology["netns"]))
    stack.start()
    try:
        with stack.environment():
            yield stack
    finally:
        stack.stop()  # whole process group; raises if SeaweedFS left a process behind


def _job(cfg, shards, out, **overrides):
    cfg = cfg.replace(**overrides) if overrides else cfg
    job = JobSpec(config=cfg, shards_prefix=shards, checkpoint_prefix=storage.join(out, "checkpoints"),
                  model_prefix=storage.join(out, "model"), metrics_uri=storage.join(out, "metrics.json"))
    job.save(storage.join(out, "job.json"))
    return job, storage.join(out, "job.json")


def _watch(watch, cluster, hosts):
    """The cluster's role processes, wherever they are, and anything running in a namespace host."""
    watch.tag("MXPIPE_CLUSTER", cluster.cluster_id).probe(lambda: hosts_pids(hosts))


def _detached(cluster, job, job_uri, caplog, env=None):
    """Run ``job`` on ``cluster`` under its detached supervisor; where each role ran (role →
    host address, from the supervisor's relayed "roles started: role@host …" line)."""
    job = dataclasses.replace(job, status_uri=storage.join(job_uri.rsplit("/", 1)[0], "job_status.json"),
                              cluster=cluster.job_cluster())
    job.save(job_uri)
    caplog.set_level(logging.INFO, logger="training.launch.launcher")
    run_detached(job_uri, env={**os.environ, **(env or {})}, timeout_s=JOB_TIMEOUT_S)
    started = re.search(r"roles started: (.*)", caplog.text)
    return dict(role.split("@") for role in started.group(1).split()) if started else {}


def _run_job(hosts, job, job_uri, home, tag, nothing_left, caplog):
    spec = ClusterSpec(run_tag=f"hosts-test--{tag}-{SUFFIX}", workers=2, servers=1, backend="hosts",
                       options={"hosts": hosts})
    cluster = provision(spec, home=home)
    _watch(nothing_left, cluster, hosts)
    assert provision(spec, home=home).cluster_id == cluster.cluster_id  # idempotent
    try:
        placed = _detached(cluster, job, job_uri, caplog)
    finally:
        cluster.teardown()
    nothing_left.check("the hosts cluster")
    assert not os.path.exists(cluster.state_dir)
    # Scheduler and server on host 0, the workers on hosts 1 and 2: traffic crosses hosts.
    assert placed == {"scheduler": hosts[0]["address"], "server-0": hosts[0]["address"],
                      "worker-0": hosts[1]["address"], "worker-1": hosts[2]["address"]}
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    assert metrics["num_workers"] == 2 and len(metrics["history"]) == 2
    assert metrics["history"][-1]["val_accuracy"] > 0.7


@pytest.mark.parametrize("hosts", TRANSPORTS, indirect=True)
def test_job_runs_across_namespace_hosts(hosts, local_shards, tmp_path, nothing_left, caplog):
    cfg, shards = local_shards
    job, job_uri = _job(cfg, shards, str(tmp_path / "run"), optim={"epochs": 2})
    _run_job(hosts, job, job_uri, str(tmp_path / "home"), f"ok-{hosts[0]['transport']}", nothing_left, caplog)


@pytest.mark.parametrize("hosts", TRANSPORTS[1:], indirect=True)
def test_a_custom_network_reaches_the_remote_workers_through_storage(hosts, local_shards, tmp_path, nothing_left,
                                                                     caplog):
    """The user's folder is gone once its code is staged: the workers on the other hosts build the
    network from the staged archive, fetched and verified through storage."""
    import shutil

    from common import model_code

    from testkit.custom_nets import write_package

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
    try:
        placed = _detached(cluster, job, job_uri, caplog)
        assert {placed["worker-0"], placed["worker-1"]} == {hosts[1]["address"], hosts[2]["address"]}
        metrics = json.loads(storage.get_bytes(job.metrics_uri))
        assert metrics["num_workers"] == 2 and metrics["history"][-1]["val_accuracy"] > 0.5
    finally:
        cluster.teardown()
    nothing_left.check("the hosts cluster")


@pytest.mark.parametrize("hosts", TRANSPORTS, indirect=True)
def test_killed_remote_worker_is_reported_with_its_host_and_everything_stops(hosts, local_shards, tmp_path,
                                                                            nothing_left, caplog):
    cfg, shards = local_shards
    # No restart in place: the lost worker ends the job (restarts: tests/integration/test_role_restarts.py).
    job, job_uri = _job(cfg, shards, str(tmp_path / "run"), optim={"epochs": 2},
                        cluster={"max_restarts_without_progress": 0})
    spec = ClusterSpec(run_tag=f"hosts-test--kill-{hosts[0]['transport']}-{SUFFIX}", workers=2, servers=1,
                       backend="hosts", options={"hosts": hosts})
    cluster = provision(spec, home=str(tmp_path / "home"))
    _watch(nothing_left, cluster, hosts)
    env = {"MXPIPE_FAULT_KILL_STEP": "8", "MXPIPE_FAULT_KILL_RANK": "1"}
    try:
        with pytest.raises(JobFailed) as failed:
            _detached(cluster, job, job_uri, caplog, env)
        # Roles left alive by the failure were stopped on their hosts before the job ended.
        nothing_left.check("the supervisor")
    finally:
        cluster.teardown()
    err = failed.value
    assert err.role.startswith("worker-") and "killed by SIGKILL" in str(err)
    assert err.host in (hosts[1]["address"], hosts[2]["address"]) and err.host in str(err)
    assert "last lines of worker-" in str(err)
    nothing_left.check("the hosts cluster")


@pytest.mark.parametrize("hosts", TRANSPORTS, indirect=True)
def test_unreachable_host_fails_provision_with_its_name(hosts, tmp_path):
    # A host the transport cannot reach: a namespace that does not exist, or (ssh) an address on
    # the hosts' subnet where nothing answers.
    bad = {**hosts[0], "name": "ghost", "netns": "mxpipe-no-such-ns",
           "address": f"{hosts[0]['address'].rsplit('.', 1)[0]}.99", "extra": {}}
    with pytest.raises(ProvisionError, match="ghost"):
        provision(ClusterSpec(run_tag=f"hosts-test--bad-{bad['transport']}-{SUFFIX}", workers=1, servers=1,
                              backend="hosts", options={"hosts": [bad]}), home=str(tmp_path))
    assert not os.path.exists(tmp_path / "clusters" / f"hosts-test--bad-{bad['transport']}-{SUFFIX}.json")


@needs_sshd
def test_ssh_job_reads_its_shards_and_commits_checkpoints_through_s3_over_the_links(
        topology, bridge_s3, digits_csv, tmp_path, nothing_left, caplog):
    from testkit.chaos_jobs import store_facts
    from training.checkpoint.store import CheckpointStore

    hosts = topology["ssh"]
    base = f"s3://{bridge_s3.bucket}/hosts-{SUFFIX}"
    storage.put_bytes(f"{base}/digits.csv", digits_csv)
    cfg = recipe("debug", f"{base}/digits.csv").replace(cluster={"stall_timeout_s": 60.0})
    shard_dataset(cfg, f"{base}/shards")
    job, job_uri = _job(cfg, f"{base}/shards", f"{base}/run", optim={"epochs": 2})
    assert bridge_s3.cfg.s3_endpoint.startswith(f"http://{controller_address(hosts)}:")
    before = [link_stats(h) for h in hosts]
    _run_job(hosts, job, job_uri, str(tmp_path / "home"), "s3", nothing_left, caplog)
    moved = [{k: a[k] - b[k] for k in ("rx_bytes", "tx_bytes")} for a, b in zip(map(link_stats, hosts), before)]
    facts = store_facts(job)
    assert facts["committed"] and not facts["torn"] and facts["latest_valid"] == max(facts["committed"])
    # Each worker's host received at least its half of the train shards over its link, and
    # rank 0's host sent at least the newest checkpoint's bytes (to S3 on this machine).
    train = sum(len(storage.get_bytes(u)) for u in storage.list_uris(f"{base}/shards") if "/train" in u
                and u.endswith(".rec"))
    newest = sum(len(storage.get_bytes(u)) for u in
                 storage.list_uris(CheckpointStore(job.checkpoint_prefix).step_uri(facts["latest_valid"])))
    assert all(m["rx_bytes"] >= train / 2 for m in moved[1:]), (moved, train)
    assert moved[1]["tx_bytes"] >= newest, (moved, newest)


@needs_sshd
@pytest.mark.timeout(1200)
def test_ssh_job_rides_out_an_s3_outage_on_the_bridge(topology, bridge_s3, tmp_path):
    from testkit import chaos
    from testkit.chaos_outage import r3

    spec = ClusterSpec(run_tag=f"hosts-test--s3-outage-{SUFFIX}", workers=2, servers=1, backend="hosts",
                       options={"hosts": topology["ssh"]})
    cluster = provision(spec, home=str(tmp_path / "home"))
    try:
        trial = r3(bridge_s3, tmp_path, chaos.base_config(), OUTAGE_S, cluster=cluster)
    finally:
        cluster.teardown()
    details = trial.details
    failed = {k: v for k, v in trial.checks.items() if not v}
    assert not failed, (failed, details)
    assert details["retry_lines"] and "retrying in" in details["retry_lines"][0]


@pytest.mark.parametrize("hosts", TRANSPORTS, indirect=True)
def test_killed_supervisor_its_remote_roles_end_and_a_rerun_resumes(hosts, local_shards, tmp_path, nothing_left,
                                                                    caplog):
    """``kill -9`` of the supervisor on the first host: every role, on every host, sees its
    transport's session end and ends itself within 5 s (rank 0 after its emergency checkpoint);
    the record reads dead at once (the first host is a namespace of this machine, whose process
    table it shares), and a new job on the prefix starts at once and resumes from that checkpoint."""
    import signal
    import time

    from training.checkpoint.store import CheckpointStore
    from training.launch.status import read_status

    cfg, shards = local_shards
    # Checkpoints at epoch ends only: one mid-epoch can only be the emergency one.
    job, job_uri = _job(cfg, shards, str(tmp_path / "run"), optim={"epochs": 3},
                        checkpoint={"every_n_steps": 100000})
    spec = ClusterSpec(run_tag=f"hosts-test--supervisor-{hosts[0]['transport']}-{SUFFIX}", workers=2, servers=1,
                       backend="hosts", options={"hosts": hosts})
    cluster = provision(spec, home=str(tmp_path / "home"))
    _watch(nothing_left, cluster, hosts)
    job = dataclasses.replace(job, status_uri=storage.join(str(tmp_path / "run"), "job_status.json"),
                              cluster=cluster.job_cluster())
    job.save(job_uri)
    store = CheckpointStore(job.checkpoint_prefix)
    # Rank 0's steps slowed, so the kill lands mid-epoch (see test_supervisor_loss.SLOW_RANK_0).
    slow = {"MXPIPE_FAULT_STEP_DELAY_S": "0.3", "MXPIPE_FAULT_KILL_RANK": "0"}
    try:
        cluster.start_supervisor(job_uri, job_id="0-killed", attempt=0, env={**os.environ, **slow})
        deadline = time.monotonic() + 300
        while not ((status := read_status(job.status_uri)) is not None
                   and status.global_step > max(store.committed_steps(), default=0)):
            assert time.monotonic() < deadline, "no progress past the newest checkpoint within 300s"
            time.sleep(0.2)
        before = max(store.committed_steps(), default=0)
        os.kill(status.pid, signal.SIGKILL)
        killed = time.monotonic()
        left = nothing_left.left(wait_s=5.0)
        assert not left, f"{len(left)} process(es) still running {time.monotonic() - killed:.1f}s after the kill"
        dead = read_status(job.status_uri)
        assert dead.active and not dead.live() and dead.supervisor_running() is False
        emergency = store.committed_steps()[0]
        assert emergency >= status.global_step > before, (emergency, status.global_step, before)
        caplog.set_level(logging.INFO, logger="training.launch.launcher")
        run_detached(job_uri, env=dict(os.environ), timeout_s=JOB_TIMEOUT_S)
    finally:
        cluster.teardown()
    nothing_left.check("the hosts cluster")
    assert {int(s) for s in re.findall(r"resumed from step (\d+) ", caplog.text)} == {emergency}
    assert json.loads(storage.get_bytes(job.metrics_uri))["history"][-1]["epoch"] == 2


@needs_sshd
@pytest.mark.timeout(300)
def test_nine_roles_over_ssh_one_session_each_spread_over_the_hosts(topology, digits_csv, tmp_path, nothing_left,
                                                                    caplog):
    """6 workers + 3 servers over SSH (what ``benchmarks/many_roles.py --backend hosts`` runs at
    9 to 16 roles): the placement spreads them round-robin over the three hosts, every worker
    joins the one job, the supervisor holds one ssh session per role (no more: the sessions of
    its short commands come and go) and nothing is left on any host."""
    import threading

    import psutil

    from training.launch.status import read_status

    hosts = topology["ssh"]
    root = tmp_path / "data"
    root.mkdir()
    (root / "digits.csv").write_bytes(digits_csv)
    cfg = recipe("debug", str(root / "digits.csv")).replace(data={"num_shards": 6})
    shard_dataset(cfg, str(root / "shards"))
    # One short epoch (batch 16 per worker: 13 steps), checkpoints only at its end.
    job, job_uri = _job(cfg, str(root / "shards"), str(tmp_path / "run"), optim={"epochs": 1, "batch_size": 16},
                        cluster={"num_workers": 6, "num_servers": 3, "stall_timeout_s": 60.0,
                                 "start_timeout_s": 120.0})
    spec = ClusterSpec(run_tag=f"hosts-test--nine-{SUFFIX}", workers=6, servers=3, backend="hosts",
                       options={"hosts": hosts})
    cluster = provision(spec, home=str(tmp_path / "home"))
    _watch(nothing_left, cluster, hosts)
    status_uri = storage.join(str(tmp_path / "run"), "job_status.json")
    sessions: list[int] = []
    done = threading.Event()

    def count_sessions() -> None:  # the supervisor's ssh children, at their peak
        while not done.wait(0.5):
            status = read_status(status_uri) if os.path.exists(status_uri) else None
            if status is not None and status.pid:
                try:
                    sessions.append(sum(c.name() == "ssh" for c in psutil.Process(status.pid).children()))
                except psutil.Error:
                    continue

    sampler = threading.Thread(target=count_sessions, daemon=True)
    sampler.start()
    try:
        placed = _detached(cluster, job, job_uri, caplog)
    finally:
        done.set()
        sampler.join(timeout=10)
        cluster.teardown()
    nothing_left.check("the hosts cluster")
    by_host = {h["address"]: sorted(r for r, a in placed.items() if a == h["address"]) for h in hosts}
    assert by_host == {hosts[0]["address"]: ["scheduler", "server-0", "worker-0", "worker-3"],
                       hosts[1]["address"]: ["server-1", "worker-1", "worker-4"],
                       hosts[2]["address"]: ["server-2", "worker-2", "worker-5"]}, by_host
    # One per role, and the short commands of a start or a stop (free-port, the env files,
    # kill-records: one per host at most) beside them.
    assert 10 <= max(sessions, default=0) <= 13, sessions
    metrics = json.loads(storage.get_bytes(job.metrics_uri))
    assert metrics["num_workers"] == 6 and len(metrics["history"]) == 1
