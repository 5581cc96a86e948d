"""Several test hosts on this machine: network namespaces linked by veth pairs and a bridge.

Each host ``<prefix>h<i>`` has one interface ``eth0`` with address ``10.213.0.<i+1>/24``; the
bridge lives in a namespace of its own (``<prefix>sw``), so no address is added to this
machine's own network namespace and no traffic leaves the namespaces. Hosts share this
machine's filesystem and process table: that is how the tests read the job and shards (a local
folder, as an NFS/EFS mount would be on real hosts) and prove that no role is left behind.

Needs root (``ip netns add``); ``netns_available()`` says whether this machine allows it.
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SUBNET = "10.213.0"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def netns_available() -> str:
    """Empty if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    probe = f"mxprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"ip netns add failed: {getattr(exc, 'stderr', exc)}"
    _ip("netns", "del", probe, check=False)
    return ""


def netns_pids(name: str) -> list[int]:
    out = _ip("netns", "pids", name, check=False)
    return [int(p) for p in out.stdout.split()]


def hosts_pids(hosts: list[dict]) -> list[int]:
    """Every process running in one of ``hosts`` (a role, or a transport's shell around it)."""
    return [pid for host in hosts for pid in netns_pids(host["name"])]


@contextmanager
def namespace_hosts(count: int, prefix: str | None = None) -> Iterator[list[dict]]:
    """Yield ``count`` host dicts (``infra.transport.HostSpec`` fields) and delete every
    namespace afterwards, also when the body failed."""
    prefix = prefix or f"mx{os.getpid() % 100000}"
    switch = f"{prefix}sw"
    made: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        hosts = []
        for i in range(count):
            ns = f"{prefix}h{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", switch)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            hosts.append({"name": ns, "address": f"{SUBNET}.{i + 1}", "transport": "netns", "netns": ns,
                          "python": sys.executable, "workdir": REPO, "interface": "eth0"})
        yield hosts
    finally:
        leftovers = {ns: netns_pids(ns) for ns in made}
        for pids in leftovers.values():  # never leave a test's process running in a deleted namespace
            for pid in pids:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for ns in reversed(made):
            _ip("netns", "del", ns, check=False)
        stuck = {ns: pids for ns, pids in leftovers.items() if pids}
        if stuck:
            raise AssertionError(f"processes were still running in test namespaces: {stuck}")
