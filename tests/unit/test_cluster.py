"""The cluster interface without machines: records, TTL and the reaper, teardown of roles left
by another process, placement, the ps-lite environment and the transports' command lines."""
import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from common.roles import JobLaunch, PsLiteKnobs, role_env
from infra.cluster import ClusterSpec, attach, find_leaked, reap
from infra.hosts_cluster import HostsCluster
from infra.local_cluster import LocalCluster
from infra.transport import HostSpec, host_argv
from common.procs.records import live_records

pytestmark = pytest.mark.unit


# Unique per test session: test suites may run side by side on one machine, and the process
# scan looks at every process on it.
SUFFIX = uuid.uuid4().hex[:8]


def _local(tmp_path, run="dag--run", ttl_s=3600.0):
    run = f"{run}-{SUFFIX}"
    cluster = LocalCluster(run, ClusterSpec(run_tag=run, workers=2, servers=1, ttl_s=ttl_s), str(tmp_path))
    cluster.write_record()  # what provision does after its host check
    return cluster


def _orphan_role(cluster, name="worker-0"):
    """A role started in an earlier attempt whose supervisor died (e.g. the task was killed)."""
    proc = cluster.spawner().spawn(name, ["sleep", "300"], {**os.environ, "MXPIPE_CLUSTER": cluster.cluster_id})
    return proc


