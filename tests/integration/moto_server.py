"""A moto server (``moto_server``, moto's stand-alone HTTP server mode) on 127.0.0.1.

EC2, SSM, IAM, S3 and CloudFormation cannot run here for real, so the EC2 backend and the
CloudFormation templates are tested against moto's implementation of those APIs, spoken to over
HTTP with the real boto3 clients. The server runs in a process group of its own and is stopped
by signalling the group. moto launches no machines and runs no SSM command: tests check the
calls and the state the API reports, not a training job on the instances.
"""
from __future__ import annotations

import os
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

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
