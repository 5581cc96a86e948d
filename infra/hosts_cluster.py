"""The ``hosts`` backend: a static list of machines, each reached through a transport.

``spec.options["hosts"]`` lists the hosts (``infra.transport.HostSpec`` fields: name, address,
transport ``ssh`` or ``netns``, the project's folder and interpreter there). Provisioning
checks each host (reachable, the interpreter runs the project, mxnet installed) and records
the cluster; nothing is created on a host until an attempt starts.

Placement: the scheduler on the first host, server *i* on host *i*, worker *i* on host *i + S*
(mod n): with as many hosts as workers and servers, one server and one worker per machine, as
MXNet's own launcher places them. Every role gets
``DMLC_NODE_HOST`` = its host's address and ``DMLC_PS_ROOT_URI`` = the first host's address, so
ps-lite binds and advertises addresses its peers can reach; the scheduler's port is asked of
the scheduler's host for each attempt (``python -m common.procs free-port``).

A role's environment is written once per host and attempt to a 0600 JSON file there (storage
credentials stay off command lines), and the role is started as
``python -m common.procs exec-role --record … --env-file … -- python -m training worker JOB``:
it leads its own process group on the host and records it, so stopping roles runs ``python -m
common.procs kill-records --names …`` for those roles on their hosts (the supervisor's orderly
stop signals rank 0 alone first), tearing the cluster down runs it for every recorded role on
every host, and no role survives its ssh client. So every stop goes through the transport to the
hosts themselves (``stop_job``: ``kill-records`` of the supervisor's record on the first host,
then of every role's), and works from any process that has the cluster's description and the
hosts' access: a release, ``on_kill`` or retry on another Airflow worker than the one that
started the job. A role's standard input is a pipe from its supervisor, through the
transport (the SSH session's channel): when the supervisor dies, the role reads end of file and
ends itself within seconds (``common.procs.watchdog``; rank 0 after its emergency checkpoint). The job document and shards must be readable from every host: an
``s3://`` URI every host can reach, or a folder every host mounts at the same path.

The detached supervisor runs on the first host (``start_supervisor``): started through the
transport as ``setsid nohup python -m common.procs exec-role … -- python -m training supervise
…`` under ``<state_dir>/jobs/<cluster>/`` (apart from the roles' records, which the
supervisor's own stops clear), its output in ``<job_id>.log`` there. From there it reaches every
host through the same transports, so the first host needs the others' SSH access, as the
Airflow worker has today.
"""
from __future__ import annotations

import json
import logging
import os
import posixpath
import shlex
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from common.procs import GroupSpawner, ProcessRole, kill_groups, kill_recorded
from common.procs.watchdog import supervised_by
from common.roles import JobLaunch, Role, role_argv, role_env
from infra.cluster import (STOP_JOB_GRACE_S, SUPERVISOR_RECORD_TIMEOUT_S, Cluster, ClusterSpec, ProvisionError,
                           cluster_id_for, detached_supervisor_command, supervise_argv)
from infra.transport import HostSpec, exit_status, host_argv, in_workdir, role_command, run_on

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 60.0
REMOTE_CMD_TIMEOUT_S = 60.0
# The environment a remote role starts from; the job adds what it forwards (common.roles).
REMOTE_BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
_CHECK = ("import sys, importlib.util, common.procs; "
          "assert importlib.util.find_spec('mxnet'), 'mxnet is not installed'; print(sys.version.split()[0])")


class RemoteRole(ProcessRole):
    """A role on a host, through its transport's local client: its exit status reads as the
    remote role's, a signal included (``infra.transport.exit_status``)."""

    def __init__(self, name: str, kind: str, host: HostSpec, proc: Any) -> None:
        super().__init__(name, kind, host.address, proc)
        self.spec = host

    @property
    def returncode(self) -> int | None:
        return exit_status(self.spec, self.proc.returncode)

    def poll(self) -> int | None:
        return exit_status(self.spec, self.proc.poll())