def test_teardown_from_another_process_stops_leftover_roles(tmp_path, nothing_left):
    cluster = _local(tmp_path)
    proc = _orphan_role(cluster)
    nothing_left.tag("MXPIPE_CLUSTER", cluster.cluster_id).group(proc.pid)
    desc = cluster.describe()
    code = ("import json, sys; from infra.cluster import attach; "
            "print(json.dumps(attach(json.loads(sys.argv[1])).teardown()))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(desc)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert '"worker-0"' in out.stdout
    proc.wait(timeout=10)
    nothing_left.check("teardown")
    assert not os.path.exists(cluster.state_dir)
    assert attach(desc).teardown() == {"stopped": []}  # idempotent


def test_reaper_tears_down_only_expired_clusters(tmp_path, nothing_left):
    expired = _local(tmp_path, run="dag--old", ttl_s=1)
    fresh = _local(tmp_path, run="dag--new")
    proc = _orphan_role(expired)
    nothing_left.tag("MXPIPE_CLUSTER", expired.cluster_id)
    later = time.time() + 5
    assert [leak.cluster_id for leak in find_leaked(home=str(tmp_path), now=later)] == [expired.cluster_id]
    assert reap(home=str(tmp_path), now=later) == [expired.cluster_id]
    proc.wait(timeout=10)
    nothing_left.check("the reaper")
    assert fresh.exists() and not expired.exists() and not os.path.exists(expired.state_dir)
    # older_than_s: only what expired more than that long ago.
    assert find_leaked(3600, home=str(tmp_path), now=time.time() + 3700) == []
    fresh.teardown()


def test_unreadable_record_is_reaped_after_a_grace_period(tmp_path):
    (tmp_path / "clusters").mkdir(parents=True)
    (tmp_path / "clusters" / "broken.json").write_text("{not json")
    assert find_leaked(home=str(tmp_path)) == []
    leaks = find_leaked(home=str(tmp_path), now=time.time() + 3600)
    assert [(leak.cluster_id, leak.backend) for leak in leaks] == [("broken", "unknown")]
    assert reap(home=str(tmp_path), now=time.time() + 3600) == ["broken"]
    assert not (tmp_path / "clusters" / "broken.json").exists()


def test_records_live_beside_the_artifact_root_unless_set(monkeypatch, tmp_path):
    from infra.cluster import records_root

    monkeypatch.delenv("MXPIPE_CLUSTER_RECORDS", raising=False)
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", "s3://bucket/runs")
    assert records_root() == "s3://bucket/clusters"
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", "s3://bucket")
    assert records_root() == "s3://bucket/clusters"
    monkeypatch.setenv("MXPIPE_ARTIFACT_ROOT", str(tmp_path / "art" / "runs"))
    assert records_root() == str(tmp_path / "art" / "clusters")
    monkeypatch.setenv("MXPIPE_CLUSTER_RECORDS", "s3://other/records")
    assert records_root() == "s3://other/records"
    assert records_root(str(tmp_path)) == str(tmp_path / "clusters")  # a harness's own home


def test_the_local_backend_is_refused_under_a_multi_host_executor():
    from infra.cluster import ProvisionError
    from infra.local_cluster import refuse_across_hosts

    for executor in ("LocalExecutor", "airflow.executors.local_executor.LocalExecutor", "SequentialExecutor"):
        refuse_across_hosts(executor, single_host=False)
    for executor in ("CeleryExecutor", "LocalExecutor,CeleryExecutor",
                     "airflow.providers.celery.executors.celery_executor.CeleryExecutor",
                     "KubernetesExecutor", "edge:airflow.providers.edge3.executors.EdgeExecutor"):
        with pytest.raises(ProvisionError, match="local backend cannot run under Airflow's .*Executor"):
            refuse_across_hosts(executor, single_host=False)
    refuse_across_hosts("CeleryExecutor", single_host=True)  # MXPIPE_SINGLE_HOST: the deployment says so


def test_the_backend_registry_is_the_configs_backend_list():
    """cluster.backend is validated against common.config.BACKENDS; each name has its class."""
    from common.config import BACKENDS
    from infra.cluster import ProvisionError, backend_class

    assert {name: backend_class(name).backend for name in BACKENDS} == {name: name for name in BACKENDS}
    with pytest.raises(ProvisionError, match="unknown cluster backend 'k8s'"):
        backend_class("k8s")


def test_spec_rejects_nonsense():
    with pytest.raises(ValueError):
        ClusterSpec(run_tag="x", workers=0, servers=1)
    with pytest.raises(ValueError):
        ClusterSpec(run_tag="x", workers=1, servers=1, ttl_s=0)


def test_a_spot_release_is_nothing_where_the_cluster_owns_no_machines(tmp_path):
    """Only ``ec2`` loses machines to a spot notice; local and hosts clusters keep their shape."""
    local = _local(tmp_path)
    hosts = HostsCluster("c", ClusterSpec(run_tag="c", workers=2, servers=1, backend="hosts",
                                          options={"hosts": [{"name": "h0", "address": "10.0.0.1",
                                                              "transport": "local"}]}), str(tmp_path))
    for cluster in (local, hosts):
        before = cluster.describe()
        assert cluster.release_interrupted("10.0.0.1", replace=False) is True  # its shape kept
        assert cluster.release_interrupted("127.0.0.1", replace=True) is True
        assert cluster.describe() == before


def test_hosts_placement_spreads_workers_after_the_servers():
    hosts = [{"name": f"h{i}", "address": f"10.0.0.{i}", "transport": "local"} for i in range(3)]
    cluster = HostsCluster("c", ClusterSpec(run_tag="c", workers=4, servers=2, backend="hosts",
                                            options={"hosts": hosts}), "/nonexistent")
    placed = {r.name: h.name for r, h in cluster.placement(JobLaunch("j", 4, 2).roles())}
    assert placed == {"scheduler": "h0", "server-0": "h0", "server-1": "h1",
                      "worker-0": "h2", "worker-1": "h0", "worker-2": "h1", "worker-3": "h2"}


def test_role_env_sets_the_ps_lite_variables_on_purpose():
    launch = JobLaunch("s3://b/job.json", num_workers=3, num_servers=2, threads_per_role=2,
                       env={"AWS_REGION": "eu-west-1"}, knobs=PsLiteKnobs(interface="eth0"))
    env = role_env(launch, "worker", node_host="10.0.0.2", root_uri="10.0.0.1", root_port=9091,
                   base={"PATH": "/bin"}, repo_root="/opt/mxpipe")
    assert {k: env[k] for k in ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NODE_HOST",
                                "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_INTERFACE")} == {
        "DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "10.0.0.1", "DMLC_PS_ROOT_PORT": "9091",
        "DMLC_NODE_HOST": "10.0.0.2", "DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "2", "DMLC_INTERFACE": "eth0"}
    assert env["PS_RESEND"] == "0" and env["PS_HEARTBEAT_INTERVAL"] == "0" and env["OMP_NUM_THREADS"] == "2"
    assert env["AWS_REGION"] == "eu-west-1" and env["PYTHONPATH"] == "/opt/mxpipe"
    resend = PsLiteKnobs(resend=True, heartbeat_interval_s=5).env()
    assert resend["PS_RESEND"] == "1" and resend["PS_RESEND_TIMEOUT"] == "1000"
    assert resend["PS_HEARTBEAT_TIMEOUT"] == "30"


def test_a_single_process_kvstore_job_is_its_worker_without_ps_lite():
    from common.config import recipe
    from training.launch.launcher import launch_for

    cfg = recipe("debug").replace(cluster={"kvstore": "local", "num_workers": 1})
    launch = launch_for(cfg, "s3://b/job.json")
    assert [r.name for r in launch.roles()] == ["worker-0"]
    env = role_env(launch, "worker", node_host="127.0.0.1", root_uri="127.0.0.1", root_port=9091,
                   base={"PATH": "/bin", "DMLC_ROLE": "server"}, repo_root="/opt/mxpipe")
    assert not [k for k in env if k.startswith("DMLC_")] and env["OMP_NUM_THREADS"] == "1"
    assert [r.name for r in launch_for(recipe("debug"), "j").roles()] == ["scheduler", "server-0", "worker-0",
                                                                          "worker-1"]


def test_local_workers_run_a_given_command_without_the_tracking_credentials(tmp_path, nothing_left, monkeypatch):
    """``spec.options["worker_argv"]`` replaces the worker's command (probes, benchmarks); the
    supervisor's MLflow credentials stay its own."""
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "not-for-roles")
    spec = ClusterSpec(run_tag=f"argv-{SUFFIX}", workers=1, servers=1,
                       options={"worker_argv": ["sh", "-c", "echo token=${MLFLOW_TRACKING_TOKEN:-none} $DMLC_ROLE"]})
    cluster = LocalCluster(spec.run_tag, spec, str(tmp_path))
    launch = JobLaunch(job_uri="j", num_workers=1, num_servers=1, env=dict(nothing_left.env), distributed=False)
    [worker] = cluster.start_roles(launch)
    out, _ = worker.proc.communicate(timeout=30)
    assert worker.name == "worker-0" and out.strip() == "token=none"  # no ps-lite either: not distributed
    nothing_left.check("the worker")


