"""The ``ec2`` backend: GPU (or CPU) instances launched through boto3, roles through SSM.

Provisioning (idempotent: a retry of the task finds and reuses the run's healthy instances):

1. find the run's instances by tag (``mxpipe:cluster``); terminate any that are impaired, or
   that a spot notice marked as reclaimed (``mxpipe:reclaimed``, ``release_interrupted``);
2. launch what is missing from the launch template (AMI, instance profile, security group,
   user data that installs the trainer image live there: ``infra/cloudformation``), on-demand
   or spot, into the stack's ``cluster`` placement group (one rack: the low-latency network
   ps-lite wants), every instance and volume tagged with the run id and ``mxpipe:expires-at`` (TTL);
   ``ClientToken`` makes the launch call itself idempotent;
3. wait, bounded, for ``running`` and then for both status checks ``ok`` (boto3's waiters).

The instances keep their order across provisions (the survivors first, in the order they had,
then the new ones): the first one runs the scheduler and the detached supervisor.

On spot instances (``spot``) every role watches its instance's interruption notice
(``MXPIPE_SPOT_WATCH`` in its environment; ``common.procs.spot``). After a notice the supervisor
calls ``release_interrupted``: the instance is tagged ``mxpipe:reclaimed`` and terminated (AWS
takes it within two minutes anyway; a stopped or hibernated one would otherwise linger), then
either a provision launches its replacement, or the cluster goes on with one instance fewer and
a ``spec`` shrunk to match (``start_roles`` refuses a launch larger than it), which is also
what happens when the replacement cannot be launched (no spot capacity). The supervisor's
own instance (the first) is only tagged: ``SupervisorHostLost``, and the job's retry provisions
a replacement. These calls come from the supervisor, on the first instance: its instance profile
must allow ``ec2:DescribeInstances``, ``ec2:DescribeInstanceStatus``, ``ec2:CreateTags`` and
``ec2:TerminateInstances`` on the cluster's instances and, for a replacement, ``ec2:RunInstances``
with ``iam:PassRole`` of the instance role (``infra/cloudformation`` grants none of them yet).

Roles are started through SSM Run Command (``AWS-RunShellScript``), one command per role,
with the same ``python -m common.procs exec-role`` line as the hosts backend, so a role leads a
process group of its own on its instance and ``kill-records`` stops it. No AWS keys are
forwarded: instances get S3 access from their instance profile (scoped to the run's prefix).
A role's status and exit code come from ``get_command_invocation`` (polled, cached for
``status_poll_s``); its output arrives through the same call (in the real cloud also in
CloudWatch Logs, configured on the command), so stall detection on EC2 has the granularity of
that poll. The scheduler's port comes from the options (``scheduler_port``): the instances are
the cluster's own and the security group admits ps-lite traffic only from its members.

The detached supervisor runs on the rank-0 instance (``start_supervisor``): one SSM command
writes its environment to a 0600 file and starts ``setsid nohup python -m common.procs exec-role
… -- python -m training supervise …`` in the background under ``<state_dir>/jobs/<cluster>/``,
then ends once the supervisor has recorded itself there (the hosts backend's start too:
``infra.cluster.detached_supervisor_command``); the supervisor outlives it.
``start_supervisor`` returns only when that command has ended well (polled, bounded): a stop
right after the start finds the supervisor by that record; a supervisor that never records
itself raises an error naming the instance, with its log's last lines. The instance profile must
allow the supervisor's own SSM calls (``ssm:SendCommand``, ``ssm:GetCommandInvocation``,
``ssm:CancelCommand`` on the cluster's instances). ``stop_job`` sends ``kill-records`` for that
folder (SIGTERM, then SIGKILL after the grace), waits, bounded, for the command to end and
returns what it stopped. moto runs no command: the scripts are unit-tested as text
(``supervisor_script``), and run on this machine by a stand-in for the instance's SSM agent in
``tests/integration/test_ec2_cluster.py``.

Teardown terminates every instance tagged with the cluster and waits, bounded (boto3's
``instance_terminated`` waiter), until they are gone; ``reap_expired`` terminates any instance
whose ``mxpipe:expires-at`` has passed.
Tested against a moto server (``tests/integration/test_ec2_cluster.py``); the real cloud path
is the same calls with ``endpoint_url`` empty and credentials from the usual AWS chain.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import posixpath
import shlex
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from dataclasses import replace as replace_field  # where "replace" is release_interrupted's argument
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from common.config import Number
from common.roles import JobLaunch, Role, role_argv, role_env
from common.procs.identity import ProcessIdentity
from common.procs.spot import SPOT_NOTICE_ENV, SPOT_WATCH_ENV, notice_folder
from common.procs.watchdog import supervised_by_record
from infra.cluster import (STOP_JOB_GRACE_S, SUPERVISOR_RECORD_TIMEOUT_S, Cluster, ClusterSpec, ProvisionError,
                           SupervisorHostLost, cluster_id_for, detached_supervisor_command, supervise_argv)
from infra.strict_settings import StrictSettings

log = logging.getLogger(__name__)

TAG_CLUSTER, TAG_RUN, TAG_EXPIRES, TAG_MANAGED = "mxpipe:cluster", "mxpipe:run", "mxpipe:expires-at", "mxpipe:managed"
# The time (epoch seconds) a spot notice said the instance goes: no provision reuses it.
TAG_RECLAIMED = "mxpipe:reclaimed"
LIVE_STATES = ["pending", "running"]
# How long SSM may take to deliver a command to an instance (send_command's TimeoutSeconds) and
# a margin for the SSM calls around it; what a command then runs has bounds of its own.
SSM_DELIVERY_TIMEOUT_S = 60
SSM_MARGIN_S = 60.0


def _ssm_bound_s(run_s: float) -> float:
    """How long to wait for an SSM command that runs at most ``run_s`` to have ended."""
    return SSM_DELIVERY_TIMEOUT_S + run_s + SSM_MARGIN_S
NOT_TERMINATED = ["pending", "running", "stopping", "stopped", "shutting-down"]


class Ec2Options(StrictSettings):
    """Where and how to launch (``spec.options`` of an ``ec2`` ClusterSpec): the ``mxpipe_ec2``
    Airflow Variable or the ``MXPIPE_EC2_FILE`` file."""

    launch_template: str = ""  # required: refused when empty (_launch_template)
    region: str = "us-east-1"
    endpoint_url: str = ""  # empty: AWS itself; tests point it at a moto server
    launch_template_version: str = "$Latest"
    instance_type: str = ""  # overrides the template's (ClusterSpec.instance_type wins)
    # What the ClusterSpec takes from these settings (infra.cluster_settings): the GPUs of an
    # instance its workers use, and the trainer image the user data pulls.
    devices_per_worker: int = Field(0, ge=0)
    image: str = ""
    subnet_id: str = ""
    spot: bool = False
    # A ``cluster`` placement group (one rack: the low-latency network ps-lite wants), made
    # once by the CloudFormation stack and shared by runs; empty: no placement constraint.
    placement_group: str = ""
    python: str = "/opt/mxpipe/.venv/bin/python"
    workdir: str = "/opt/mxpipe"
    state_dir: str = "/var/run/mxpipe-roles"
    interface: str = "ens5"
    scheduler_port: int = Field(9091, ge=1, le=65535)
    running_timeout_s: Number = 600.0
    status_timeout_s: Number = 900.0
    terminate_timeout_s: Number = 600.0
    poll_s: Number = 5.0
    status_poll_s: Number = 2.0

    @field_validator("running_timeout_s", "status_timeout_s", "terminate_timeout_s", "poll_s", "status_poll_s")
    @classmethod
    def _seconds(cls, value: float, info: ValidationInfo) -> float:
        if not value > 0:
            raise ValueError(f"ec2 option {info.field_name} must be a number of seconds > 0, got {value!r}")
        return value

    @model_validator(mode="after")
    def _launch_template(self) -> Ec2Options:
        if not self.launch_template:
            raise ValueError("the ec2 backend needs launch_template (see infra/cloudformation)")
        return self


def _clients(opts: Ec2Options) -> tuple[Any, Any]:
    import boto3
    from botocore.config import Config

    cfg = Config(connect_timeout=10, read_timeout=60, retries={"max_attempts": 5, "mode": "standard"})
    kw: dict[str, Any] = {"region_name": opts.region, "config": cfg}
    if opts.endpoint_url:
        kw["endpoint_url"] = opts.endpoint_url
    return boto3.client("ec2", **kw), boto3.client("ssm", **kw)


def _wait(ec2: Any, what: str, waiters: Sequence[str], ids: list[str], timeout_s: float, poll_s: float, *,
          hint: str = "", **params: Any) -> None:
    """Run boto3's EC2 ``waiters`` on ``ids`` one after the other within one ``timeout_s`` budget:
    each polls every ``poll_s`` for as many attempts as the budget has left. A timeout, a state
    the waiter treats as final (terminated while awaiting running, say) or an API error raises
    ProvisionError naming ``what`` (and the instances' states)."""
    from botocore.exceptions import WaiterError

    deadline = time.monotonic() + timeout_s
    for name in waiters:
        attempts = int(max(0.0, deadline - time.monotonic()) // poll_s) + 1
        try:
            ec2.get_waiter(name).wait(InstanceIds=ids, WaiterConfig={"Delay": poll_s, "MaxAttempts": attempts},
                                      **params)
        except WaiterError as exc:
            reason = str(exc.kwargs.get("reason", ""))
            if reason.startswith("Max attempts exceeded"):
                raise ProvisionError(f"timed out after {timeout_s:.0f}s waiting for {what}") from None
            if reason.startswith("Waiter encountered a terminal failure state"):
                raise ProvisionError(f"gave up waiting for {what}: instance states "
                                     f"{_states(exc.last_response)}{hint}") from None
            raise ProvisionError(f"waiting for {what} failed: {reason}") from None


def _states(response: dict[str, Any]) -> dict[str, str]:
    """{instance id: state} of a DescribeInstances response."""
    return {i["InstanceId"]: i["State"]["Name"] for r in response.get("Reservations", []) for i in r["Instances"]}


def _instances(ec2: Any, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for page in ec2.get_paginator("describe_instances").paginate(Filters=filters):
        for res in page["Reservations"]:
            out.extend(res["Instances"])
    return out


def _tags(inst: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}


class Ec2Cluster(Cluster):
    backend = "ec2"

    def __init__(self, cluster_id: str, spec: ClusterSpec, home: str | None = None, records: str | None = None,
                 instance_ids: Sequence[str] = (), addresses: Sequence[str] = ()) -> None:
        super().__init__(cluster_id, spec, home, records)
        self.opts = Ec2Options.from_dict(spec.options)
        self.instance_ids = list(instance_ids)
        self.addresses = list(addresses)
        # (instance id, address, replaced) of each instance given up after a spot notice
        self.released: list[tuple[str, str, bool]] = []
        self._ec2: Any = None
        self._ssm: Any = None

    @property
    def ec2(self) -> Any:
        if self._ec2 is None:
            self._ec2, self._ssm = _clients(self.opts)
        return self._ec2

    @property
    def ssm(self) -> Any:
        self.ec2  # noqa: B018 - creates both clients
        return self._ssm

    def extra_description(self) -> dict[str, Any]:
        return {"instance_ids": self.instance_ids, "addresses": self.addresses}

    @classmethod
    def from_description(cls, desc: dict[str, Any]) -> "Ec2Cluster":
        return cls(desc["cluster_id"], ClusterSpec.from_dict(desc["spec"]), desc.get("home"), desc.get("records"),
                   desc.get("instance_ids", ()), desc.get("addresses", ()))

    # -- provision --------------------------------------------------------------------------

    @property
    def instance_count(self) -> int:
        """One worker (and at most one server) per instance, as MXNet's launcher places them."""
        return max(self.spec.workers, self.spec.servers)

    def cost(self) -> dict[str, float]:
        """Instance-hours and their price so far (``infra.billing``): what a live run adds to the
        role core-seconds (the supervisor calls it through the observer's ``cost_extras``)."""
        from infra.billing import cluster_cost

        return cluster_cost(self)

    def live_instances(self) -> list[dict[str, Any]]:
        """The cluster's instances not terminated yet, as DescribeInstances returns them."""
        return self._own(NOT_TERMINATED)

    def _own(self, states: list[str]) -> list[dict[str, Any]]:
        return _instances(self.ec2, [{"Name": f"tag:{TAG_CLUSTER}", "Values": [self.cluster_id]},
                                     {"Name": "instance-state-name", "Values": states}])

    @classmethod
    def provision(cls, spec: ClusterSpec, home: str | None = None, *, records: str | None = None) -> "Ec2Cluster":
        cluster = cls(cluster_id_for(spec.run_tag), spec, home, records)
        try:
            cluster._provision()
        except ProvisionError:
            raise
        except Exception as exc:  # botocore ClientError and friends, with the API's message
            raise ProvisionError(f"ec2 provision of {cluster.cluster_id} failed: {exc}") from exc
        return cluster

    def _provision(self) -> None:
        live = self._own(LIVE_STATES)
        reclaimed = [i["InstanceId"] for i in live if TAG_RECLAIMED in _tags(i)]
        if reclaimed:
            log.warning("terminating reclaimed spot instances of %s: %s", self.cluster_id, reclaimed)
            self.ec2.terminate_instances(InstanceIds=reclaimed)
        impaired = self._impaired([i["InstanceId"] for i in live if i["InstanceId"] not in reclaimed])
        if impaired:
            log.warning("terminating impaired instances of %s: %s", self.cluster_id, impaired)
            self.ec2.terminate_instances(InstanceIds=impaired)
        # The order they had (the first runs the scheduler and the supervisor), then any others.
        known = {instance: n for n, instance in enumerate(self.instance_ids)}
        healthy = sorted((i["InstanceId"] for i in live if i["InstanceId"] not in reclaimed + impaired),
                         key=lambda instance: known.get(instance, len(known)))
        need = self.instance_count - len(healthy)
        if healthy:
            log.info("reusing %d healthy instance(s) of %s: %s", len(healthy), self.cluster_id, healthy)
        if need > 0:
            healthy += self._launch(need, healthy)
        ids = healthy[: self.instance_count]
        _wait(self.ec2, "instances running", ["instance_running"], ids, self.opts.running_timeout_s,
              self.opts.poll_s, hint=" (spot capacity or a bad AMI?)")
        # The instance's and the system's check, one budget for both; IncludeAllInstances lists
        # every id, so neither waiter can succeed on a partial answer.
        _wait(self.ec2, "status checks ok", ["instance_status_ok", "system_status_ok"], ids,
              self.opts.status_timeout_s, self.opts.poll_s, IncludeAllInstances=True)
        by_id = {i["InstanceId"]: i for i in self._own(["running"])}
        self.instance_ids = ids
        self.addresses = [by_id[i]["PrivateIpAddress"] for i in ids]
        self.write_record()
        log.info("ec2 cluster %s ready: %s", self.cluster_id, dict(zip(ids, self.addresses)))

    def _launch(self, count: int, keep: list[str]) -> list[str]:
        expires = int(time.time() + self.spec.ttl_s)
        tags = [{"Key": TAG_CLUSTER, "Value": self.cluster_id}, {"Key": TAG_RUN, "Value": self.spec.run_tag[:255]},
                {"Key": TAG_EXPIRES, "Value": str(expires)}, {"Key": TAG_MANAGED, "Value": "true"},
                {"Key": "Name", "Value": f"mxpipe-{self.cluster_id}"[:255]}]
        kwargs: dict[str, Any] = {
            "MinCount": count, "MaxCount": count,
            "LaunchTemplate": {"LaunchTemplateName": self.opts.launch_template,
                               "Version": self.opts.launch_template_version},
            "TagSpecifications": [{"ResourceType": r, "Tags": tags} for r in ("instance", "volume")],
            # Same run + same survivors → same token: a retried call cannot launch twice.
            "ClientToken": hashlib.sha256(f"{self.cluster_id}|{count}|{sorted(keep)}".encode()).hexdigest()[:64],
        }
        instance_type = self.spec.instance_type or self.opts.instance_type
        if instance_type:
            kwargs["InstanceType"] = instance_type
        if self.opts.subnet_id:
            kwargs["SubnetId"] = self.opts.subnet_id
        if self.opts.placement_group:
            kwargs["Placement"] = {"GroupName": self.opts.placement_group}
        if self.opts.spot:
            kwargs["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        ids = [i["InstanceId"] for i in self.ec2.run_instances(**kwargs)["Instances"]]
        log.info("launched %d %s instance(s) for %s: %s", count, "spot" if self.opts.spot else "on-demand",
                 self.cluster_id, ids)
        return ids

    def _statuses(self, ids: list[str]) -> list[dict[str, Any]]:
        if not ids:
            return []
        return self.ec2.describe_instance_status(InstanceIds=ids, IncludeAllInstances=True)["InstanceStatuses"]

    def _impaired(self, ids: list[str]) -> list[str]:
        return [s["InstanceId"] for s in self._statuses(ids)
                if "impaired" in (s["InstanceStatus"]["Status"], s["SystemStatus"]["Status"])]

    # -- a spot notice -----------------------------------------------------------------------

    def spot_notice_folder(self, job_uri: str) -> str:
        # SSM gives a command's output only once it has ended: the supervisor polls the notices
        # its spot roles record (the roles set SPOT_NOTICE_ENV to the same folder).
        return notice_folder(job_uri) if self.opts.spot else ""

    def release_interrupted(self, host: str, *, replace: bool) -> bool:
        """See ``Cluster.release_interrupted``; the module docstring says what happens on EC2."""
        for instance, address, replaced in self.released:
            if host in (instance, address):  # another role's event of the same notice
                log.info("spot instance %s of %s is released already", instance, self.cluster_id)
                return replaced
        if host in self.instance_ids:
            index = self.instance_ids.index(host)
        elif host in self.addresses:
            index = self.addresses.index(host)
        else:
            raise ProvisionError(f"ec2 cluster {self.cluster_id} has no instance {host!r} "
                                 f"(it has {dict(zip(self.instance_ids, self.addresses))})")
        lost, address = self.instance_ids[index], self.addresses[index]
        try:
            self.ec2.create_tags(Resources=[lost], Tags=[{"Key": TAG_RECLAIMED, "Value": str(int(time.time()))}])
            if index == 0:
                raise SupervisorHostLost(f"spot instance {lost} ({address}) of {self.cluster_id} is being "
                                         "reclaimed and runs the job's supervisor: the job's retry replaces it")
            log.warning("releasing reclaimed spot instance %s (%s) of %s", lost, address, self.cluster_id)
            self.ec2.terminate_instances(InstanceIds=[lost])
        except ProvisionError:
            raise
        except Exception as exc:  # botocore ClientError and friends, with the API's message
            raise ProvisionError(f"ec2 release of {lost} from {self.cluster_id} failed: {exc}") from exc
        del self.instance_ids[index], self.addresses[index]
        replaced = replace and self._replace(lost)
        self.released.append((lost, address, replaced))
        if not replaced:
            # One instance fewer: the shape placement() spreads over it, one worker each.
            left = len(self.instance_ids)
            self.spec = replace_field(self.spec, workers=min(self.spec.workers, left),
                                      servers=min(self.spec.servers, left))
            self.write_record()
            log.warning("ec2 cluster %s goes on without a replacement: %d worker(s), %d server(s) on %s",
                        self.cluster_id, self.spec.workers, self.spec.servers, self.instance_ids)
        return replaced

    def _replace(self, lost: str) -> bool:
        """A provision of the cluster's shape (the survivors in their order, a new instance last);
        False when it failed (no spot capacity, say): the cluster is then its survivors."""
        try:
            self._provision()
        except Exception as exc:  # noqa: BLE001 - whatever failed, the survivors can go on
            log.warning("no replacement for spot instance %s of %s (%s): going on without it", lost,
                        self.cluster_id, exc)
            return False
        return True

    # -- roles ------------------------------------------------------------------------------

    def scheduler_address(self) -> tuple[str, int]:
        return self.addresses[0], self.opts.scheduler_port

    def placement(self, roles: Sequence[Role]) -> list[tuple[Role, int]]:
        servers = sum(1 for r in roles if r.kind == "server")
        n = len(self.instance_ids)
        return [(r, (0 if r.kind == "scheduler" else r.rank if r.kind == "server" else r.rank + servers) % n)
                for r in roles]

    def start_roles(self, launch: JobLaunch) -> list["SsmRole"]:
        # After release_interrupted without a replacement the spec is smaller than the config:
        # more roles than it holds would double up on an instance (placement wraps around).
        if launch.num_workers > self.spec.workers or launch.num_servers > self.spec.servers:
            raise ProvisionError(f"ec2 cluster {self.cluster_id} holds {self.spec.workers} worker(s) and "
                                 f"{self.spec.servers} server(s) on {len(self.instance_ids)} instance(s); the job "
                                 f"asks for {launch.num_workers} and {launch.num_servers}")
        root, port = self.scheduler_address()
        # Instance profile credentials, never the launching process's keys.
        launch_env = {k: v for k, v in launch.env.items() if not k.startswith("AWS_")}
        launch = replace(launch, env=launch_env)
        attempt = self.new_attempt()
        supervisor = ProcessIdentity.of()  # start_roles runs in the supervisor
        handles = []
        for role, index in self.placement(launch.roles()):
            address = self.addresses[index]
            env = role_env(launch, role.kind, node_host=address, root_uri=root, root_port=port,
                           base={"PATH": "/usr/local/bin:/usr/bin:/bin", "MXPIPE_CLUSTER": self.cluster_id},
                           repo_root=self.opts.workdir)
            env["DMLC_INTERFACE"] = self.opts.interface
            if launch.status_uri:  # a role on another instance: it watches its supervisor by the record
                env.update(supervised_by_record(launch.status_uri, supervisor))
            if self.opts.spot:  # the interruption notice is only on the instance: its roles watch it
                env[SPOT_WATCH_ENV] = "1"
                env[SPOT_NOTICE_ENV] = notice_folder(launch.job_uri)
            resp = self.ssm.send_command(
                InstanceIds=[self.instance_ids[index]], DocumentName="AWS-RunShellScript",
                Comment=f"mxpipe {self.cluster_id} {role.name}"[:100],
                TimeoutSeconds=600,
                Parameters={"commands": self.role_script(attempt, role, env, launch.job_uri),
                            "executionTimeout": ["172800"]})
            handles.append(SsmRole(role.name, role.kind, address, self.instance_ids[index],
                                   resp["Command"]["CommandId"], self.ssm, self.opts.status_poll_s))
        return handles

    def role_script(self, attempt: str, role: Role, env: dict[str, str], job_uri: str) -> list[str]:
        folder = posixpath.join(self.opts.state_dir, self.cluster_id, attempt)
        env_file = posixpath.join(folder, f"{role.name}.env")
        argv = [self.opts.python, "-m", "common.procs", "exec-role",
                "--record", posixpath.join(folder, "procs", f"{role.name}.json"),
                "--env-file", env_file, "--env-key", role.name, "--",
                *role_argv(role.kind, job_uri, self.opts.python)]
        return [f"umask 077 && mkdir -p {shlex.quote(folder)}",
                f"cat > {shlex.quote(env_file)} <<'MXPIPE_ENV'\n{json.dumps({role.name: env})}\nMXPIPE_ENV",
                f"cd {shlex.quote(self.opts.workdir)} && exec {shlex.join(argv)}"]

    def stop_roles(self, handles: Sequence[Any], *, grace_s: float = 5.0) -> int:
        if not self.instance_ids:
            return 0
        alive = [h for h in handles if h.poll() is None]
        folder = posixpath.join(self.opts.state_dir, self.cluster_id)
        self.ssm.send_command(InstanceIds=self.instance_ids, DocumentName="AWS-RunShellScript",
                              Comment=f"mxpipe {self.cluster_id} stop roles"[:100], TimeoutSeconds=60,
                              Parameters={"commands": [
                                  f"cd {shlex.quote(self.opts.workdir)} && {shlex.quote(self.opts.python)} -m "
                                  f"common.procs kill-records {shlex.quote(folder)} --grace-s {grace_s}"]})
        for h in alive:
            try:
                self.ssm.cancel_command(CommandId=h.command_id, InstanceIds=[h.instance_id])
            except Exception as exc:  # noqa: BLE001 - already finished is fine
                log.debug("cancel %s: %s", h.command_id, exc)
        for h in handles:
            h.closed = True
        return len(alive)

    # -- the detached supervisor --------------------------------------------------------------

    @property
    def jobs_dir(self) -> str:
        return posixpath.join(self.opts.state_dir, "jobs", self.cluster_id)

    def supervisor_script(self, job_uri: str, job_id: str, attempt: int, env: dict[str, str]) -> list[str]:
        """The SSM commands that start the supervisor detached on the rank-0 instance; the last
        ends once it has recorded itself (``infra.cluster.detached_supervisor_command``)."""
        env_file = posixpath.join(self.jobs_dir, "env")
        record = posixpath.join(self.jobs_dir, "procs", f"{job_id}.json")
        argv = [self.opts.python, "-m", "common.procs", "exec-role", "--record", record,
                "--env-file", env_file, "--env-key", job_id, "--",
                *supervise_argv(self.opts.python, job_uri, job_id, attempt)]
        return [f"umask 077 && mkdir -p {shlex.quote(self.jobs_dir)}",
                f"cat > {shlex.quote(env_file)} <<'MXPIPE_ENV'\n{json.dumps({job_id: env})}\nMXPIPE_ENV",
                detached_supervisor_command(self.opts.workdir, argv, record,
                                            posixpath.join(self.jobs_dir, f"{job_id}.log"),
                                            timeout_s=SUPERVISOR_RECORD_TIMEOUT_S)]

    def _on_rank_0(self, what: str, commands: list[str], *, run_s: float) -> SsmRole:
        """Run ``commands`` on the rank-0 instance through SSM and wait, bounded, until the
        command has ended (its delivery, then at most ``run_s``); the handle says how it ended
        (``returncode`` None: not within the bound)."""
        resp = self.ssm.send_command(
            InstanceIds=[self.instance_ids[0]], DocumentName="AWS-RunShellScript",
            Comment=f"mxpipe {self.cluster_id} {what}"[:100], TimeoutSeconds=SSM_DELIVERY_TIMEOUT_S,
            Parameters={"commands": commands, "executionTimeout": [str(math.ceil(run_s))]})
        command = SsmRole(what, "command", self.addresses[0], self.instance_ids[0], resp["Command"]["CommandId"],
                          self.ssm, self.opts.status_poll_s)
        deadline = time.monotonic() + _ssm_bound_s(run_s)
        while command.poll() is None and time.monotonic() < deadline:
            time.sleep(self.opts.status_poll_s)
        return command

    def start_supervisor(self, job_uri: str, *, job_id: str, attempt: int, env: dict[str, str]) -> dict[str, Any]:
        """Start it detached on the rank-0 instance and return once it has recorded itself there
        (bounded): SSM runs a command apart from the caller, so returning at ``send_command``
        let a stop right after it (``on_kill``, a release) find nothing and leave it running."""
        # Instance profile credentials, never the launching process's keys.
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "MXPIPE_CLUSTER": self.cluster_id,
                **{k: v for k, v in env.items() if not k.startswith("AWS_")}}
        instance, address = self.instance_ids[0], self.addresses[0]
        # The script's own bound is SUPERVISOR_RECORD_TIMEOUT_S; the rest is for a slow mkdir or cd.
        run_s = SUPERVISOR_RECORD_TIMEOUT_S + 30
        command = self._on_rank_0(f"supervise {job_id}", self.supervisor_script(job_uri, job_id, attempt, base),
                                  run_s=run_s)
        if command.returncode != 0:
            ended = (f"ended {command.status} (exit code {command.returncode})" if command.returncode is not None
                     else f"did not end within {_ssm_bound_s(run_s):.0f}s")
            raise RuntimeError(f"the supervisor of job {job_id} did not start on instance {instance} ({address}) of "
                               f"{self.cluster_id}: its SSM command {command.command_id} {ended}: "
                               f"{command.output.strip()[-1000:] or 'no output'}")
        log.info("started supervisor of job %s on %s", job_id, instance)
        return {"job_id": job_id, "host": address, "log": posixpath.join(self.jobs_dir, f"{job_id}.log")}

    def stop_job(self, *, grace_s: float = STOP_JOB_GRACE_S) -> list[str]:
        if not self.instance_ids:
            return []
        command = self._on_rank_0("stop job", [
            f"cd {shlex.quote(self.opts.workdir)} && {shlex.quote(self.opts.python)} -m common.procs kill-records "
            f"{shlex.quote(self.jobs_dir)} --grace-s {grace_s}"], run_s=grace_s + 60)
        self.stop_roles([], grace_s=5.0)
        # What kill-records stopped (its last line): [] when no supervisor was recorded.
        try:
            return list(json.loads(command.output.strip().splitlines()[-1])["stopped"])
        except (IndexError, ValueError, KeyError, TypeError):
            log.warning("stop of the job of %s: no answer from kill-records on %s (SSM command %s %s)",
                        self.cluster_id, self.instance_ids[0], command.command_id, command.status or "not ended")
            return []

    # -- teardown ---------------------------------------------------------------------------

    def teardown(self) -> dict[str, Any]:
        ids = [i["InstanceId"] for i in self._own(NOT_TERMINATED)]
        if ids and self.instance_ids:
            try:  # an orderly stop first: rank 0's emergency checkpoint before the instances go
                self.stop_job()
            except Exception as exc:  # noqa: BLE001 - terminating the instances stops everything anyway
                log.warning("could not stop the job of %s before terminating it: %s", self.cluster_id, exc)
        if ids:
            self.ec2.terminate_instances(InstanceIds=ids)
            _wait(self.ec2, "instances terminated", ["instance_terminated"], ids, self.opts.terminate_timeout_s,
                  self.opts.poll_s)
        self.remove_record()
        log.info("tore down ec2 cluster %s: terminated %s", self.cluster_id, ids)
        return {"stopped": ids}


@dataclass
class SsmRole:
    """One role started by SSM Run Command, seen through ``get_command_invocation``."""

    name: str
    kind: str
    host: str
    instance_id: str
    command_id: str
    ssm: Any = field(repr=False)
    status_poll_s: float = 2.0
    returncode: int | None = None
    status: str = ""  # the invocation's last Status ("InProgress", "Success", "Failed", ...)
    closed: bool = False  # set by stop_roles: the output reader stops polling
    _checked: float = 0.0
    _output: str = ""

    def _refresh(self) -> None:
        if self.returncode is not None or time.monotonic() - self._checked < self.status_poll_s:
            return
        self._checked = time.monotonic()
        try:
            inv = self.ssm.get_command_invocation(CommandId=self.command_id, InstanceId=self.instance_id)
        except Exception as exc:  # noqa: BLE001 - InvocationDoesNotExist right after send_command
            log.debug("invocation %s not visible yet: %s", self.command_id, exc)
            return
        self._output = inv.get("StandardOutputContent", "") + inv.get("StandardErrorContent", "")
        status = self.status = inv["Status"]
        if status == "Success":
            self.returncode = 0
        elif status in ("Failed", "TimedOut", "Cancelled", "Undeliverable", "Terminated"):
            code = int(inv.get("ResponseCode", -1))
            self.returncode = code if code > 0 else 1

    def poll(self) -> int | None:
        self._refresh()
        return self.returncode

    @property
    def output(self) -> str:
        """Its standard output and error as last read (SSM gives them once the command ended)."""
        return self._output

    @property
    def stdout(self) -> Iterator[str]:
        sent = 0
        while True:
            self._refresh()
            lines = self._output.splitlines()
            yield from lines[sent:]
            sent = len(lines)
            if self.returncode is not None or self.closed:
                return
            time.sleep(self.status_poll_s)


def find_expired(opts: Ec2Options, *, older_than_s: float = 0.0, now: float | None = None) -> list[str]:
    """Instances (any cluster) whose ``mxpipe:expires-at`` tag passed more than ``older_than_s`` ago."""
    ec2, _ = _clients(opts)
    now = time.time() if now is None else now
    expired = []
    for inst in _instances(ec2, [{"Name": "tag-key", "Values": [TAG_EXPIRES]},
                                 {"Name": "instance-state-name", "Values": NOT_TERMINATED}]):
        try:
            if float(_tags(inst)[TAG_EXPIRES]) + older_than_s < now:
                expired.append(inst["InstanceId"])
        except (KeyError, ValueError):
            expired.append(inst["InstanceId"])  # a mangled tag: treat as expired
    return expired


def reap_expired(opts: Ec2Options, *, older_than_s: float = 0.0, now: float | None = None) -> list[str]:
    """Terminate every expired instance; returns their ids."""
    ids = find_expired(opts, older_than_s=older_than_s, now=now)
    if ids:
        ec2, _ = _clients(opts)
        ec2.terminate_instances(InstanceIds=ids)
        log.warning("reaper terminated expired instances: %s", ids)
    return ids
