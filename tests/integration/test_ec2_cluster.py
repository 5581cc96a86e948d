"""The ``ec2`` backend against a moto server (``moto_server`` on 127.0.0.1, moto's stand-alone
server mode, spoken to over HTTP by the real boto3 clients): EC2 and SSM cannot run here.

What moto does and does not model, so what these tests prove: launch templates, spot
requests, tags, instance states, status checks, SSM ``send_command`` /
``get_command_invocation`` (it runs nothing and reports every command ``Success``), terminate.
It neither stores the placement group of an instance nor honours ``ClientToken``, so
idempotency is shown through the run's tags (a retry finds and reuses its instances). Where what
a command does is under test (the detached supervisor's start and stop), ``LocalSsmAgent`` runs
the commands on this machine in the instance's agent's place. After every test, the moto server
has no instance left that is not terminated.
"""
import json
import os
import posixpath
import shlex
import sys
import time

import boto3
import pytest
from infra.cluster import ClusterSpec, ProvisionError, SupervisorHostLost, attach, find_leaked, provision, reap
from infra.ec2_cluster import (TAG_CLUSTER, TAG_EXPIRES, TAG_RECLAIMED, TAG_RUN, Ec2Options, _wait, find_expired,
                               reap_expired)
from common.procs.identity import ProcessIdentity
from common.procs.records import live_records
from common.procs.spot import SPOT_NOTICE_ENV, SPOT_WATCH_ENV
from common.procs.watchdog import SUPERVISOR_ENV
from common.roles import JobLaunch
from infra import ec2_cluster
from tests.integration.moto_server import LocalSsmAgent, moto_server

pytestmark = pytest.mark.integration

REGION = "us-east-1"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "testing")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        mp.delenv("AWS_SESSION_TOKEN", raising=False)
        with moto_server(str(tmp_path_factory.mktemp("moto"))) as url:
            ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=url)
            ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
            ec2.create_launch_template(LaunchTemplateName="mxpipe-trainer-gpu",
                                       LaunchTemplateData={"ImageId": ami, "InstanceType": "g5.2xlarge"})
            yield url


@pytest.fixture
def ec2(moto):
    client = boto3.client("ec2", region_name=REGION, endpoint_url=moto)
    yield client
    assert _live(client) == [], "instances left running in the moto server"