def test_transport_command_lines():
    ssh = HostSpec(name="a", address="10.1.2.3", ssh_user="train", ssh_key="/k", ssh_port=2222)
    argv = host_argv(ssh, "echo hi")
    assert argv[0] == "ssh" and "BatchMode=yes" in argv and "ServerAliveInterval=5" in argv
    assert argv[-2:] == ["train@10.1.2.3", "echo hi"] and argv[argv.index("-p") + 1] == "2222"
    ns = HostSpec(name="b", address="10.213.0.2", transport="netns", netns="mxh1")
    assert host_argv(ns, "echo hi") == ["ip", "netns", "exec", "mxh1", "sh", "-c", "echo hi"]
    with pytest.raises(ValueError):
        HostSpec(name="c", address="x", transport="netns")


def test_pinned_known_hosts_wins_over_the_default_trust_on_first_use():
    # ssh keeps the first value of each option: the pinned file's must come before ssh_options.
    host = HostSpec(name="a", address="10.1.2.3", ssh_key="/k", known_hosts="/kh")
    argv = host_argv(host, "true")
    strict = [argv[i + 1] for i, a in enumerate(argv) if a == "-o" and argv[i + 1].startswith("StrictHostKey")]
    assert strict[0] == "StrictHostKeyChecking=yes"
    assert "UserKnownHostsFile=/kh" in argv and "GlobalKnownHostsFile=/dev/null" in argv
    assert "IdentitiesOnly=yes" in argv


def test_a_role_killed_by_a_signal_over_ssh_reads_as_a_local_child_killed_by_it():
    from infra.transport import exit_status, role_command

    ssh = HostSpec(name="a", address="10.1.2.3", workdir="/w")
    ns = HostSpec(name="b", address="10.213.0.2", transport="netns", netns="mxh1", workdir="/w")
    # Over ssh the shell outlives the role (no exec), so its 128 + N reaches ssh's exit status.
    assert role_command(ssh, "python", "-m", "x") == "cd /w && python -m x; exit $?"
    assert role_command(ns, "python", "-m", "x") == "cd /w && exec python -m x"
    assert exit_status(ssh, 137) == -9 and exit_status(ssh, 255) == 255 and exit_status(ssh, 3) == 3
    assert exit_status(ssh, None) is None and exit_status(ns, 137) == 137


