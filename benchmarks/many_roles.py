"""Many roles: what a job of 4 to 32+ roles costs on the ``local`` backend, against role count.

Each size (``--sizes``, workers+servers; the job also has one scheduler) runs the digits MLP
(``debug`` recipe, batch 8 per worker, the table jittered once per worker (``--copies``) so an
epoch has about 157 steps at every size) through the detached job runner the tests use
(``testkit/local_jobs.run_local``: ``python -m training supervise`` detached, the local cluster
backend), with local storage under a temp folder, ``--runs`` times; the report gives the median
of each figure. Per run:

1. **Job A** (``W`` workers, ``S`` servers, ``dist_sync``, a checkpoint every 10 steps, every step
   slowed by ``MXPIPE_FAULT_STEP_DELAY_S`` so the kills land mid-training at any size). A thread
   here reads the supervisor's event log (``MXPIPE_EVENTS_FILE``) and, once a checkpoint of step
   ≥ 20 is committed, kills a random worker (``kill -9`` from outside, found through the cluster's
   records: ``testkit.killer.live_roles``); after the restart in place and a checkpoint 20 steps
   past the resume, a random server; after the next restart and 20 steps more, it stops the job
   (SIGTERM to the supervisor: rank 0's emergency checkpoint, as a preemption). Another thread
   samples the supervisor (its pid from the job's status record) and its roles (the supervisor's
   child processes) with psutil every ``SAMPLE_S``.
2. **Job B** (elastic resume): the same job with ``W - max(1, W // 6)`` workers (24 → 20) on job
   A's checkpoints (``checkpoint.elastic``: true in both; the worker count is the only change),
   trained to the end.

Figures (seconds unless named otherwise), all from the event log (``testkit.timeline``, which
reads the role lines through ``common.events.parse_event`` only) and the job's metrics record:

- ``first_step_s``: job A's ``job_start`` → worker-0's ``first_step`` event (``common.events.FirstStep``);
- ``supervisor_cpu_s`` (user + system, job A's whole run), ``supervisor_peak_rss_mb`` (the
  kernel's high-water mark, ``VmHWM``), ``supervisor_peak_threads``, ``supervisor_peak_fds``,
  ``roles_peak_rss_mb`` (the largest sum of every role's RSS in one sample), ``role_peak_fds``
  (the most file descriptors one role held: ps-lite connects every role to every other one);
- ``worker_kill_detect_s`` / ``server_kill_detect_s``: kill → the supervisor's ``role_failed``;
  ``…_restart_s``: ``role_failed`` → worker-0's first step after the resume (teardown, restart in
  place, rendezvous, restore, first step: ``testkit.timeline.failure_timeline``'s terms);
- ``restore_s``: the restarted worker-0's ``worker_started`` → the first ``resumed`` event (shards
  fetched, model built, checkpoint verified and loaded; the median of the two restarts);
- ``checkpoint_save_s``: rank 0's mean serialise + write time in job B (``upload_s / committed`` of
  the metrics record's checkpoint statistics; job A, stopped, writes no metrics record);
  ``checkpoint_blocked_s``: what each cost the training loop;
- ``elastic_resume_s``: job B's ``job_start`` → worker-0's ``first_step_after_resume``;
- ``orderly_stop_s``: the stop that ends job A (the supervisor's last ``roles_stopped``: rank 0
  alone first, its emergency checkpoint, then every other role).

``--backend hosts``: the same jobs over SSH on ``--hosts`` namespace hosts (``testkit.netns_hosts``,
its own namespace prefix; an sshd in each, the keys made for the run): the ``hosts`` backend's
placement, the detached supervisor on the first host and one ssh session per role from it. The
hosts share this machine's filesystem (the job's local storage, the roles' records: the killer
finds its victims through ``testkit.killer.live_hosts_roles``) and its process table (the
sampler's psutil). Added figures: ``ssh_clients`` (the supervisor's ssh children at their peak),
``sshd_processes`` (the sshd processes serving sessions on the hosts) and
``transport_peak_rss_mb`` (both together). The PNGs are ``many_roles_hosts_*.png``.

``--s3`` (local backend): the data and the checkpoints on a real SeaweedFS S3 (credentials
enforced), every request of the supervisor and the roles counted by a boto3 event hook loaded
through their ``PYTHONPATH`` (``testkit.s3_requests``): ``resume_s3_*`` over job B's resume
(``job_start`` → the first step after it: requests, the workers' megabytes received, the
workers' requests for checkpoint objects, the busiest second), ``restart_s3_*`` over the restart
in place after the worker's kill. The PNGs are ``many_roles_s3_*.png``.

Each figure is also plotted against the role count (workers + servers) into ``--plots`` (PNG).
Before sizes of 16 roles and more run, the script waits (polling every minute, at most
``--wait-idle-s``) while ``make test``'s suite (``pytest -n <workers>``) runs, and records whether it did.

    nice -n 5 .venv/bin/python benchmarks/many_roles.py [--sizes 3+1,6+2,12+4,24+8] [--runs 2] \\
        [--plots benchmarks] [--json OUT] [--backend hosts --hosts 3] [--s3]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import storage  # noqa: E402
from common.events import CheckpointCommitted, FirstStep, FirstStepAfterResume, Resumed, WorkerStarted  # noqa: E402
from testkit.killer import LiveRole, live_hosts_roles, live_roles  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from testkit.run_queue import RunQueueSampler  # noqa: E402
from training.launch.launcher import JobStopped  # noqa: E402
from testkit.timeline import LEAD, Event, failure_timeline, first_event, role_event, role_event_of  # noqa: E402

SAMPLE_S = 0.5
BATCH = 8  # per worker
CKPT_EVERY = 10
KILL_AFTER_STEPS = 20  # a committed checkpoint this far into an attempt triggers its kill
# Steps of the whole job: job A is stopped around step 60-80 (kills at ≥ 20 and ≥ resume + 20, the
# stop at ≥ resume + 20), job B trains the rest with fewer workers.
TARGET_STEPS = 160
FIGURES = ("first_step_s", "supervisor_cpu_s", "supervisor_peak_rss_mb", "supervisor_peak_threads",
           "supervisor_peak_fds", "roles_peak_rss_mb", "role_peak_fds", "worker_kill_detect_s", "worker_kill_restart_s",
           "server_kill_detect_s", "server_kill_restart_s", "restore_s", "checkpoint_save_s",
           "checkpoint_blocked_s", "elastic_resume_s", "orderly_stop_s",
           # Job B's saves one by one, and the roles' CPU and wall per training step (save_figures).
           "checkpoint_commit_upload_s", "job_b_step_cpu_s", "job_b_step_s", "save_runnable", "job_b_runnable",
           # --backend hosts: the transport's processes (an ssh client here, sshd on the host).
           "ssh_clients", "sshd_processes", "transport_peak_rss_mb",
           # --s3: the resume's S3 requests (job B: job_start → first step after the resume).
           "resume_s3_requests", "resume_s3_worker_mb", "resume_s3_checkpoint_requests",
           "resume_s3_peak_requests_per_s", "restart_s3_requests", "restart_s3_worker_mb")
# The plots: (file stem, title, y label, figures on it).
PLOTS = (("first_step", "Time to the first step", "seconds", ("first_step_s", "elastic_resume_s")),
         ("supervisor", "Supervisor CPU time (whole job A)", "CPU seconds", ("supervisor_cpu_s",)),
         ("memory", "Peak memory", "MB", ("supervisor_peak_rss_mb", "roles_peak_rss_mb")),
         ("descriptors", "Peak file descriptors and threads", "count",
          ("supervisor_peak_fds", "supervisor_peak_threads", "role_peak_fds")),
         ("failure", "Failure detection and restart in place", "seconds",
          ("worker_kill_detect_s", "server_kill_detect_s", "worker_kill_restart_s", "server_kill_restart_s")),
         ("checkpoint", "Checkpoint save and restore", "seconds",
          ("checkpoint_save_s", "checkpoint_blocked_s", "restore_s", "orderly_stop_s")),
         ("transport", "SSH transport: processes and memory", "count / MB",
          ("ssh_clients", "sshd_processes", "transport_peak_rss_mb")),
         ("s3", "S3 requests: resume (job B), restart", "requests / MB",
          ("resume_s3_requests", "resume_s3_checkpoint_requests", "resume_s3_worker_mb", "restart_s3_requests",
           "restart_s3_worker_mb")))
JOB_TIMEOUT_S = 1800.0


class LocalBackend:
    """Every role a process of this machine (``testkit.local_jobs.run_local``)."""

    name = "local"

    def __init__(self, root: Path) -> None:
        self.home = str(root / "home")

    def run(self, job: Any, prefix: str, env: dict[str, str]) -> None:
        from testkit.local_jobs import run_local

        run_local(job, storage.join(prefix, "job.json"), self.home, env, timeout_s=JOB_TIMEOUT_S)

    def live_roles(self) -> list[LiveRole]:
        return live_roles(self.home)

    def role_processes(self, supervisor: Any) -> list[Any]:
        return supervisor.children(recursive=True)

    def transport_processes(self, supervisor: Any) -> tuple[list[Any], list[Any]]:
        return [], []


class HostsBackend:
    """The ``hosts`` backend over SSH on namespace hosts (``testkit.netns_hosts``): the detached
    supervisor on the first host, one ssh session per role from it. The hosts share this
    machine's filesystem (the job's local storage) and process table (the kills, the samples)."""

    name = "hosts"

    def __init__(self, hosts: list[dict], root: Path) -> None:
        self.state_dir = str(root / "state")
        self.hosts = [{**h, "state_dir": self.state_dir} for h in hosts]
        self.home = str(root / "home")
        self.cluster: Any = None

    def run(self, job: Any, prefix: str, env: dict[str, str]) -> None:
        import uuid

        from infra.cluster import ClusterSpec, provision
        from training.launch.detached import run_detached

        c = job.config.cluster
        spec = ClusterSpec(run_tag=f"many-roles--{c.num_workers}w{c.num_servers}s-{uuid.uuid4().hex[:8]}",
                           workers=c.num_workers, servers=c.num_servers, backend="hosts",
                           options={"hosts": self.hosts})
        self.cluster = provision(spec, home=self.home)
        job_uri = storage.join(prefix, "job.json")
        job = dataclasses.replace(job, status_uri=storage.join(prefix, "job_status.json"),
                                  cluster=self.cluster.job_cluster())
        job.save(job_uri)
        try:
            run_detached(job_uri, env={**os.environ, **env}, timeout_s=JOB_TIMEOUT_S)
        finally:
            self.cluster.teardown()

    def live_roles(self) -> list[LiveRole]:
        cluster = self.cluster
        return live_hosts_roles(self.state_dir, cluster.cluster_id) if cluster is not None else []

    def role_processes(self, supervisor: Any) -> list[Any]:
        import psutil

        out = []
        for role in self.live_roles():
            with contextlib.suppress(psutil.NoSuchProcess):
                out.append(psutil.Process(role.pid))
        return out

    def transport_processes(self, supervisor: Any) -> tuple[list[Any], list[Any]]:
        """The supervisor's ssh clients, and the sshd processes serving sessions on the hosts
        (below each host's listener: a privileged monitor and a user process per session)."""
        import psutil

        clients = [c for c in supervisor.children() if c.name() == "ssh"]
        served = []
        for host in self.hosts:
            with contextlib.suppress(psutil.NoSuchProcess):
                listener = psutil.Process(host["extra"]["sshd_pid"])
                # ip netns exec execs sshd: the recorded pid is the listener itself.
                served += [p for p in listener.children(recursive=True) if p.name().startswith("sshd")]
        return clients, served


@contextlib.contextmanager
def hosts_backend(count: int, root: Path) -> Iterator[list[dict]]:
    """``count`` namespace hosts (``testkit.netns_hosts``'s own prefix) with an sshd each."""
    from testkit.netns_hosts import namespace_hosts, ssh_hosts, sshd_available

    why = sshd_available()
    if why:
        raise SystemExit(f"--backend hosts needs sshd in network namespaces: {why}")
    with namespace_hosts(count, controller=True) as made, ssh_hosts(made, root / "ssh") as over_ssh:
        yield over_ssh


def parse_size(text: str) -> tuple[int, int]:
    workers, _, servers = text.partition("+")
    try:
        w, s = int(workers), int(servers)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a size is WORKERS+SERVERS, got {text!r}") from None
    if w < 2 or s < 1:
        raise argparse.ArgumentTypeError(f"a size needs at least 2 workers and 1 server, got {text!r}")
    return w, s


def read_events(path: Path) -> list[Event]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the supervisor's line being written
            continue
    return out


class KillOneWorkerThenOneServer(threading.Thread):
    """``kill -9`` of a random worker once attempt 1 committed a checkpoint of step ≥ 20, then of a
    random server once attempt 2 committed one 20 steps past its resume; once attempt 3 did too,
    SIGTERM to the supervisor (an orderly stop: rank 0's emergency checkpoint, job B's start)."""

    def __init__(self, backend: Any, events_file: Path, status_uri: str, seed: int) -> None:
        super().__init__(name="many-roles-killer", daemon=True)
        self.backend, self.events_file, self.status_uri = backend, events_file, status_uri
        self.rng = random.Random(seed)
        self.kills: list[dict[str, Any]] = []
        self.stopped_at: float | None = None
        self.stopping = threading.Event()

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)

    def _due(self, attempt: int) -> bool:
        """Whether attempt ``attempt`` (1: the first round of roles) committed a checkpoint
        ``KILL_AFTER_STEPS`` past where it started."""
        events = read_events(self.events_file)
        starts = [i for i, e in enumerate(events) if e["event"] in ("job_start", "roles_restarting")]
        if len(starts) != attempt:
            return False
        resumed = 0
        for ev in events[starts[-1]:]:
            got = role_event_of(ev)
            if isinstance(got, Resumed):
                resumed = max(resumed, got.step)
            if isinstance(got, CheckpointCommitted) and got.step >= resumed + KILL_AFTER_STEPS:
                return True
        return False

    def _wait_due(self, attempt: int) -> bool:
        while not self.stopping.wait(0.2):
            if self._due(attempt):
                return True
        return False

    def run(self) -> None:
        for attempt, kind in ((1, "worker"), (2, "server")):
            if not self._wait_due(attempt):
                return
            while not self.stopping.is_set():
                victims = [r for r in self.backend.live_roles() if r.kind == kind]
                if victims:
                    victim = self.rng.choice(sorted(victims))
                    t = time.time()
                    try:
                        os.kill(victim.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.kills.append({"t": t, "role": victim.name, "kind": kind})
                    break
                self.stopping.wait(0.2)
        if self._wait_due(3):
            from training.launch.status import read_status

            status = read_status(self.status_uri)
            if status is not None and status.pid:
                self.stopped_at = time.time()
                os.kill(status.pid, signal.SIGTERM)


class Sampler(threading.Thread):
    """Samples the supervisor (its pid from the status record), its roles (``backend``'s: the
    supervisor's child processes on ``local``, the recorded role processes on the hosts) and the
    transport's processes with psutil until stopped: CPU time, RSS, threads, file descriptors."""

    def __init__(self, status_uri: str, backend: Any, skip_pid: int | None = None) -> None:
        super().__init__(name="many-roles-sampler", daemon=True)
        self.status_uri, self.backend = status_uri, backend
        self.skip_pid = skip_pid  # an earlier job's supervisor, whose status record may still be there
        self.pid: int | None = None
        self.stopping = threading.Event()
        self.result: dict[str, float] = {}
        # (time.time(), CPU seconds of every role seen so far, each at its last sample): the
        # roles' CPU per training step is its slope between two checkpoints (``step_cpu_s``).
        self.roles_cpu: list[tuple[float, float]] = []

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)

    def _supervisor(self) -> Any:
        import psutil

        from training.launch.status import read_status

        while not self.stopping.wait(0.1):
            try:
                status = read_status(self.status_uri)
            except Exception:  # noqa: BLE001 - half written: read again
                continue
            if status is not None and status.pid and status.pid != self.skip_pid:
                try:
                    self.pid = status.pid
                    return psutil.Process(status.pid)
                except psutil.NoSuchProcess:
                    return None
        return None

    def run(self) -> None:
        import psutil

        proc = self._supervisor()
        if proc is None:
            return
        peak = {"rss": 0.0, "hwm": 0.0, "threads": 0, "fds": 0, "roles_rss": 0.0, "role_fds": 0,
                "ssh": 0, "sshd": 0, "transport_rss": 0.0}
        cpu = 0.0
        role_cpu: dict[int, float] = {}
        while True:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    cpu = times.user + times.system
                    peak["rss"] = max(peak["rss"], proc.memory_info().rss)
                    peak["threads"] = max(peak["threads"], proc.num_threads())
                    peak["fds"] = max(peak["fds"], proc.num_fds())
                with open(f"/proc/{proc.pid}/status") as fh:
                    hwm = next(int(ln.split()[1]) * 1024 for ln in fh if ln.startswith("VmHWM:"))
                peak["hwm"] = max(peak["hwm"], hwm)
                roles = 0.0
                for child in self.backend.role_processes(proc):
                    try:
                        roles += child.memory_info().rss
                        # ps-lite connects every role to every other one (common.procs.limits).
                        peak["role_fds"] = max(peak["role_fds"], child.num_fds())
                        times = child.cpu_times()
                        role_cpu[child.pid] = times.user + times.system
                    except psutil.NoSuchProcess:
                        continue
                peak["roles_rss"] = max(peak["roles_rss"], roles)
                self.roles_cpu.append((time.time(), sum(role_cpu.values())))
                clients, served = self.backend.transport_processes(proc)
                transport = 0.0
                for p in clients + served:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        transport += p.memory_info().rss
                peak["ssh"] = max(peak["ssh"], len(clients))
                peak["sshd"] = max(peak["sshd"], len(served))
                peak["transport_rss"] = max(peak["transport_rss"], transport)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, FileNotFoundError, ProcessLookupError, StopIteration):
                break
            if self.stopping.wait(SAMPLE_S):
                break
        mb = 1024.0 * 1024.0
        self.result = {"supervisor_cpu_s": cpu, "supervisor_peak_rss_mb": max(peak["hwm"], peak["rss"]) / mb,
                       "supervisor_peak_threads": peak["threads"], "supervisor_peak_fds": peak["fds"],
                       "roles_peak_rss_mb": peak["roles_rss"] / mb, "role_peak_fds": peak["role_fds"]}
        if self.backend.name == "hosts":
            self.result.update({"ssh_clients": peak["ssh"], "sshd_processes": peak["sshd"],
                                "transport_peak_rss_mb": peak["transport_rss"] / mb})


