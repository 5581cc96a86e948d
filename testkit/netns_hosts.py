"""Several test hosts on this machine: network namespaces linked by veth pairs and a bridge.

Each host ``<prefix>h<i>`` has one interface ``eth0`` with address ``<subnet>.<i+1>/24``; the
bridge lives in a namespace of its own (``<prefix>sw``), where host *i*'s link ends in port
``p<i>``. By default no address is added to this machine's own network namespace and no traffic
leaves the namespaces (subnet ``10.213.0``, the same for every caller: each set is isolated).

``controller=True`` also links this machine's own namespace to the bridge, as the machine that
runs the supervisor sits on the hosts' network: an address ``<subnet>.254`` on a veth here
(``controller_address``), on a subnet of its own (``10.214.N``, N unused here), so concurrent
sets never share a route. Over it the ssh client reaches each host's sshd (``ssh_hosts``), and
a server bound to that address (the tests' S3) is reached by the hosts over their veths.

``shape_link`` constrains a host's link: a ``tc`` ``tbf`` qdisc on both ends (its ``eth0`` for
what it sends, the bridge port for what it receives) for a bandwidth, and random packet loss.

Hosts share this machine's filesystem and process table: that is how the tests prove that no
role is left behind. Needs root (``ip netns add``); ``netns_available()`` and
``sshd_available()`` say whether this machine allows it.
"""
from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from infra.netns import SBIN_PATH as _SBIN_PATH
from infra.netns import add_host, add_switch, add_uplink, delete_namespaces, netns_pids
from infra.netns import ip as _ip
from infra.netns import keygen as _keygen
from infra.netns import sshd_config as _sshd_config
from testkit import REPO

SUBNET = "10.213.0"
CONTROLLER_NET = "10.214"
CONTROLLER_HOST = 254
SSHD_READY_S = 30.0


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30, check=True)


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


def sshd_available() -> str:
    """Empty if namespace hosts with an OpenSSH server each can be made here, else why not."""
    why = netns_available()
    if why:
        return why
    missing = [tool for tool in ("sshd", "ssh", "ssh-keygen") if not shutil.which(tool, path=_SBIN_PATH)]
    return f"OpenSSH not installed (missing {', '.join(missing)}; Debian: openssh-server)" if missing else ""


def hosts_pids(hosts: list[dict]) -> list[int]:
    """Every process running in one of ``hosts`` (a role, or a transport's shell around it), but
    the host's own sshd listener (``ssh_hosts``)."""
    return [pid for host in hosts for pid in netns_pids(host["name"])
            if pid != host.get("extra", {}).get("sshd_pid")]


def controller_address(hosts: list[dict]) -> str:
    """This machine's address on the hosts' bridge (``namespace_hosts(controller=True)``)."""
    return f"{hosts[0]['address'].rsplit('.', 1)[0]}.{CONTROLLER_HOST}"


def _free_controller_subnet() -> str:
    used = _ip("-4", "-o", "addr", "show").stdout
    start = os.getpid() % 200
    for n in range(200):
        subnet = f"{CONTROLLER_NET}.{(start + n) % 200 + 20}"
        if f" {subnet}." not in used:
            return subnet
    raise RuntimeError(f"no free {CONTROLLER_NET}.N subnet on this machine")


@contextmanager
def namespace_hosts(count: int, prefix: str | None = None, *, controller: bool = False) -> Iterator[list[dict]]:
    """Yield ``count`` host dicts (``infra.transport.HostSpec`` fields) and delete every
    namespace (and the controller's link) afterwards, also when the body failed."""
    prefix = prefix or f"mx{os.getpid() % 100000}"
    switch = f"{prefix}sw"
    subnet = _free_controller_subnet() if controller else SUBNET
    made: list[str] = []
    uplink = f"{prefix}c"
    try:
        add_switch(switch)
        made.append(switch)
        hosts = []
        for i in range(count):
            ns = f"{prefix}h{i}"
            made.append(ns)  # before it exists: a half-made host is deleted too
            add_host(switch, ns, f"p{i}", f"{subnet}.{i + 1}")
            hosts.append({"name": ns, "address": f"{subnet}.{i + 1}", "transport": "netns", "netns": ns,
                          "python": sys.executable, "workdir": REPO, "interface": "eth0"})
        if controller:
            add_uplink(switch, uplink, f"{subnet}.{CONTROLLER_HOST}")
        yield hosts
    finally:
        stuck = delete_namespaces(made, uplink if controller else None)
        if stuck:
            raise AssertionError(f"processes were still running in test namespaces: {stuck}")


def _link_ends(host: dict) -> list[tuple[str, str]]:
    """(namespace, device) of both ends of ``host``'s link: its eth0 and its bridge port."""
    prefix, index = host["netns"].rsplit("h", 1)
    return [(host["netns"], "eth0"), (f"{prefix}sw", f"p{index}")]


def tbf_burst_bytes(rate_mbit: float) -> int:
    """``shape_link``'s tbf bucket: at least one jiffy's worth at the rate (and a few full
    frames), else tbf cannot reach the rate. The planner's model of these links counts it."""
    return max(int(rate_mbit * 1e6 / 8 / 250), 16 * 1514)