def test_hosts_supervisor_starts_detached_on_the_first_host_apart_from_the_roles_records():
    hosts = [{"name": f"h{i}", "address": f"10.0.0.{i}", "transport": "local", "python": "/py",
              "workdir": "/opt/p", "state_dir": "/s"} for i in range(2)]
    cluster = HostsCluster("c", ClusterSpec(run_tag="c", workers=2, servers=1, backend="hosts",
                                            options={"hosts": hosts}), "/nonexistent")
    line = cluster.supervisor_command("s3://b/job.json", "1-x", 1)
    assert line.startswith("cd /opt/p && (setsid nohup /py -m common.procs exec-role --record /s/jobs/c/procs/1-x.json "
                           "--env-file /s/jobs/c/env --env-key 1-x -- /py -m training supervise s3://b/job.json "
                           "--job-id 1-x --attempt 1 > /s/jobs/c/1-x.log 2>&1 < /dev/null &)")
    # and returns once it has recorded itself, which is how any stop_job finds it (bounded: 30 s)
    assert "while [ ! -f /s/jobs/c/procs/1-x.json ] && [ $i -lt 150 ]; do sleep 0.2;" in line
    assert line.endswith("test -f /s/jobs/c/procs/1-x.json || { echo 'the supervisor did not record itself in "
                         "/s/jobs/c/procs/1-x.json within 30s; the end of its log /s/jobs/c/1-x.log:' >&2; "
                         "tail -n 20 /s/jobs/c/1-x.log >&2; exit 1; }")
    # the roles' kill-records folder (what the supervisor's own stops clear) does not hold it
    assert not "/s/jobs/c".startswith(cluster._remote_dir(cluster.hosts[0]))


def test_hosts_stop_roles_stops_only_the_roles_it_is_given_on_their_hosts(tmp_path, nothing_left):
    """The supervisor's orderly stop signals rank 0 alone first (its emergency checkpoint needs
    its peers alive to finish the step): stopping one role must leave the others on its host
    and on the other hosts running (it used to run ``kill-records`` over every role everywhere)."""
    from infra.hosts_cluster import RemoteRole
    from testkit.waits import wait_for

    hosts = [{"name": f"h{i}", "address": f"10.0.0.{i}", "transport": "local", "python": sys.executable,
              "workdir": os.getcwd(), "state_dir": str(tmp_path / "state")} for i in range(2)]
    cluster = HostsCluster(f"stop-{SUFFIX}", ClusterSpec(run_tag=f"stop-{SUFFIX}", workers=2, servers=1,
                                                         backend="hosts", options={"hosts": hosts}), str(tmp_path))
    nothing_left.records(cluster._remote_dir(cluster.hosts[0], "a", "procs"))
    nothing_left.records(cluster._remote_dir(cluster.hosts[1], "a", "procs"))
    roles = {}
    for name, host in (("worker-0", cluster.hosts[0]), ("server-0", cluster.hosts[0]), ("worker-1", cluster.hosts[1])):
        record = cluster._remote_dir(host, "a", "procs", f"{name}.json")
        # The role on its host (a recorded group of its own), and its transport's client here.
        subprocess.Popen([sys.executable, "-m", "common.procs", "exec-role", "--record", record, "--", "sleep", "300"],
                         start_new_session=True)
        client = subprocess.Popen(["sleep", "300"], start_new_session=True)
        nothing_left.group(client.pid)
        roles[name] = RemoteRole(name, name.split("-")[0], host, client)
    wait_for(lambda: len(live_records([cluster._remote_dir(h, "a", "procs") for h in cluster.hosts])) == 3,
               timeout_s=30, what="the three roles recorded")
    try:
        assert cluster.stop_roles([roles["worker-0"]], grace_s=1.0) == 1
        left = {rec.name for rec in live_records([cluster._remote_dir(h, "a", "procs") for h in cluster.hosts])}
        assert left == {"server-0", "worker-1"}
        assert roles["worker-0"].poll() is not None and roles["server-0"].poll() is None
    finally:
        cluster.stop_roles(list(roles.values()), grace_s=1.0)
    assert not live_records([cluster._remote_dir(h, "a", "procs") for h in cluster.hosts])


