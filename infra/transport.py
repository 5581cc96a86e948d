"""How a command reaches a host of the ``hosts`` backend: over SSH, or through ``ip netns exec``.

Every transport turns one shell command line into the argv of a local process whose stdin,
stdout and exit status are those of the command on the host, so the hosts backend builds the
same command for both and only the carrier differs:

- ``ssh``: ``ssh -o BatchMode=yes … user@address 'COMMAND'``. ``ServerAliveInterval`` ×
  ``ServerAliveCountMax`` bounds how long a dead host or link goes unnoticed (the client exits
  255, which the supervisor reports as that role's failure); ``ConnectTimeout`` bounds the
  start. Killing the local client does not stop the remote command, so the backend stops roles
  on the host itself (``python -m common.procs kill-records``). With ``known_hosts`` the host
  keys are pinned: only that file is consulted and an unknown or changed key is refused
  (``StrictHostKeyChecking=yes``); without it, ``ssh_options`` decide (default: trust on first
  use, ``accept-new``). ``ssh_key`` and ``known_hosts`` may start with ``~``, expanded with the
  ``HOME`` of the process that connects: one hosts list then names each machine's own copy of
  the key (an Airflow worker's, the supervisor's on the first host), so a cluster record written
  on one host works on every other.
- ``netns``: ``ip netns exec NS sh -c 'COMMAND'``: a host that is a network namespace of this
  machine (tests: several hosts with their own addresses, linked by veth pairs and a bridge).
  It shares this machine's filesystem and process table; the network is what is separate.
- ``local``: ``sh -c 'COMMAND'`` on this machine (development, no isolation).
"""
from __future__ import annotations

import os
import shlex
import subprocess
from typing import Any, Literal, get_args

from pydantic import Field, model_validator

from common.config import Strings
from infra.strict_settings import StrictSettings

DEFAULT_STATE_DIR = "/tmp/mxpipe-roles"
Transport = Literal["ssh", "netns", "local"]
TRANSPORTS = get_args(Transport)


class HostSpec(StrictSettings):
    """One host: how to reach it, its address for ps-lite, and where the project lives on it."""

    name: str
    address: str
    transport: Transport = "ssh"
    # The interpreter of an environment that holds this project's dependencies, and the folder
    # holding the project itself (the image or environment of the ClusterSpec, per host).
    python: str = "python3"
    workdir: str = "/opt/mxpipe"
    state_dir: str = DEFAULT_STATE_DIR
    netns: str = ""
    ssh_user: str = ""
    ssh_port: int = Field(22, ge=1, le=65535)
    ssh_key: str = ""
    ssh_options: Strings = ("StrictHostKeyChecking=accept-new",)
    known_hosts: str = ""
    interface: str = ""
    extra: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _combinations(self) -> HostSpec:
        if self.transport == "netns" and not self.netns:
            raise ValueError(f"host {self.name}: the netns transport needs a namespace name")
        return self


def host_argv(host: HostSpec, command: str) -> list[str]:
    """The local argv that runs the shell ``command`` on ``host``."""
    if host.transport == "netns":
        return ["ip", "netns", "exec", host.netns, "sh", "-c", command]
    if host.transport == "local":
        return ["sh", "-c", command]
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5",
            "-o", "ServerAliveCountMax=3", "-p", str(host.ssh_port)]
    if host.known_hosts:
        # Before ssh_options: for each option ssh keeps the first value it is given, so a pinned
        # known_hosts cannot be loosened by the default accept-new.
        argv += ["-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={os.path.expanduser(host.known_hosts)}",
                 "-o", "GlobalKnownHostsFile=/dev/null"]
    for opt in host.ssh_options:
        argv += ["-o", opt]
    if host.ssh_key:
        # Expanded here, not by ssh: ssh expands "~" from the password database, not HOME.
        argv += ["-o", "IdentitiesOnly=yes", "-i", os.path.expanduser(host.ssh_key)]
    target = f"{host.ssh_user}@{host.address}" if host.ssh_user else host.address
    return argv + [target, command]


def in_workdir(host: HostSpec, *argv: str) -> str:
    """A shell command line running ``argv`` from the project folder on ``host``."""
    return f"cd {shlex.quote(host.workdir)} && exec {shlex.join(argv)}"


def role_command(host: HostSpec, *argv: str) -> str:
    """``in_workdir`` for a long-lived role, whose death by a signal must reach the supervisor.

    Over ssh the shell waits for the role instead of becoming it: ssh reports a remote command
    killed by a signal as its own failure (exit 255, like a lost connection), while a shell
    reports a child killed by signal N as 128 + N and ssh passes that through (``exit_status``
    maps it back). ``; exit $?`` keeps the shell from exec-ing the last command itself.
    """
    if host.transport != "ssh":
        return in_workdir(host, *argv)
    return f"cd {shlex.quote(host.workdir)} && {shlex.join(argv)}; exit $?"


def exit_status(host: HostSpec, code: int | None) -> int | None:
    """A role's exit status on ``host`` as a local child's would read: over ssh, a shell's
    128 + N for a role killed by signal N becomes -N (``role_command``); 255 stays ssh's own."""
    if host.transport == "ssh" and code is not None and _SHELL_SIGNAL < code < _SHELL_SIGNAL + 65:
        return _SHELL_SIGNAL - code
    return code


_SHELL_SIGNAL = 128


def run_on(host: HostSpec, command: str, *, timeout_s: float, input_text: str | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run ``command`` on ``host`` to completion (bounded by ``timeout_s``)."""
    try:
        proc = subprocess.run(host_argv(host, command), input=input_text, capture_output=True, text=True,
                              timeout=timeout_s, stdin=None if input_text is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise TimeoutError(f"{host.name}: {command[:120]!r} did not finish within {timeout_s:.0f}s") from exc
    if check and proc.returncode != 0:
        raise RuntimeError(f"{host.name}: {command[:120]!r} failed with exit code {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return proc
