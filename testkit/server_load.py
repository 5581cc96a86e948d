"""Each parameter server's share of a model and of a job's traffic: predicted from MXNet's key
assignment, and measured on the running job's server processes.

**Prediction** (``server_elements``, from ``infra.perf_model``). MXNet 1.9's dist kvstore (``src/kvstore/kvstore_dist.h``,
``EncodeDefaultKey``) places a key of ``size`` values with ``size < MXNET_KVSTORE_BIGARRAY_BOUND``
(default 1,000,000) whole on server ``(key * 9973) % num_servers``; a bigger array is cut into
``num_servers`` contiguous parts of ``round(size / n * (i + 1)) - round(size / n * i)`` values,
part ``i`` on server ``i``. gluon's Trainer numbers the keys ``0, 1, …`` in the order of its
parameters (``training.loop.kvstore_sync.make_trainer`` gets ``net.collect_params()``, whose
order is the network's: for the ``mlp``, each Dense layer's weight then bias). In ``dist_sync``
every worker pushes every key's gradient and pulls it back each step, so a server's share of the
traffic is its share of the values. "Server ``i``" is ps-lite's server rank, which the scheduler
gives in the order the servers register, not the role's name: the role ``server-0`` may hold rank
3's keys (seen in a 4-server job), so predicted and measured shares are compared as sorted lists
(``ranked``), largest first.

**Measurement** (``ServerSampler``). A thread that, while a local job runs, finds the servers'
processes from the local cluster's process records (``home/clusters/*/procs/*/``; a restart in
place starts new ones, counted under the same role name) and samples, about every second:

- their resident memory (psutil RSS of every process of the role's group);
- their TCP byte counts, per socket, from ``ss -tinpH`` (``bytes_received`` / ``bytes_acked``
  of each socket a server process holds). Not psutil's ``io_counters()``: on Linux its
  ``read_chars``/``write_chars`` count ``read``/``write`` on files and pipes, and ZMQ (ps-lite's
  van) moves its data with ``send``/``recv``, which they do not count (checked on a 50 MB
  loopback transfer: 0 bytes written, where ``ss`` counted all 50,000,000). A socket's counters
  only grow while it is open, so a socket's largest sample is what it moved (up to the last
  sample: the ~1 s before the job's end is missed, the same for every server).
"""
from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil

from common.procs.records import load_records
# The key rule is the planner's (its communication model needs it); re-exported for the benchmarks.
from infra.perf_model import DEFAULT_BIGARRAY_BOUND, server_elements  # noqa: F401

_SOCKET = re.compile(r"^\d+\s+\d+\s+(?P<local>\S+)\s+(?P<peer>\S+)\s+users:\((?P<users>.*)\)\s*$")
_PID = re.compile(r"pid=(\d+)")


def mlp_keys(features: int, hidden: Sequence[int], classes: int) -> list[tuple[str, int]]:
    """The ``mlp``'s parameters in the Trainer's key order, with their sizes (values)."""
    out, width = [], features
    for i, units in enumerate([*hidden, classes]):
        out += [(f"dense{i}_weight", width * units), (f"dense{i}_bias", units)]
        width = units
    return out


