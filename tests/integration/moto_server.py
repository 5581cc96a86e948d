"""A moto server (``moto_server``, moto's stand-alone HTTP server mode) on 127.0.0.1.

EC2, SSM, IAM, S3 and CloudFormation cannot run here for real, so the EC2 backend and the
CloudFormation templates are tested against moto's implementation of those APIs, spoken to over
HTTP with the real boto3 clients. The server runs in a process group of its own and is stopped
by signalling the group. moto launches no machines and runs no SSM command: tests check the
calls and the state the API reports, not a training job on the instances. Where what a command
does matters (the ec2 backend's supervisor start), ``LocalSsmAgent`` stands in for the
instances' SSM agent and runs the commands on this machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from common.procs import GroupSpawner, Watch, free_port

START_TIMEOUT_S = 60.0


@contextmanager
def moto_server(log_dir: str) -> Iterator[str]:
    """Yield the endpoint URL of a fresh moto server; stop it (whole group) afterwards."""
    port = free_port("127.0.0.1")
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    spawner = GroupSpawner(os.path.join(log_dir, "moto-procs"))
    log = open(os.path.join(log_dir, "moto.log"), "w")
    proc = spawner.spawn("moto", [exe, "-H", "127.0.0.1", "-p", str(port)], dict(os.environ), stdout=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start within {START_TIMEOUT_S:.0f}s") from None
                time.sleep(0.2)
        yield url
    finally:
        spawner.kill_all(grace_s=5.0)
        log.close()
        Watch(groups=[proc.pid]).check("the moto server")


class LocalSsmAgent:
    """A stand-in for the SSM agent of moto's instances, which run nothing: registered on an SSM
    client's events (botocore's ``before-parameter-build`` and ``after-call``), it runs every
    ``AWS-RunShellScript`` command that client sends with ``/bin/sh`` on this machine, once per
    instance the call names, at once and side by side (as the agent runs a command apart from
    its sender and from the instance's other commands), and makes that client's
    ``get_command_invocation`` report the process: ``InProgress`` while it runs, then
    ``Success`` or ``Failed`` with its exit code and output. moto still answers every call;
    only these answers' status and output are the agent's."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        # (command id, instance id) → the command's process and its output files' stem
        self.commands: dict[tuple[str, str], tuple[subprocess.Popen, str]] = {}

    def attach(self, ssm: Any) -> None:
        """Run what ``ssm`` (a boto3 SSM client) sends, and answer its invocation reads."""
        ssm.meta.events.register("before-parameter-build.ssm.SendCommand", self._instances)
        ssm.meta.events.register("after-call.ssm.SendCommand", self._run)
        ssm.meta.events.register("after-call.ssm.GetCommandInvocation", self._report)

    @staticmethod
    def _instances(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        # moto's answer lists every instance under the command's InstanceIds: the request names them.
        context["local_ssm_instances"] = list(params.get("InstanceIds", []))

    def _run(self, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        command = parsed.get("Command") or {}
        if command.get("DocumentName") != "AWS-RunShellScript":
            return
        script = "\n".join(command["Parameters"]["commands"])
        for instance in context.get("local_ssm_instances", []):
            stem = os.path.join(self.folder, f"{command['CommandId']}-{instance}")
            with open(f"{stem}.out", "wb") as out, open(f"{stem}.err", "wb") as err:
                proc = subprocess.Popen(["/bin/sh", "-c", script], stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            self.commands[(command["CommandId"], instance)] = (proc, stem)

    def _report(self, parsed: dict[str, Any], **_: Any) -> None:
        found = self.commands.get((parsed.get("CommandId", ""), parsed.get("InstanceId", "")))
        if found is None:
            return
        proc, stem = found
        code = proc.poll()
        if code is None:
            parsed.update(Status="InProgress", ResponseCode=-1, StandardOutputContent="", StandardErrorContent="")
            return
        with open(f"{stem}.out", errors="replace") as out, open(f"{stem}.err", errors="replace") as err:
            parsed.update(Status="Success" if code == 0 else "Failed", ResponseCode=code,
                          StandardOutputContent=out.read(), StandardErrorContent=err.read())

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait, bounded, for every command's process to end; kill any that has not. (What a
        command started detached, such as a supervisor, is the test's to stop.)"""
        deadline = time.monotonic() + timeout_s
        for proc, _ in self.commands.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