def _live(ec2, **filters):
    flt = [{"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}]
    flt += [{"Name": f"tag:{k}", "Values": [v]} for k, v in filters.items()]
    return [i for r in ec2.describe_instances(Filters=flt)["Reservations"] for i in r["Instances"]]


def _spec(moto, run, workers=2, servers=1, ttl_s=3600, **opts):
    options = {"launch_template": "mxpipe-trainer-gpu", "endpoint_url": moto, "region": REGION,
               "poll_s": 0.1, "status_poll_s": 0.1, "running_timeout_s": 30, "status_timeout_s": 30,
               "terminate_timeout_s": 30, **opts}
    return ClusterSpec(run_tag=run, workers=workers, servers=servers, backend="ec2", instance_type="g5.xlarge",
                       devices_per_worker=1, ttl_s=ttl_s, options=options)


def test_provision_tags_spot_instances_reuses_them_on_retry_and_teardown_terminates(moto, ec2, tmp_path):
    spec = _spec(moto, "mxnet_training--run-a", spot=True, placement_group="mxpipe-cluster-pg")
    cluster = provision(spec, home=str(tmp_path))
    try:
        live = _live(ec2, **{TAG_CLUSTER: cluster.cluster_id})
        assert sorted(i["InstanceId"] for i in live) == sorted(cluster.instance_ids) and len(live) == 2
        for inst in live:
            tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
            assert tags[TAG_RUN] == "mxnet_training--run-a"
            assert time.time() + 3500 < float(tags[TAG_EXPIRES]) < time.time() + 3700
            assert inst["InstanceLifecycle"] == "spot" and inst["InstanceType"] == "g5.xlarge"
        # A retried provision finds the run's healthy instances and launches nothing.
        again = provision(spec, home=str(tmp_path))
        assert again.instance_ids == cluster.instance_ids
        # One instance lost (spot reclaim): the retry keeps the survivor and replaces the other.
        ec2.terminate_instances(InstanceIds=[cluster.instance_ids[1]])
        healed = provision(spec, home=str(tmp_path))
        assert healed.instance_ids[0] == cluster.instance_ids[0]
        assert healed.instance_ids[1] != cluster.instance_ids[1] and len(healed.instance_ids) == 2
    finally:
        result = cluster.teardown()
    assert _live(ec2, **{TAG_CLUSTER: cluster.cluster_id}) == []
    assert len(result["stopped"]) == 2 and not os.path.exists(cluster.state_dir)


def test_roles_start_through_ssm_with_each_instance_address(moto, ec2, tmp_path):
    cluster = provision(_spec(moto, "mxnet_training--run-b"), home=str(tmp_path))
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto)
    try:
        launch = JobLaunch(job_uri="s3://mxpipe/runs/x/job.json", num_workers=2, num_servers=1,
                           env={"AWS_SECRET_ACCESS_KEY": "must-not-travel", "MXPIPE_FAULT_KILL_STEP": "3"},
                           status_uri="s3://mxpipe/runs/x/job_status.json")
        handles = cluster.start_roles(launch)
        by_role = {h.name: h for h in handles}
        assert set(by_role) == {"scheduler", "server-0", "worker-0", "worker-1"}
        root = cluster.addresses[0]
        for h in handles:
            cmd = next(c for c in ssm.list_commands()["Commands"] if c["CommandId"] == h.command_id)
            # (moto lists every instance under a command's InstanceIds; the invocation is per instance)
            assert cmd["DocumentName"] == "AWS-RunShellScript"
            assert ssm.get_command_invocation(CommandId=h.command_id, InstanceId=h.instance_id)["Status"]
            script = "\n".join(cmd["Parameters"]["commands"])
            env = json.loads(script.split("<<'MXPIPE_ENV'\n", 1)[1].split("\nMXPIPE_ENV", 1)[0])[h.name]
            assert env["DMLC_NODE_HOST"] == h.host == cluster.addresses[cluster.instance_ids.index(h.instance_id)]
            assert env["DMLC_PS_ROOT_URI"] == root and env["DMLC_PS_ROOT_PORT"] == "9091"
            assert env["DMLC_ROLE"] == h.kind and env["DMLC_NUM_WORKER"] == "2"
            assert "AWS_SECRET_ACCESS_KEY" not in env and env["MXPIPE_FAULT_KILL_STEP"] == "3"
            assert SPOT_WATCH_ENV not in env and SPOT_NOTICE_ENV not in env  # on-demand: no notice to watch
            # Apart from its supervisor: it watches the job's status record for this process.
            assert env[SUPERVISOR_ENV] == f"record s3://mxpipe/runs/x/job_status.json {ProcessIdentity.of().to_text()}"
            assert "exec-role" in script and "must-not-travel" not in script
        # The workers are spread over both instances.
        assert {by_role["worker-0"].instance_id, by_role["worker-1"].instance_id} == set(cluster.instance_ids)
        assert [h.poll() for h in handles] == [0, 0, 0, 0]  # moto: every command "Success"
        before = len(ssm.list_commands()["Commands"])
        cluster.stop_roles(handles)
        stop = ssm.list_commands()["Commands"][before:]
        assert any("kill-records" in " ".join(c["Parameters"]["commands"]) for c in stop)
    finally:
        cluster.teardown()


def _role_envs(ssm, handles):
    """Each role's environment, as its SSM command writes it (role name → env)."""
    commands = {c["CommandId"]: c for c in ssm.list_commands()["Commands"]}
    envs = {}
    for h in handles:
        script = "\n".join(commands[h.command_id]["Parameters"]["commands"])
        envs[h.name] = json.loads(script.split("<<'MXPIPE_ENV'\n", 1)[1].split("\nMXPIPE_ENV", 1)[0])[h.name]
    return envs


def _stand_in_supervisor(python: str, job_uri: str, job_id: str, attempt: int) -> list[str]:
    """What the backend starts detached in the supervisor's place: a process that lives until it
    is stopped (the start and stop under test are the backend's, not the supervisor's)."""
    return [python, "-c", "import time; time.sleep(300)"]


def _cold_python(tmp_path) -> str:
    """This interpreter, except that ``exec-role`` (which records the supervisor) starts 2 s
    late, as on a fresh instance's cold disk: the stop then certainly comes before the record
    unless the start waits for it, rather than depending on which of two interpreters is quicker."""
    path = tmp_path / "python"
    path.write_text(f'#!/bin/sh\ncase " $* " in *" exec-role "*) sleep 2;; esac\nexec {shlex.quote(sys.executable)} "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def agent(tmp_path):
    agent = LocalSsmAgent(str(tmp_path / "ssm"))
    yield agent
    agent.close()


def test_a_stop_right_after_the_supervisors_start_finds_and_stops_it(moto, ec2, tmp_path, monkeypatch, agent,
                                                                     nothing_left):
    """moto stands in for the EC2 and SSM APIs (nothing runs on EC2 here) and ``LocalSsmAgent``
    for the rank-0 instance's SSM agent: the supervisor's start and the stop run on this machine,
    its state folder under tmp_path. The start returns once the supervisor has recorded itself,
    so a stop right after it (``on_kill``, a release on another worker) finds and stops it;
    before, the start returned at ``send_command``, the stop found no record, said it had stopped
    the supervisor, and left it running."""
    monkeypatch.setattr(ec2_cluster, "supervise_argv", _stand_in_supervisor)
    spec = _spec(moto, "mxnet_training--supervise", workers=1, servers=1, python=_cold_python(tmp_path),
                 workdir=REPO, state_dir=str(tmp_path / "state"))
    cluster = provision(spec, home=str(tmp_path))
    agent.attach(cluster.ssm)
    procs = posixpath.join(cluster.jobs_dir, "procs")
    nothing_left.records(procs)
    try:
        t0 = time.monotonic()
        where = cluster.start_supervisor("s3://mxpipe/runs/x/job.json", job_id="1-x", attempt=1, env={"X": "1"})
        started_s = time.monotonic() - t0
        assert where["host"] == cluster.addresses[0]
        assert [r.name for r in live_records([procs])] == ["1-x"]  # recorded before the start returned
        # The stop from another process: the cluster as its description attaches it.
        elsewhere = attach(cluster.describe())
        agent.attach(elsewhere.ssm)
        assert elsewhere.stop_job(grace_s=5.0) == ["1-x"]
        assert live_records([procs]) == []
        assert 2.0 <= started_s < 30, started_s  # the cold start, waited for; far from the bound
    finally:
        cluster.teardown()


def test_a_supervisor_that_never_records_itself_fails_its_start_naming_the_instance(
        moto, ec2, tmp_path, monkeypatch, agent):
    """No interpreter where the options say (a bad AMI, a wrong ``python``): the start fails
    after its bound with the instance and the end of the supervisor's log, instead of returning
    as if a supervisor ran."""
    monkeypatch.setattr(ec2_cluster, "SUPERVISOR_RECORD_TIMEOUT_S", 1.0)
    spec = _spec(moto, "mxnet_training--no-supervisor", workers=1, servers=1, python=str(tmp_path / "no-python"),
                 workdir=REPO, state_dir=str(tmp_path / "state"))
    cluster = provision(spec, home=str(tmp_path))
    agent.attach(cluster.ssm)
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as failed:
            cluster.start_supervisor("s3://mxpipe/runs/x/job.json", job_id="1-y", attempt=1, env={})
        assert time.monotonic() - t0 < 20
        message = str(failed.value)
        assert f"did not start on instance {cluster.instance_ids[0]} ({cluster.addresses[0]})" in message
        assert "ended Failed (exit code 1)" in message and "did not record itself" in message
        assert "no-python" in message  # nohup's complaint, from the supervisor's log
    finally:
        cluster.teardown()


def test_a_spot_notice_releases_its_instance_with_or_without_a_replacement(moto, ec2, tmp_path):
    """moto stands in for the EC2 API (and SSM's): what a supervisor does after a spot notice,
    once it stopped the roles. The reclaimed instance is tagged and terminated; with a replacement
    the cluster keeps its shape and its order (the first instance runs the supervisor), without
    one it goes on smaller and refuses a launch of the old size."""
    spec = _spec(moto, "mxnet_training--spot", workers=3, servers=2, spot=True)
    cluster = provision(spec, home=str(tmp_path))
    ssm = boto3.client("ssm", region_name=REGION, endpoint_url=moto)
    try:
        first, second, third = cluster.instance_ids
        launch = JobLaunch(job_uri="s3://mxpipe/runs/x/job.json", num_workers=3, num_servers=2)
        envs = _role_envs(ssm, cluster.start_roles(launch))
        assert len(envs) == 6 and all(env[SPOT_WATCH_ENV] == "1" for env in envs.values())
        # SSM gives a running role's output to nobody: the notices are recorded beside the job.
        folder = "s3://mxpipe/runs/x/spot_notices"
        assert all(env[SPOT_NOTICE_ENV] == folder for env in envs.values())
        assert cluster.spot_notice_folder(launch.job_uri) == folder

        # Replaced: the survivors keep their places, a new instance comes last.
        assert cluster.release_interrupted(cluster.addresses[1], replace=True) is True
        assert cluster.instance_ids[:2] == [first, third] and cluster.instance_ids[2] not in (first, second, third)
        assert (cluster.spec.workers, cluster.spec.servers) == (3, 2) and len(cluster.addresses) == 3
        gone = ec2.describe_instances(InstanceIds=[second])["Reservations"][0]["Instances"][0]
        assert gone["State"]["Name"] in ("shutting-down", "terminated") and TAG_RECLAIMED in {
            t["Key"] for t in gone["Tags"]}
        live = _live(ec2, **{TAG_CLUSTER: cluster.cluster_id})
        assert sorted(i["InstanceId"] for i in live) == sorted(cluster.instance_ids)
        # Every role of the instance writes the event: a second release of it is nothing.
        assert cluster.release_interrupted(second, replace=True) is True
        assert len(_live(ec2, **{TAG_CLUSTER: cluster.cluster_id})) == 3

        # Not replaced (by its instance id, as the event names it): one worker fewer.
        dropped = cluster.instance_ids[1]
        assert cluster.release_interrupted(dropped, replace=False) is False
        assert cluster.instance_ids == [first, cluster.instance_ids[1]] and dropped not in cluster.instance_ids
        assert (cluster.spec.workers, cluster.spec.servers) == (2, 2)
        assert sorted(i["InstanceId"] for i in _live(ec2, **{TAG_CLUSTER: cluster.cluster_id})) == sorted(
            cluster.instance_ids)
        with pytest.raises(ProvisionError, match="holds 2 worker.* asks for 3"):
            cluster.start_roles(launch)
        smaller = cluster.start_roles(JobLaunch(job_uri=launch.job_uri, num_workers=2, num_servers=2))
        assert {h.instance_id for h in smaller if h.kind == "worker"} == set(cluster.instance_ids)
        assert all(env["DMLC_NUM_WORKER"] == "2" for env in _role_envs(ssm, smaller).values())
        # What another process attaches to (the cluster record) is the smaller cluster.
        record = json.loads((tmp_path / "clusters" / f"{cluster.cluster_id}.json").read_text())
        assert attach(record["description"]).instance_ids == cluster.instance_ids
        assert record["description"]["spec"]["workers"] == 2

        # The supervisor's own instance: tagged, left running (the supervisor is on it), refused.
        with pytest.raises(SupervisorHostLost, match=first):
            cluster.release_interrupted(first, replace=True)
        tags = {t["Key"] for i in _live(ec2, **{TAG_CLUSTER: cluster.cluster_id}) if i["InstanceId"] == first
                for t in i["Tags"]}
        assert TAG_RECLAIMED in tags
        # The job's retry provisions again: the tagged instance is terminated and replaced.
        retry = provision(spec, home=str(tmp_path))
        assert first not in retry.instance_ids and len(retry.instance_ids) == 3
        assert first not in {i["InstanceId"] for i in _live(ec2, **{TAG_CLUSTER: cluster.cluster_id})}
    finally:
        cluster.teardown()


def test_a_replacement_keeps_the_survivors_in_the_order_the_cluster_had_them(moto, ec2, tmp_path):
    """Whatever order DescribeInstances lists them in (launch order on moto; none promised on
    EC2): the cluster here holds them the other way round, as a cluster may after replacements."""
    from infra.ec2_cluster import Ec2Cluster

    spec = _spec(moto, "mxnet_training--spot-order", workers=3, servers=1, spot=True)
    launched = provision(spec, home=str(tmp_path))
    try:
        ids, addresses = launched.instance_ids[::-1], launched.addresses[::-1]
        cluster = Ec2Cluster(launched.cluster_id, spec, str(tmp_path), instance_ids=ids, addresses=addresses)
        assert cluster.release_interrupted(ids[1], replace=True) is True
        assert cluster.instance_ids[:2] == [ids[0], ids[2]] and cluster.instance_ids[2] not in ids
    finally:
        launched.teardown()


def test_a_replacement_that_cannot_be_launched_leaves_the_cluster_smaller(moto, ec2, tmp_path):
    """No spot capacity, a bad template: whatever makes the launch fail, the survivors go on."""
    spec = _spec(moto, "mxnet_training--spot-none", workers=2, servers=1, spot=True)
    cluster = provision(spec, home=str(tmp_path))
    try:
        survivor, lost = cluster.instance_ids
        cluster.opts = cluster.opts.model_copy(update={"launch_template": "no-such-template"})
        assert cluster.release_interrupted(lost, replace=True) is False
        assert cluster.instance_ids == [survivor] and (cluster.spec.workers, cluster.spec.servers) == (1, 1)
        assert [i["InstanceId"] for i in _live(ec2, **{TAG_CLUSTER: cluster.cluster_id})] == [survivor]
        assert cluster.release_interrupted(lost, replace=True) is False  # the same answer again
    finally:
        cluster.teardown()


def test_missing_launch_template_fails_provision_and_leaves_nothing(moto, ec2, tmp_path):
    with pytest.raises(ProvisionError, match="ec2 provision"):
        provision(_spec(moto, "mxnet_training--run-c", launch_template="no-such-template"), home=str(tmp_path))
    assert _live(ec2, **{TAG_CLUSTER: "mxnet_training--run-c"}) == []
    assert not os.path.exists(tmp_path / "clusters" / "mxnet_training--run-c.json")


def test_reaper_terminates_only_what_outlived_its_ttl(moto, ec2, tmp_path):
    opts = Ec2Options(launch_template="mxpipe-trainer-gpu", endpoint_url=moto, region=REGION)
    short = provision(_spec(moto, "mxnet_training--run-d", workers=1, ttl_s=1), home=str(tmp_path))
    long = provision(_spec(moto, "mxnet_training--run-e", workers=1), home=str(tmp_path))
    try:
        later = time.time() + 5
        assert set(short.instance_ids) <= set(find_expired(opts, now=later))
        assert not set(long.instance_ids) & set(find_expired(opts, now=later))
        # The local record of the expired cluster is found too; reaping it tears it down.
        assert [leak.cluster_id for leak in find_leaked(home=str(tmp_path), now=later)] == [short.cluster_id]
        assert reap(home=str(tmp_path), now=later) == [short.cluster_id]
        assert _live(ec2, **{TAG_CLUSTER: short.cluster_id}) == []
        # Tags alone are enough: with the record gone, the tag reaper still finds the instance.
        assert reap_expired(opts, now=time.time() + 7200) == long.instance_ids
        assert _live(ec2, **{TAG_CLUSTER: long.cluster_id}) == []
    finally:
        long.teardown()
        short.teardown()


def test_waits_fail_with_a_clear_error_on_timeout_and_on_a_final_state(moto, ec2):
    """The waits are boto3's waiters: nothing in moto ever makes one time out or end on its own,
    so the waits are run here on purpose against the wrong state."""
    inst = ec2.run_instances(LaunchTemplate={"LaunchTemplateName": "mxpipe-trainer-gpu"}, MinCount=1,
                             MaxCount=1)["Instances"][0]["InstanceId"]
    try:
        start = time.monotonic()
        with pytest.raises(ProvisionError, match="timed out after 1s waiting for instances terminated"):
            _wait(ec2, "instances terminated", ["instance_terminated"], [inst], 1.0, 0.2)
        assert time.monotonic() - start < 10
    finally:
        ec2.terminate_instances(InstanceIds=[inst])
    with pytest.raises(ProvisionError, match=rf"gave up waiting for instances running: instance states "
                                             rf"\{{'{inst}': '(terminated|shutting-down)'\}} \(spot capacity"):
        _wait(ec2, "instances running", ["instance_running"], [inst], 30.0, 0.1, hint=" (spot capacity or a bad AMI?)")


def test_ec2_options_refuse_a_wait_that_cannot_poll():
    with pytest.raises(ValueError, match="ec2 option poll_s must be a number of seconds > 0, got 0"):
        Ec2Options.from_dict({"launch_template": "mxpipe-trainer-gpu", "poll_s": 0})