def test_ec2_supervisor_script_runs_it_detached_on_rank_0_with_its_env_in_a_file():
    from infra.ec2_cluster import Ec2Cluster

    cluster = Ec2Cluster("c", ClusterSpec(run_tag="c", workers=2, servers=1, backend="ec2",
                                          options={"launch_template": "lt"}), "/nonexistent",
                         instance_ids=["i-0", "i-1"], addresses=["10.0.0.1", "10.0.0.2"])
    script = cluster.supervisor_script("s3://b/job.json", "2-y", 2, {"MXPIPE_CLUSTER": "c", "X": "it's"})
    folder = "/var/run/mxpipe-roles/jobs/c"
    assert script[0] == f"umask 077 && mkdir -p {folder}"
    head, body, end = script[1].split("\n")
    assert head == f"cat > {folder}/env <<'MXPIPE_ENV'" and end == "MXPIPE_ENV"
    assert json.loads(body) == {"2-y": {"MXPIPE_CLUSTER": "c", "X": "it's"}}
    assert script[2].startswith(f"cd /opt/mxpipe && (setsid nohup /opt/mxpipe/.venv/bin/python -m common.procs "
                                f"exec-role --record {folder}/procs/2-y.json --env-file {folder}/env --env-key 2-y -- "
                                "/opt/mxpipe/.venv/bin/python -m training supervise s3://b/job.json --job-id 2-y "
                                f"--attempt 2 > {folder}/2-y.log 2>&1 < /dev/null &) && ")
    # and, as the hosts backend's start, ends once the supervisor has recorded itself (bounded)
    assert f"while [ ! -f {folder}/procs/2-y.json ] && [ $i -lt 150 ]; do sleep 0.2;" in script[2]
    assert f"test -f {folder}/procs/2-y.json || {{ echo 'the supervisor did not record itself" in script[2]
    assert cluster.job_cluster() == {"factory": "infra.cluster:attach", "description": cluster.describe()}


def test_the_provision_task_refuses_the_local_backend_on_a_celery_deployment(monkeypatch):
    """Under the CeleryExecutor the provision task fails at once (no retry), naming the backend
    and the executor, before anything is provisioned; MXPIPE_SINGLE_HOST lets it through."""
    from common.config import recipe
    from plugins import pipeline_tasks
    from plugins.failures import fail_without_retry

    provisioned = []
    monkeypatch.setattr("infra.cluster.provision", lambda spec, *a, **kw: provisioned.append(spec) or _Described())
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "CeleryExecutor")
    monkeypatch.delenv("MXPIPE_SINGLE_HOST", raising=False)
    config = pipeline_tasks.config_xcom(recipe("debug", "s3://b/d.csv"))
    with pytest.raises(type(fail_without_retry("")), match="local backend cannot run under Airflow's CeleryExecutor"):
        pipeline_tasks.provision(config, {}, "mxnet_training", "manual__1")
    assert provisioned == []
    monkeypatch.setenv("MXPIPE_SINGLE_HOST", "1")
    assert pipeline_tasks.provision(config, {}, "mxnet_training", "manual__1") == {"backend": "local"}
    monkeypatch.delenv("MXPIPE_SINGLE_HOST")
    monkeypatch.setenv("AIRFLOW__CORE__EXECUTOR", "LocalExecutor")
    assert pipeline_tasks.provision(config, {}, "mxnet_training", "manual__1") == {"backend": "local"}
    assert [spec.backend for spec in provisioned] == ["local", "local"]


class _Described:
    def describe(self) -> dict:
        return {"backend": "local"}


def test_ssh_key_paths_under_home_are_each_connecting_hosts_own(monkeypatch):
    """A hosts list with "~/" paths names, on every host that reads the cluster's record, that
    host's own copy of the key (ssh itself would expand "~" from the password database)."""
    host = HostSpec(name="a", address="10.1.2.3", ssh_key="~/ssh/id", known_hosts="~/ssh/known_hosts")
    for home in ("/homes/worker1", "/homes/worker2"):
        monkeypatch.setenv("HOME", home)
        argv = host_argv(host, "true")
        assert argv[argv.index("-i") + 1] == f"{home}/ssh/id"
        assert f"UserKnownHostsFile={home}/ssh/known_hosts" in argv