def shard(root: str, workers: int, copies: int) -> tuple[Any, str, int]:
    """The jittered digits table sharded for ``workers`` under ``root`` (a folder or an S3
    prefix): (config, shards prefix, train rows)."""
    from common.config import recipe
    from data_checks.shard import shard_dataset
    from testkit.digits import digits_csv

    prefix = storage.join(root, f"data-{workers}")
    source = storage.join(prefix, "digits.csv")
    storage.put_bytes(source, digits_csv(copies))
    cfg = recipe("debug", source).replace(cluster={"num_workers": workers})
    manifest = shard_dataset(cfg, storage.join(prefix, "shards"))
    return cfg, storage.join(prefix, "shards"), int(manifest["splits"]["train"]["count"])


def job_config(cfg: Any, workers: int, servers: int, epochs: int) -> Any:
    return cfg.replace(optim={"epochs": epochs, "batch_size": BATCH},
                       checkpoint={"every_n_steps": CKPT_EVERY, "elastic": True},
                       cluster={"num_workers": workers, "num_servers": servers, "kvstore": "dist_sync",
                                "job_timeout_s": 1500, "start_timeout_s": 600, "stall_timeout_s": 300,
                                "max_restarts_without_progress": 3})


def measure(root: Path, store: str, backend: Any, cfg: Any, shards: str, workers: int, servers: int, epochs: int,
            seed: int, step_delay_s: float, s3_env: dict[str, str]) -> dict[str, Any]:
    """One run of jobs A and B (module docstring). ``root``: this run's local folder (event logs,
    records); ``store``: where the job's checkpoints go (a folder, or an S3 prefix with
    ``s3_env`` the hook's environment, ``testkit.s3_requests``)."""
    from testkit import s3_requests
    from testkit.local_jobs import make_job

    prefix = storage.join(store, "job")
    events_a, events_b = root / "events-a.jsonl", root / "events-b.jsonl"
    counts = root / "s3-requests.jsonl"
    env = {"MXPIPE_EVENTS_FILE": str(events_a), "MXPIPE_FAULT_STEP_DELAY_S": str(step_delay_s),
           "MXPIPE_FAULT_KILL_RANK": "0",
           **({**s3_env, s3_requests.ENV: str(counts)} if s3_env else {})}
    job_a = make_job(job_config(cfg, workers, servers, epochs), shards, prefix)
    status_uri = storage.join(prefix, "job_status.json")
    killer = KillOneWorkerThenOneServer(backend, events_a, status_uri, seed)
    sampler = Sampler(status_uri, backend)
    killer.start()
    sampler.start()
    started = time.monotonic()
    try:
        backend.run(job_a, prefix, env)
        raise RuntimeError(f"{workers}+{servers}: job A ended before it was stopped: more epochs")
    except JobStopped:
        pass  # the killer's SIGTERM: what job B resumes from
    finally:
        killer.stop()
        sampler.stop()
    wall_a = time.monotonic() - started
    events = read_events(events_a)
    if len(killer.kills) != 2:
        raise RuntimeError(f"{workers}+{servers}: expected a worker and a server killed, got {killer.kills}")
    out: dict[str, Any] = {"workers": workers, "servers": servers, "roles": workers + servers,
                           "job_a_wall_s": wall_a, "kills": killer.kills, **sampler.result}
    job_start = first_event(events, lambda e: e["event"] == "job_start", 0.0)["t"]
    # The stop that ended job A (rank 0 first, its emergency checkpoint, then every other role).
    out["orderly_stop_s"] = [e for e in events if e["event"] == "roles_stopped"][-1]["seconds"]
    out["first_step_s"] = first_event(events, role_event(FirstStep, LEAD), job_start)["t"] - job_start
    restores = []
    if s3_env:  # the restart in place after the worker's kill: role_failed → first step after it
        timeline = failure_timeline(events, killer.kills[0]["t"])
        restart = s3_requests.summary(s3_requests.read(counts), killer.kills[0]["t"],
                                      killer.kills[0]["t"] + timeline["total"])
        out["restart_s3"] = restart
        out["restart_s3_requests"] = restart["requests"]
        out["restart_s3_worker_mb"] = restart["worker_bytes_in"] / 1e6
    for kill in killer.kills:
        timeline = failure_timeline(events, kill["t"])
        out[f"{kill['kind']}_kill_detect_s"] = timeline["detect"]
        out[f"{kill['kind']}_kill_restart_s"] = timeline["total"] - timeline["detect"]
        out[f"{kill['kind']}_kill_timeline"] = timeline
        restores.append(timeline["restore"])
    out["restore_s"] = statistics.median(restores)

    # Job B: fewer workers on job A's checkpoints (its emergency one), trained to the end.
    fewer = workers - max(1, workers // 6)
    job_b = make_job(job_config(cfg, fewer, servers, epochs), shards, prefix)
    sampler_b = Sampler(status_uri, backend, skip_pid=sampler.pid)
    sampler_b.start()
    # The machine's runnable threads every 10 ms: who wants the cores while rank 0 saves.
    with RunQueueSampler(every_s=0.01) as run_queue:
        try:
            backend.run(job_b, prefix, {**env, "MXPIPE_EVENTS_FILE": str(events_b)})
        finally:
            sampler_b.stop()
    # Rank 0's checkpoint statistics of job B (job A was stopped: no metrics record).
    stats = json.loads(storage.get_bytes(job_b.metrics_uri))["checkpoint"]
    out["checkpoint_save_s"] = stats["upload_s"] / max(1, stats["committed"])
    out["checkpoint_blocked_s"] = stats["blocked_s"] / max(1, stats["committed"])
    out["checkpoint_stats"] = stats
    events = read_events(events_b)
    out.update(save_figures(events, sampler_b.roles_cpu, run_queue.samples))
    job_start = first_event(events, lambda e: e["event"] == "job_start", 0.0)["t"]
    first = first_event(events, role_event(FirstStepAfterResume, LEAD), job_start)
    out["elastic_workers"] = fewer
    out["elastic_resume_s"] = first["t"] - job_start
    joined = first_event(events, role_event(WorkerStarted, LEAD), job_start)
    out["elastic_restore_s"] = first_event(events, role_event(Resumed), joined["t"])["t"] - joined["t"]
    if s3_env:  # every worker reads the checkpoint itself: the resume's requests, by worker count
        resume = s3_requests.summary(s3_requests.read(counts), job_start, first["t"])
        out["resume_s3"] = resume
        out["resume_s3_requests"] = resume["requests"]
        out["resume_s3_worker_mb"] = resume["worker_bytes_in"] / 1e6
        out["resume_s3_checkpoint_requests"] = resume["worker_by_part"].get("checkpoints", {}).get("requests", 0)
        out["resume_s3_peak_requests_per_s"] = resume["peak_requests_per_s"]
    return out


def save_figures(events: list[Event], roles_cpu: list[tuple[float, float]],
                 run_queue: list[tuple[float, int]]) -> dict[str, Any]:
    """Job B's saves one by one (each commit event's ``upload_s``: serialise, write, commit; the
    prune after it is not in it), the roles' CPU seconds per training step between its first
    and its last periodic commit (no start, no end of training in the window): the work of one
    synchronous step of the whole job, which rank 0's save shares the cores with; and the
    machine's runnable threads during the saves and around them (``save_run_queue``)."""
    commits = [(e["t"], got) for e in events if isinstance(got := role_event_of(e), CheckpointCommitted)]
    out: dict[str, Any] = {}
    uploads = [c.upload_s for _, c in commits if c.upload_s is not None]
    if uploads:
        out["checkpoint_commit_upload_s"] = statistics.median(uploads)
        out["checkpoint_commit_upload_all_s"] = uploads
        out.update(save_run_queue([(t - c.upload_s, t) for t, c in commits if c.upload_s is not None], run_queue))
    periodic = [(t, c.step) for t, c in commits if c.step % CKPT_EVERY == 0]
    if len(periodic) >= 3 and len(roles_cpu) >= 2:
        (t0, s0), (t1, s1) = periodic[1], periodic[-2]  # well inside training: not the first, not the last

        def cpu_at(t: float) -> float:
            return min(roles_cpu, key=lambda x: abs(x[0] - t))[1]

        if s1 > s0:
            out["job_b_step_cpu_s"] = (cpu_at(t1) - cpu_at(t0)) / (s1 - s0)
            out["job_b_step_s"] = (t1 - t0) / (s1 - s0)
    return out


def save_run_queue(saves: list[tuple[float, float]], samples: list[tuple[float, int]],
                   bin_s: float = 0.02, before_s: float = 0.5, after_s: float = 0.1) -> dict[str, Any]:
    """Runnable threads (machine-wide, ``testkit.run_queue``) while each save ran (from its commit
    event's time less its ``upload_s``), their mean over the saves, and their mean by time from a
    save's start (bins of ``bin_s``, ``before_s`` before to ``after_s`` after): when in the job's
    10-step cycle the cores are wanted."""
    during = []
    for t0, t1 in saves:
        inside = [n for t, n in samples if t0 <= t <= t1]
        if inside:
            during.append(sum(inside) / len(inside))
    bins: dict[int, list[int]] = {}
    for t0, _ in saves:
        for t, n in samples:
            if t0 - before_s <= t < t0 + after_s:
                bins.setdefault(math.floor((t - t0) / bin_s), []).append(n)
    profile = [[round(b * bin_s, 3), round(sum(v) / len(v), 2)] for b, v in sorted(bins.items())]
    overall = [n for t, n in samples if saves and saves[0][0] <= t <= saves[-1][1]]
    return {"save_runnable": statistics.mean(during) if during else None,
            "job_b_runnable": statistics.mean(overall) if overall else None,
            "save_runnable_profile": profile}


def suite_running() -> bool:
    """Whether ``make test``'s suite (``pytest -n <workers> --dist loadfile``) runs on this machine now."""
    return subprocess.run(["pgrep", "-f", r"pytest -n [0-9]+ --dist loadfile"], capture_output=True).returncode == 0


def wait_idle(limit_s: float) -> bool:
    """Wait while the suite runs, polling every minute, at most ``limit_s``; whether it still runs."""
    deadline = time.monotonic() + limit_s
    while suite_running() and time.monotonic() < deadline:
        print("the test suite is running: waiting", flush=True)
        time.sleep(min(60.0, max(0.0, deadline - time.monotonic())))
    return suite_running()


def summarise(rows: list[dict[str, Any]]) -> dict[str, float]:
    return {name: statistics.median(r[name] for r in rows) for name in FIGURES if all(name in r for r in rows)}


def plot(sizes: list[dict[str, Any]], folder: str, stem_prefix: str = "many_roles") -> list[str]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    written = []
    roles = [s["roles"] for s in sizes]
    for stem, title, ylabel, names in PLOTS:
        if not any(name in s["median"] for s in sizes for name in names):
            continue  # the transport's figures on local, the S3 ones without --s3
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in names:
            ax.plot(roles, [s["median"].get(name, math.nan) for s in sizes], marker="o", label=name)
        ax.set_xlabel("roles (workers + servers; plus one scheduler)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} (median of runs)")
        ax.set_xticks(roles)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        path = os.path.join(folder, f"{stem_prefix}_{stem}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="3+1,6+2,12+4,24+8",
                        type=lambda v: [parse_size(s.strip()) for s in v.split(",") if s.strip()],
                        help="WORKERS+SERVERS, comma-separated")
    parser.add_argument("--runs", type=int, default=2, help="runs per size (the median is reported)")
    parser.add_argument("--copies", type=int, default=1, help="jittered copies of the digits table per worker")
    parser.add_argument("--step-delay-s", type=float, default=0.1, help="MXPIPE_FAULT_STEP_DELAY_S of job A")
    parser.add_argument("--seed", type=int, default=28)
    parser.add_argument("--plots", default=os.path.dirname(os.path.abspath(__file__)), help="folder of the PNGs")
    parser.add_argument("--wait-idle-s", type=float, default=1800.0,
                        help="how long to wait for the test suite to end before sizes of 16 roles and more")
    parser.add_argument("--keep", help="a folder for the runs (default: a temp folder)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--backend", choices=("local", "hosts"), default="local",
                        help="hosts: over SSH on namespace hosts (testkit.netns_hosts), the job's storage shared")
    parser.add_argument("--hosts", type=int, default=3, help="namespace hosts of --backend hosts")
    parser.add_argument("--s3", action="store_true",
                        help="data and checkpoints on a real SeaweedFS S3, every request counted "
                             "(testkit.s3_requests; --backend local only)")
    parser.add_argument("--plot-prefix", help="file stem of the PNGs (default many_roles, many_roles_hosts, "
                                              "many_roles_s3)")
    args = parser.parse_args()
    if args.s3 and args.backend != "local":
        parser.error("--s3 counts requests through a hook on the roles' PYTHONPATH, which remote roles "
                     "do not inherit: --backend local only")
    stem = args.plot_prefix or ("many_roles_hosts" if args.backend == "hosts" else
                                "many_roles_s3" if args.s3 else "many_roles")
    # SIGTERM (a bounded run's timeout) unwinds like Ctrl-C: every job, sshd and S3 server stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    report: dict[str, Any] = {"runs": args.runs, "copies": args.copies, "step_delay_s": args.step_delay_s,
                              "checkpoint_every_n_steps": CKPT_EVERY, "cpus": os.cpu_count(),
                              "backend": args.backend, "hosts": args.hosts if args.backend == "hosts" else None,
                              "s3": args.s3, "sizes": []}
    with tempfile.TemporaryDirectory(prefix="mxpipe-roles-") as tmp, contextlib.ExitStack() as stack:
        root = Path(args.keep) if args.keep else Path(tmp)
        hosts = stack.enter_context(hosts_backend(args.hosts, root)) if args.backend == "hosts" else []
        s3_env: dict[str, str] = {}
        data_root = str(root)
        if args.s3:
            from testkit.chaos_jobs import ChaosStack
            from testkit.s3_requests import hook_dir

            server = ChaosStack(root / "s3")
            server.start()
            stack.callback(server.stop)
            stack.enter_context(server.environment())
            s3_env = hook_dir(root / "s3-hook")
            data_root = f"s3://{server.bucket}/many-roles"
        for workers, servers in args.sizes:
            loaded = wait_idle(args.wait_idle_s) if workers + servers >= 16 else suite_running()
            # As many jittered copies of the table as workers: about the same steps at every size.
            cfg, shards, train_rows = shard(data_root, workers, workers * args.copies)
            steps_per_epoch = max(1, train_rows // (BATCH * workers))
            epochs = max(1, math.ceil(TARGET_STEPS / steps_per_epoch))
            rows = []
            for run in range(args.runs):
                work = root / f"{workers}+{servers}-{run}"
                work.mkdir(parents=True)
                backend = HostsBackend(hosts, work) if hosts else LocalBackend(work)
                store = storage.join(data_root, f"{workers}+{servers}-{run}") if args.s3 else str(work)
                row = measure(work, store, backend, cfg, shards, workers, servers, epochs, args.seed + run,
                              args.step_delay_s, s3_env)
                row["suite_running"] = loaded or suite_running()
                rows.append(row)
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()
                                  if k in FIGURES or k in ("workers", "servers", "suite_running")}), flush=True)
            report["sizes"].append({"workers": workers, "servers": servers, "roles": workers + servers,
                                    "epochs": epochs, "steps_per_epoch": steps_per_epoch, "runs": rows,
                                    "median": summarise(rows)})
    report["plots"] = plot(report["sizes"], args.plots, stem)
    shown = [n for n in FIGURES if any(n in size["median"] for size in report["sizes"])]
    print("\nroles " + " ".join(f"{n:>12.12}" for n in shown))
    for size in report["sizes"]:
        print(f"{size['roles']:>5} " + " ".join(f"{size['median'].get(n, math.nan):12.2f}" for n in shown))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