def imbalance(values: Sequence[float]) -> float:
    """Largest ÷ mean (1.0 is even; the project's goal is ≤ 1.5)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean else float("inf")


def ranked(values: Sequence[float]) -> list[float]:
    """Largest first: how a prediction per ps-lite rank is compared with a measurement per role."""
    return sorted(values, reverse=True)


def shares(values: Sequence[float]) -> list[float]:
    total = sum(values)
    return [v / total if total else 0.0 for v in values]


def socket_bytes(pids: set[int]) -> dict[tuple[int, str, str], tuple[int, int]]:
    """``(pid, local, peer) → (bytes received, bytes sent and acknowledged)`` of every established
    TCP socket the processes ``pids`` hold (``ss -tinpH``)."""
    text = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True,
                          timeout=30, check=True).stdout
    out: dict[tuple[int, str, str], tuple[int, int]] = {}
    head = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            m = _SOCKET.match(line)
            head = m if m and any(int(p) in pids for p in _PID.findall(m["users"])) else None
            continue
        if head is None:
            continue
        rx = re.search(r"\bbytes_received:(\d+)", line)
        tx = re.search(r"\bbytes_acked:(\d+)", line)
        for pid in {int(p) for p in _PID.findall(head["users"])} & pids:
            out[(pid, head["local"], head["peer"])] = (int(rx[1]) if rx else 0, int(tx[1]) if tx else 0)
        head = None
    return out


@dataclass
class ServerLoad:
    """What one server role (every attempt's process under its name) did."""

    rss_first: int = 0  # bytes, at its first sample (the process may not have imported mxnet yet)
    rss_peak: int = 0
    rss: list[tuple[float, int]] = field(default_factory=list)  # (time.time(), bytes) of every sample
    sockets: dict[tuple[int, str, str], tuple[int, int]] = field(default_factory=dict)

    def rss_before(self, t: float) -> int:
        """The last RSS sampled before ``t`` (``time.time()``; the first sample if none was)."""
        before = [value for ts, value in self.rss if ts < t]
        return before[-1] if before else self.rss_first

    @property
    def received(self) -> int:
        return sum(rx for rx, _ in self.sockets.values())

    @property
    def sent(self) -> int:
        return sum(tx for _, tx in self.sockets.values())


class ServerSampler:
    """Samples the servers of the local cluster(s) under ``home`` every ``every_s`` seconds
    until ``stop`` (use as a context manager around the job)."""

    def __init__(self, home: str, every_s: float = 1.0) -> None:
        self.home, self.every_s = home, every_s
        # (attempt, role name) → its load: a restart in place starts new servers, which ps-lite
        # ranks anew (the role holding rank 0's keys changed between attempts in the 100 M run),
        # so shares are per attempt.
        self.load: dict[tuple[str, str], ServerLoad] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="server-sampler", daemon=True)
        self.errors: list[str] = []

    def __enter__(self) -> ServerSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def servers(self) -> dict[int, tuple[str, str]]:
        """pid → (attempt, role name) of every server process (leaders and their group) running now."""
        out: dict[int, tuple[str, str]] = {}
        clusters = os.path.join(self.home, "clusters")
        for cluster in os.listdir(clusters) if os.path.isdir(clusters) else []:
            procs = os.path.join(clusters, cluster, "procs")
            for attempt in os.listdir(procs) if os.path.isdir(procs) else []:
                for rec in load_records(os.path.join(procs, attempt)):
                    if rec.name.startswith("server-") and rec.is_running():
                        out.update({pid: (attempt, rec.name) for pid in [rec.pid, *rec.processes()]})
        return out

    def sample(self) -> None:
        servers = self.servers()
        if not servers:
            return
        rss: dict[tuple[str, str], int] = {}
        for pid, name in servers.items():
            try:
                rss[name] = rss.get(name, 0) + psutil.Process(pid).memory_info().rss
            except psutil.Error:
                continue
        for name, value in rss.items():
            load = self.load.setdefault(name, ServerLoad(rss_first=value))
            load.rss_peak = max(load.rss_peak, value)
            load.rss.append((time.time(), value))
        for (pid, local, peer), (rx, tx) in socket_bytes(set(servers)).items():
            load = self.load.setdefault(servers[pid], ServerLoad())
            old = load.sockets.get((pid, local, peer), (0, 0))
            load.sockets[(pid, local, peer)] = (max(old[0], rx), max(old[1], tx))

    def attempts(self) -> list[dict[str, ServerLoad]]:
        """Each attempt's servers (role name → load), in the order the attempts started."""
        out: dict[str, dict[str, ServerLoad]] = {}
        for (attempt, name), load in self.load.items():
            out.setdefault(attempt, {})[name] = load
        return [out[a] for a in sorted(out)]

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - a sampling error is reported, never kills the job
                self.errors.append(f"{type(exc).__name__}: {exc}")
        try:
            self.sample()
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"{type(exc).__name__}: {exc}")