class HostsCluster(Cluster):
    backend = "hosts"

    def __init__(self, cluster_id: str, spec: ClusterSpec, home: str | None = None,
                 records: str | None = None) -> None:
        super().__init__(cluster_id, spec, home, records)
        raw_hosts = spec.options.get("hosts") or []
        if not raw_hosts:
            raise ProvisionError("the hosts backend needs options['hosts'] (a list of hosts)")
        self.hosts = [HostSpec.from_dict(h) if not isinstance(h, HostSpec) else h for h in raw_hosts]

    # -- provision --------------------------------------------------------------------------

    @classmethod
    def provision(cls, spec: ClusterSpec, home: str | None = None, *, records: str | None = None) -> "HostsCluster":
        cluster = cls(cluster_id_for(spec.run_tag), spec, home, records)
        if cluster.exists():
            log.info("cluster %s already provisioned; reusing it", cluster.cluster_id)
            return cluster
        with ThreadPoolExecutor(max_workers=len(cluster.hosts)) as pool:
            results = list(pool.map(cluster._check_host, cluster.hosts))
        bad = [r for r in results if r]
        if bad:
            raise ProvisionError("hosts not usable:\n" + "\n".join(bad))
        cluster.write_record()
        log.info("provisioned hosts cluster %s: %s", cluster.cluster_id,
                 ", ".join(f"{h.name}={h.address}" for h in cluster.hosts))
        return cluster

    def _check_host(self, host: HostSpec) -> str:
        """Empty if ``host`` can run roles, else why not (one line)."""
        try:
            out = run_on(host, in_workdir(host, host.python, "-c", _CHECK), timeout_s=CHECK_TIMEOUT_S)
        except (OSError, RuntimeError, TimeoutError) as exc:
            return f"{host.name} ({host.address}): {exc}"
        log.info("host %s (%s): python %s, project and mxnet present", host.name, host.address, out.stdout.strip())
        return ""

    def extra_description(self) -> dict[str, Any]:
        return {"hosts": [h.address for h in self.hosts]}

    # -- roles ------------------------------------------------------------------------------

    def placement(self, roles: Sequence[Role]) -> list[tuple[Role, HostSpec]]:
        """Scheduler on host 0, server i on host i, worker i on host i + S (all mod n).

        With as many hosts as workers and servers this is one server and one worker per host;
        with fewer servers the workers start on the hosts after them, spreading the load.
        """
        n = len(self.hosts)
        servers = sum(1 for r in roles if r.kind == "server")
        out = []
        for r in roles:
            index = 0 if r.kind == "scheduler" else r.rank if r.kind == "server" else r.rank + servers
            out.append((r, self.hosts[index % n]))
        return out

    def scheduler_address(self) -> tuple[str, int]:
        host = self.hosts[0]
        out = run_on(host, in_workdir(host, host.python, "-m", "common.procs", "free-port", host.address),
                     timeout_s=REMOTE_CMD_TIMEOUT_S)
        return host.address, int(out.stdout.strip().splitlines()[-1])

    def _remote_dir(self, host: HostSpec, *parts: str) -> str:
        # Per host as well as per cluster: hosts may share a filesystem (NFS homes, or the
        # namespaces of the tests), and each host must only ever see and stop its own roles.
        return posixpath.join(host.state_dir, self.cluster_id, host.name, *parts)

    def start_roles(self, launch: JobLaunch) -> list[ProcessRole]:
        root_host, port = self.scheduler_address()
        attempt = self.new_attempt()
        placed = self.placement(launch.roles())
        envs: dict[str, dict[str, dict[str, str]]] = {h.name: {} for h in self.hosts}
        for role, host in placed:
            # The role's input is this process's pipe, through the transport (an SSH session's
            # channel): its end is the supervisor's, and the role ends itself (common.procs.watchdog).
            base = {**REMOTE_BASE_ENV, "HOME": host.state_dir, "MXPIPE_CLUSTER": self.cluster_id,
                    **supervised_by(None)}
            knobs_env = role_env(launch, role.kind, node_host=host.address, root_uri=root_host, root_port=port,
                                 base=base, repo_root=host.workdir)
            if host.interface:
                knobs_env["DMLC_INTERFACE"] = host.interface
            envs[host.name][role.name] = knobs_env
        used = {h.name: h for _, h in placed}
        with ThreadPoolExecutor(max_workers=len(used)) as pool:
            list(pool.map(lambda h: self._write_env(h, attempt, envs[h.name]), used.values()))
        spawner = GroupSpawner(os.path.join(self.state_dir, "procs", attempt))
        handles: list[ProcessRole] = []
        try:
            for role, host in placed:
                proc = spawner.spawn(role.name, host_argv(host, self._role_command(host, attempt, role, launch)),
                                     {**os.environ, "MXPIPE_CLUSTER": self.cluster_id}, stdin=subprocess.PIPE)
                handles.append(RemoteRole(role.name, role.kind, host, proc))
        except BaseException:
            self.stop_roles(handles, grace_s=1.0)
            raise
        log.info("started %d roles of attempt %s on %d hosts (scheduler %s:%d)",
                 len(handles), attempt, len(used), root_host, port)
        return handles

    def _write_env(self, host: HostSpec, attempt: str, envs: dict[str, dict[str, str]]) -> None:
        folder = self._remote_dir(host, attempt)
        cmd = (f"umask 077 && mkdir -p {shlex.quote(folder)} && "
               f"cat > {shlex.quote(posixpath.join(folder, 'role-env'))}")
        run_on(host, cmd, timeout_s=REMOTE_CMD_TIMEOUT_S, input_text=json.dumps(envs))

    def _role_command(self, host: HostSpec, attempt: str, role: Role, launch: JobLaunch) -> str:
        folder = self._remote_dir(host, attempt)
        return role_command(host, host.python, "-m", "common.procs", "exec-role",
                          "--record", posixpath.join(folder, "procs", f"{role.name}.json"),
                          "--env-file", posixpath.join(folder, "role-env"), "--",
                          *role_argv(role.kind, launch.job_uri, host.python))

    def stop_roles(self, handles: Sequence[Any], *, grace_s: float = 5.0) -> int:
        """Stop the transport clients here, then those roles' recorded groups on their hosts.

        Only the roles of ``handles``: the supervisor's orderly stop signals rank 0 alone first
        (its emergency checkpoint needs its peers alive to finish the step), then the rest."""
        alive = kill_groups((h.proc.pid for h in handles), grace_s=grace_s)
        names: dict[str, list[str]] = {}
        for handle in handles:
            names.setdefault(handle.spec.name, []).append(handle.name)
        if names:
            self._kill_on_hosts(grace_s, names=names)
        return alive

    def _kill_on_hosts(self, grace_s: float, wait_s: float = 0.0,
                       names: dict[str, list[str]] | None = None) -> list[str]:
        """Stop the recorded role groups on the hosts: every one, or only ``names`` (host name →
        role names; hosts not in it are left alone)."""
        hosts = [h for h in self.hosts if names is None or h.name in names]

        def kill(host: HostSpec) -> list[str]:
            only = ["--names", ",".join(names[host.name])] if names is not None else []
            cmd = in_workdir(host, host.python, "-m", "common.procs", "kill-records",
                             self._remote_dir(host), "--grace-s", str(grace_s), "--wait-s", str(wait_s), *only)
            try:
                out = run_on(host, cmd, timeout_s=REMOTE_CMD_TIMEOUT_S + wait_s + grace_s)
                return list(json.loads(out.stdout.strip().splitlines()[-1])["stopped"])
            except (OSError, RuntimeError, TimeoutError, ValueError, KeyError, IndexError) as exc:
                log.error("could not stop roles on %s: %s", host.name, exc)
                return [f"{host.name}: unreachable"]

        if not hosts:
            return []
        with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
            return [name for stopped in pool.map(kill, hosts) for name in stopped]

    def _jobs_dir(self, host: HostSpec) -> str:
        return posixpath.join(host.state_dir, "jobs", self.cluster_id)

    def supervisor_command(self, job_uri: str, job_id: str, attempt: int) -> str:
        """The shell line that starts the supervisor detached on the first host (its environment
        comes from the 0600 file ``start_supervisor`` writes first)."""
        host = self.hosts[0]
        folder = self._jobs_dir(host)
        argv = [host.python, "-m", "common.procs", "exec-role", "--record",
                posixpath.join(folder, "procs", f"{job_id}.json"), "--env-file", posixpath.join(folder, "env"),
                "--env-key", job_id, "--", *supervise_argv(host.python, job_uri, job_id, attempt)]
        # It returns once the supervisor has recorded itself, which is how any stop_job finds it.
        return detached_supervisor_command(host.workdir, argv, posixpath.join(folder, "procs", f"{job_id}.json"),
                                           posixpath.join(folder, f"{job_id}.log"), timeout_s=SUPERVISOR_RECORD_TIMEOUT_S)

    def start_supervisor(self, job_uri: str, *, job_id: str, attempt: int, env: dict[str, str]) -> dict[str, Any]:
        host = self.hosts[0]
        folder = self._jobs_dir(host)
        # Its MXPIPE_HOME is this host's own folder, never the caller's (a path on the Airflow
        # worker): what it records of the roles it starts (the transport clients) stays here.
        base = {**REMOTE_BASE_ENV, "HOME": host.state_dir, "MXPIPE_CLUSTER": self.cluster_id, **env,
                "MXPIPE_HOME": posixpath.join(host.state_dir, "home")}
        run_on(host, f"umask 077 && mkdir -p {shlex.quote(folder)} && cat > {shlex.quote(posixpath.join(folder, 'env'))}",
               timeout_s=REMOTE_CMD_TIMEOUT_S, input_text=json.dumps({job_id: base}))
        run_on(host, self.supervisor_command(job_uri, job_id, attempt),
               timeout_s=REMOTE_CMD_TIMEOUT_S + SUPERVISOR_RECORD_TIMEOUT_S)
        log.info("started supervisor of job %s on %s", job_id, host.name)
        return {"job_id": job_id, "host": host.address, "log": posixpath.join(folder, f"{job_id}.log")}

    def stop_job(self, *, grace_s: float = STOP_JOB_GRACE_S) -> list[str]:
        host = self.hosts[0]
        cmd = in_workdir(host, host.python, "-m", "common.procs", "kill-records",
                         posixpath.join(self._jobs_dir(host), "procs"), "--grace-s", str(grace_s))
        stopped: list[str] = []
        try:
            out = run_on(host, f"mkdir -p {shlex.quote(self._jobs_dir(host))} && {cmd}",
                         timeout_s=REMOTE_CMD_TIMEOUT_S + grace_s)
            stopped = list(json.loads(out.stdout.strip().splitlines()[-1])["stopped"])
        except (OSError, RuntimeError, TimeoutError, ValueError, KeyError, IndexError) as exc:
            log.error("could not stop the supervisor on %s: %s", host.name, exc)
        # Roles a gone supervisor left are ending themselves (rank 0 writing its emergency
        # checkpoint): they get the grace to, before anything is signalled.
        return stopped + [r for r in self._kill_on_hosts(5.0, wait_s=grace_s) if not r.endswith(": unreachable")]

    def teardown(self) -> dict[str, Any]:
        """Stop the job and every role on every host, remove the hosts' state folders and the record."""
        self.stop_job()
        # The transport clients the supervisor started are recorded on its own host; here (a
        # worker) there are none unless this process ran the job itself (tests, ``python -m
        # training run``). Every role is stopped on its host below, which ends its client too.
        local: list[str] = []
        procs = os.path.join(self.state_dir, "procs")
        if os.path.isdir(procs):
            for attempt in sorted(os.listdir(procs)):
                local += kill_recorded(os.path.join(procs, attempt))
        remote = self._kill_on_hosts(5.0)
        failed = [r for r in remote if r.endswith(": unreachable")]
        for host in self.hosts:
            try:
                parent = posixpath.dirname(self._remote_dir(host))
                run_on(host, f"rm -rf {shlex.quote(self._remote_dir(host))} && (rmdir {shlex.quote(parent)} "
                             f"2>/dev/null || true)", timeout_s=REMOTE_CMD_TIMEOUT_S)
            except (OSError, RuntimeError, TimeoutError) as exc:
                failed.append(f"{host.name}: {exc}")
        if failed:
            # Keep the record: the reaper retries a teardown that could not reach every host.
            raise RuntimeError(f"teardown of {self.cluster_id} incomplete: {failed}")
        self.remove_record()
        log.info("tore down hosts cluster %s (%d role group(s) stopped)", self.cluster_id, len(remote))
        return {"stopped": sorted(set(local) | set(remote))}