def shape_link(host: dict, *, rate_mbit: float | None = None, loss_pct: float = 0.0) -> None:
    """Constrain ``host``'s link in both directions: ``tbf`` at ``rate_mbit`` on both ends, and
    ``loss_pct`` of the packets it sends or receives dropped at random.

    Loss is an nftables rule in the host's namespace (``numgen random``), not ``netem``: the
    kernels these tests run on may lack netem (``CONFIG_NET_SCH_NETEM`` unset here), while
    nf_tables is common; the effect on TCP is the same, a random fraction of segments lost.
    """
    for ns, dev in _link_ends(host):
        if _has_qdisc(ns, dev):
            _tc("-n", ns, "qdisc", "del", "dev", dev, "root")
        if rate_mbit:
            # The queue holds 200 ms, then tbf drops as a router would.
            burst = tbf_burst_bytes(rate_mbit)
            _tc("-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
                "latency", "200ms")
    _nft(host, "delete table inet mxloss", check=False)
    if loss_pct:
        per_mille = int(round(loss_pct * 10))
        _nft(host, "add table inet mxloss")
        for chain in ("input", "output"):
            _nft(host, f"add chain inet mxloss {chain} {{ type filter hook {chain} priority 0 ; }}")
            _nft(host, f"add rule inet mxloss {chain} oifname != lo iifname != lo numgen random mod 1000 < "
                       f"{per_mille} counter drop" if chain == "output" else
                 f"add rule inet mxloss {chain} iifname != lo numgen random mod 1000 < {per_mille} counter drop")


def _nft(host: dict, rule: str, *, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", host["netns"], "nft", *rule.split()], capture_output=True,
                          text=True, timeout=30, check=check)


def shaping_available() -> str:
    """Empty if ``shape_link`` can run here (``tc`` and ``nft``), else why not."""
    missing = [tool for tool in ("tc", "nft") if not shutil.which(tool, path=_SBIN_PATH)]
    return f"missing {', '.join(missing)} (Debian: iproute2, nftables)" if missing else ""


def _has_qdisc(ns: str, dev: str) -> bool:
    out = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True, timeout=30)
    return "tbf" in out.stdout


def clear_link(host: dict) -> None:
    """Remove what ``shape_link`` put on ``host``'s link."""
    shape_link(host)


def link_stats(host: dict) -> dict[str, int]:
    """Bytes ``host`` received and sent on its eth0, and packets its link dropped (tbf, loss)."""
    base = "/sys/class/net/eth0/statistics"
    out = subprocess.run(["ip", "netns", "exec", host["netns"], "cat", f"{base}/rx_bytes", f"{base}/tx_bytes"],
                         capture_output=True, text=True, timeout=30, check=True).stdout.split()
    dropped = 0
    for ns, dev in _link_ends(host):
        shown = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True,
                               timeout=30).stdout
        dropped += sum(int(n) for n in re.findall(r"dropped (\d+)", shown))
    rules = _nft(host, "list table inet mxloss", check=False).stdout
    lost = sum(int(n) for n in re.findall(r"counter packets (\d+)", rules))
    return {"rx_bytes": int(out[0]), "tx_bytes": int(out[1]), "dropped": dropped, "lost": lost}


@contextmanager
def ssh_hosts(hosts: list[dict], root: Path) -> Iterator[list[dict]]:
    """An OpenSSH server on each of ``hosts`` (``namespace_hosts(controller=True)``), reached from
    this machine with a key made here and host keys pinned in a ``known_hosts`` made here.

    Yields the same hosts with the ``ssh`` transport. Every sshd is stopped (its process group)
    afterwards, also when the body failed.
    """
    from infra.transport import HostSpec, run_on

    root.mkdir(parents=True, exist_ok=True)
    key = root / "id_ed25519"
    _keygen(key, "mxpipe-test-client")
    authorized = root / "authorized_keys"
    shutil.copy(f"{key}.pub", authorized)
    known = root / "known_hosts"
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
    sshd = shutil.which("sshd", path=_SBIN_PATH)
    procs: list[subprocess.Popen] = []
    try:
        lines = []
        for host in hosts:
            folder = root / host["name"]
            folder.mkdir()
            host_key = folder / "host_ed25519"
            _keygen(host_key, host["name"])
            lines.append(f"{host['address']} {' '.join(Path(f'{host_key}.pub').read_text().split()[:2])}\n")
            config = folder / "sshd_config"
            config.write_text(_sshd_config(host["address"], host_key, authorized, folder))
            with open(folder / "sshd.log", "wb") as log:
                procs.append(subprocess.Popen(["ip", "netns", "exec", host["netns"], sshd, "-D", "-e", "-f",
                                               str(config)], stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True))
        known.write_text("".join(lines))
        reached = [{**h, "transport": "ssh", "ssh_user": getpass.getuser(), "ssh_key": str(key),
                    "known_hosts": str(known), "extra": {"sshd_pid": proc.pid}} for h, proc in zip(hosts, procs)]
        for host in reached:
            _wait_for_sshd(HostSpec.from_dict(host), run_on, procs, root)
        yield reached
    finally:
        for proc in procs:
            _stop_group(proc)


def _wait_for_sshd(host: object, run_on: object, procs: list[subprocess.Popen], root: Path) -> None:
    deadline = time.monotonic() + SSHD_READY_S
    while True:
        try:
            run_on(host, "true", timeout_s=10)  # type: ignore[operator]
            return
        except (RuntimeError, TimeoutError) as exc:
            dead = [p.args for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = {p.name: p.read_text()[-500:] for p in root.glob("*/sshd.log")}
                raise RuntimeError(f"sshd on {host.name} not ready ({exc}); exited: {dead}; logs: {logs}") from exc  # type: ignore[attr-defined]
            time.sleep(0.3)


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
