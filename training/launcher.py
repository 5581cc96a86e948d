"""Launch and supervise every role of one parameter-server job.

ps-lite cannot lose a node: when one role dies, the others block forever (seen here even with
heartbeats set). So the supervisor owns the scheduler, the servers and the workers, and ends the
whole job when any role exits non-zero, when no worker has logged anything for
``stall_timeout_s``, or when the job runs past ``job_timeout_s``. It streams each role's output
into this process's log with a ``[role-rank]`` prefix and raises one ``JobFailed`` naming the
role, its exit code or signal and its last lines. The next attempt starts a fresh job, which
resumes from the latest committed checkpoint.

Where roles run is not this module's business: it takes a ``Spawner`` (anything with
``spawn(name, argv, env) -> Popen`` whose children each lead their own process group), and a
scheduler address from the cluster.

ps-lite settings, chosen on purpose:
- ``DMLC_NODE_HOST`` / ``DMLC_PS_ROOT_URI`` name the host's address, so roles bind to it (on
  the local backend 127.0.0.1: nothing listens beyond loopback).
- ``PS_HEARTBEAT_INTERVAL`` stays 0 (off): heartbeats never unblocked a dist_sync job after a
  lost peer here; the supervisor's exit and stall checks are what detect failures.
- ``PS_RESEND`` is off: a resend loop cannot bring back a dead role, and on a healthy loopback
  or LAN it only adds traffic.
- ``OMP_NUM_THREADS`` / ``MXNET_CPU_WORKER_NTHREADS`` bound each role's threads, so roles that
  share a small machine do not oversubscribe its cores.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from training.config import TrainConfig
from training.job import DETERMINISTIC_EXIT_CODES

log = logging.getLogger(__name__)

POLL_S = 0.2
TAIL_LINES = 30
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# How long the scheduler and servers get to exit on their own once every worker succeeded.
DRAIN_TIMEOUT_S = 30.0


class Spawner(Protocol):
    def spawn(self, name: str, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen: ...

    def kill_all(self, *, grace_s: float = 5.0) -> int: ...


class JobFailed(RuntimeError):
    """The distributed job failed; ``deterministic`` says whether a retry can help."""

    def __init__(self, message: str, *, role: str, exit_code: int | None, deterministic: bool) -> None:
        super().__init__(message)
        self.role = role
        self.exit_code = exit_code
        self.deterministic = deterministic


@dataclass
class _Role:
    name: str
    kind: str
    proc: subprocess.Popen
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    last_output: float = field(default_factory=time.monotonic)
    seen_output: bool = False
    reader: threading.Thread | None = None


def role_env(base: Mapping[str, str], cfg: TrainConfig, kind: str, host: str, scheduler_host: str,
             port: int) -> dict[str, str]:
    threads = str(cfg.cluster.threads_per_role)
    env = dict(base)
    env.update({
        "DMLC_ROLE": kind,
        "DMLC_PS_ROOT_URI": scheduler_host,
        "DMLC_PS_ROOT_PORT": str(port),
        "DMLC_NUM_SERVER": str(cfg.cluster.num_servers),
        "DMLC_NUM_WORKER": str(cfg.cluster.num_workers),
        "DMLC_NODE_HOST": host,
        "PS_VERBOSE": env.get("PS_VERBOSE", "0"),
        "OMP_NUM_THREADS": threads,
        "MXNET_CPU_WORKER_NTHREADS": threads,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p),
    })
    return env


def role_argv(kind: str, job_uri: str, python: str = sys.executable) -> list[str]:
    if kind == "worker":
        return [python, "-m", "training", "worker", job_uri]
    # A scheduler or server is mxnet itself: importing it with DMLC_ROLE set runs the role.
    return [python, "-c", "from common.mx import import_mxnet; import_mxnet()"]


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _pump(role: _Role) -> None:
    assert role.proc.stdout is not None
    for line in role.proc.stdout:
        line = line.rstrip("\n")
        role.tail.append(line)
        role.last_output = time.monotonic()
        role.seen_output = True
        log.info("[%s] %s", role.name, line)


class Supervisor:
    """Starts the roles of one job and watches them until success or the first failure."""

    def __init__(self, cfg: TrainConfig, spawner: Spawner, *, host: str, port: int,
                 base_env: Mapping[str, str]) -> None:
        self.cfg = cfg
        self.spawner = spawner
        self.host = host
        self.port = port
        self.base_env = base_env
        self.roles: list[_Role] = []

    def _start(self, name: str, kind: str, argv: list[str]) -> None:
        env = role_env(self.base_env, self.cfg, kind, self.host, self.host, self.port)
        role = _Role(name=name, kind=kind, proc=self.spawner.spawn(name, argv, env))
        role.reader = threading.Thread(target=_pump, args=(role,), name=f"pump-{name}", daemon=True)
        role.reader.start()
        self.roles.append(role)

    def run(self, job_uri: str) -> None:
        c = self.cfg.cluster
        log.info("starting job: 1 scheduler, %d servers, %d workers at %s:%d",
                 c.num_servers, c.num_workers, self.host, self.port)
        try:
            self._start("scheduler", "scheduler", role_argv("scheduler", job_uri))
            for i in range(c.num_servers):
                self._start(f"server-{i}", "server", role_argv("server", job_uri))
            for i in range(c.num_workers):
                self._start(f"worker-{i}", "worker", role_argv("worker", job_uri))
            self._watch()
        finally:
            stopped = self.spawner.kill_all(grace_s=5.0)
            for role in self.roles:
                if role.reader:
                    role.reader.join(timeout=5.0)
            if stopped:
                log.info("stopped %d role process group(s)", stopped)

    def _watch(self) -> None:
        c = self.cfg.cluster
        started = time.monotonic()
        workers = [r for r in self.roles if r.kind == "worker"]
        while True:
            time.sleep(POLL_S)
            now = time.monotonic()
            for role in self.roles:
                code = role.proc.poll()
                if code not in (None, 0):
                    self._fail(role, f"{role.name} on {self.host} failed: {_describe_exit(code)}", code)
            if all(w.proc.poll() == 0 for w in workers):
                self._drain()
                log.info("job finished in %.1fs", now - started)
                return
            if now - started > c.job_timeout_s:
                self._fail(None, f"job exceeded its timeout of {c.job_timeout_s:.0f}s", None)
            for w in workers:
                # Before its first line a worker is still importing mxnet and joining the job.
                limit = c.stall_timeout_s if w.seen_output else c.start_timeout_s
                if w.proc.poll() is None and now - w.last_output > limit:
                    what = "stalled: no output" if w.seen_output else "did not start: no output"
                    self._fail(w, f"{w.name} on {self.host} {what} for {limit:.0f}s", None)

    def _drain(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            if all(r.proc.poll() is not None for r in self.roles):
                bad = [r for r in self.roles if r.proc.returncode != 0]
                if bad:
                    self._fail(bad[0], f"{bad[0].name} failed after the workers finished: "
                                       f"{_describe_exit(bad[0].proc.returncode)}", bad[0].proc.returncode)
                return
            time.sleep(POLL_S)
        log.warning("scheduler/servers did not exit within %.0fs after the workers finished; stopping them",
                    DRAIN_TIMEOUT_S)

    def _fail(self, role: _Role | None, what: str, code: int | None) -> None:
        if role is not None and role.reader:
            role.reader.join(timeout=2.0)
        tail = "\n".join(role.tail) if role is not None else ""
        message = what + (f"\nlast lines of {role.name}:\n{tail}" if tail else "")
        raise JobFailed(message, role=role.name if role else "job", exit_code=code,
                        deterministic=code in DETERMINISTIC_EXIT_CODES)
