"""Hosts made of network namespaces of this machine: a bridge in a namespace of its own, one
namespace per host linked to it by a veth pair, and an OpenSSH server's configuration for a host.

The primitives behind ``testkit.netns_hosts`` (throwaway hosts of one test) and
``infra.topology`` (the scaled-out deployment, brought up and torn down by separate commands,
so nothing here is a context manager). Host ``<prefix>h<i>`` (or a name of its own) has one
interface ``eth0``; the bridge ``br0`` lives in ``<prefix>sw``, where a host's link ends in a
port of the bridge. ``add_uplink`` links this machine's own namespace to the bridge (a veth
with an address here), so a client here reaches the hosts' servers.

Needs root (``ip netns add``).
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

# Where sshd, nft, tc and redis-server are looked for (``shutil.which(tool, path=SBIN_PATH)``):
# /usr/sbin is not on a non-login root shell's PATH.
SBIN_PATH = os.pathsep.join(["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
IP_TIMEOUT_S = 30.0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


def netns_pids(name: str) -> list[int]:
    """Every process running in namespace ``name`` (none if it does not exist)."""
    out = ip("netns", "pids", name, check=False)
    return [int(p) for p in out.stdout.split()]


def namespaces(prefix: str) -> list[str]:
    """The namespaces of this machine whose name starts with ``prefix``."""
    names = [line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def add_switch(switch: str) -> None:
    """A namespace holding the bridge ``br0`` every host's link ends on."""
    ip("netns", "add", switch)
    ip("-n", switch, "link", "add", "br0", "type", "bridge")
    ip("-n", switch, "link", "set", "br0", "up")


def add_host(switch: str, ns: str, port: str, address: str, prefix_len: int = 24) -> None:
    """Namespace ``ns`` with ``eth0`` at ``address``, its peer ``port`` a port of the bridge."""
    ip("netns", "add", ns)
    ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", switch)
    ip("-n", switch, "link", "set", port, "master", "br0", "up")
    ip("-n", ns, "addr", "add", f"{address}/{prefix_len}", "dev", "eth0")
    ip("-n", ns, "link", "set", "eth0", "up")
    ip("-n", ns, "link", "set", "lo", "up")


def add_uplink(switch: str, device: str, address: str, prefix_len: int = 24, port: str = "pc") -> None:
    """A veth ``device`` in this machine's namespace at ``address``, its peer on the bridge."""
    ip("link", "add", device, "type", "veth", "peer", "name", port, "netns", switch)
    ip("-n", switch, "link", "set", port, "master", "br0", "up")
    ip("addr", "add", f"{address}/{prefix_len}", "dev", device)
    ip("link", "set", device, "up")


def delete_namespaces(names: list[str], uplink: str | None = None) -> dict[str, list[int]]:
    """Kill whatever still runs in ``names`` (SIGKILL), delete them and the ``uplink`` device.

    Returns the processes that were still running (by namespace): a caller that stopped its
    servers first treats any as a leak.
    """
    if uplink:
        ip("link", "del", uplink, check=False)  # gone with the switch too; never leave it here
    leftovers = {ns: netns_pids(ns) for ns in names}
    for pids in leftovers.values():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for ns in reversed(names):
        ip("netns", "del", ns, check=False)
    return {ns: pids for ns, pids in leftovers.items() if pids}


def link_exists(device: str) -> bool:
    return ip("link", "show", device, check=False).returncode == 0


def keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True, timeout=30)


def sshd_config(address: str, host_key: Path, authorized: Path, folder: Path) -> str:
    return "\n".join([
        f"ListenAddress {address}:22", f"HostKey {host_key}", f"PidFile {folder / 'sshd.pid'}",
        f"AuthorizedKeysFile {authorized}", "PubkeyAuthentication yes", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "PermitRootLogin prohibit-password", "UsePAM no",
        # The key files live in a folder of the caller's, not in a home sshd would vet.
        "StrictModes no",
        # A job opens several sessions per host at once (roles, the env file, kill-records).
        "MaxStartups 64", "MaxSessions 64", "LogLevel ERROR", ""])


def host_address() -> str:
    """This host's address (``MXPIPE_HOST_ADDRESS``, set for every server of
    ``infra.topology``): Airflow's ``[core] hostname_callable`` there, since every namespace
    shares this machine's hostname and a task log must name the worker it is on."""
    from common.settings import settings

    address = settings().host_address
    if not address:
        raise RuntimeError("MXPIPE_HOST_ADDRESS is not set: infra.netns.host_address is the topology's hostname_callable")
    return address
