"""A fake EC2 instance metadata service (IMDSv2) on 127.0.0.1: what a spot watcher
(``common.procs.spot``) polls, with an interruption notice a test switches on.

A real HTTP server in a process group of its own (``running_metadata_server``), stopped by
signalling the group like the other test servers; roles reach it through the AWS SDKs' endpoint
setting (``AWS_EC2_METADATA_SERVICE_ENDPOINT``, ``FakeMetadata.env``). It serves what the watch
reads, as IMDSv2 does:

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` (1–21600): a token
  valid that long; 400 without the header or out of range;
- ``GET /latest/meta-data/instance-id`` and ``GET /latest/meta-data/spot/instance-action`` with
  ``X-aws-ec2-metadata-token``: 401 with no token, an unknown or an expired one (IMDSv2 required,
  as the stack's launch template sets); the action is 404 until a notice is on, then
  ``{"action": ..., "time": ...}``; any other path 404.

What a test drives, under ``/_fake/`` (no token needed; nothing of the real service): ``PUT
/_fake/notice`` with the notice's JSON switches it on, ``DELETE`` off; ``POST
/_fake/expire-tokens`` makes every token issued so far expired; ``GET /_fake/stats`` counts the
tokens issued, the notice polls and the refused requests.

    python -m testkit.metadata_server --port 8100 --instance-id i-0123456789abcdef0
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
START_TIMEOUT_S = 30.0
MAX_TTL_S = 21600
DEFAULT_INSTANCE_ID = "i-0fa4e0000000000001"


class _State:
    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.lock = threading.Lock()
        self.tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self.notice: dict[str, Any] | None = None
        self.stats = {"tokens": 0, "action_polls": 0, "refused": 0}


class _Handler(BaseHTTPRequestHandler):
    server_version = "EC2ws"  # what the real service calls itself
    state: _State  # set on the class made by serve()

    def log_message(self, fmt: str, *args: Any) -> None:
        sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    def _reply(self, code: int, body: str = "", content_type: str = "text/plain") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
        st = self.state
        if self.path == TOKEN_PATH:
            try:
                ttl = int(self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
            except ValueError:
                ttl = 0
            if not 1 <= ttl <= MAX_TTL_S:
                self._reply(400, "Bad Request")
                return
            token = secrets.token_urlsafe(32)
            with st.lock:
                st.tokens[token] = time.monotonic() + ttl
                st.stats["tokens"] += 1
            self._reply(200, token)
        elif self.path == "/_fake/notice":
            notice = json.loads(self._body())
            with st.lock:
                st.notice = {"action": notice["action"], "time": notice["time"]}
            self._reply(200, "on")
        else:
            self._reply(404, "Not Found")

    def do_DELETE(self) -> None:  # noqa: N802
        if self.path == "/_fake/notice":
            with self.state.lock:
                self.state.notice = None
            self._reply(200, "off")
        else:
            self._reply(404, "Not Found")

    def do_POST(self) -> None:  # noqa: N802
        if self.path == "/_fake/expire-tokens":
            with self.state.lock:
                self.state.tokens = {t: 0.0 for t in self.state.tokens}
            self._reply(200, "expired")
        else:
            self._reply(404, "Not Found")

    def do_GET(self) -> None:  # noqa: N802
        st = self.state
        if self.path == "/_fake/stats":
            with st.lock:
                self._reply(200, json.dumps(st.stats), "application/json")
            return
        if not self.path.startswith("/latest/meta-data/"):
            self._reply(404, "Not Found")
            return
        token = self.headers.get("X-aws-ec2-metadata-token", "")
        with st.lock:
            valid = time.monotonic() < st.tokens.get(token, 0.0)
            if not valid:
                st.stats["refused"] += 1
            elif self.path == ACTION_PATH:
                st.stats["action_polls"] += 1
            notice = st.notice
        if not valid:
            self._reply(401, "Unauthorized")
        elif self.path == INSTANCE_ID_PATH:
            self._reply(200, st.instance_id)
        elif self.path == ACTION_PATH and notice is not None:
            self._reply(200, json.dumps(notice), "application/json")
        else:
            self._reply(404, "Not Found")


def serve(port: int, instance_id: str) -> None:
    handler = type("Handler", (_Handler,), {"state": _State(instance_id)})
    with ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
        server.serve_forever()


@dataclass
class FakeMetadata:
    """A running fake metadata service: its endpoint and the test's controls."""

    endpoint: str
    instance_id: str
    process: Any = field(repr=False)  # its subprocess.Popen

    @property
    def env(self) -> dict[str, str]:
        """What points a role's spot watch (the AWS SDKs' endpoint setting) here."""
        return {"AWS_EC2_METADATA_SERVICE_ENDPOINT": self.endpoint}

    def watching(self, poll_s: float = 0.1) -> dict[str, str]:
        """A job's environment entries that make each of its roles watch this service (as on a
        spot cluster), polling every ``poll_s``: every backend passes them on to its roles."""
        return {**self.env, "MXPIPE_SPOT_WATCH": "1", "MXPIPE_SPOT_POLL_S": str(poll_s)}

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> str:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.endpoint + path, data=data, method=method)
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.read().decode()

    def notice(self, action: str = "terminate", when: str = "2026-12-06T20:07:00Z") -> None:
        """Switch the interruption notice on (the instance will ``action`` at ``when``)."""
        self._call("PUT", "/_fake/notice", {"action": action, "time": when})

    def clear(self) -> None:
        self._call("DELETE", "/_fake/notice")

    def expire_tokens(self) -> None:
        self._call("POST", "/_fake/expire-tokens", {})

    def stats(self) -> dict[str, int]:
        return json.loads(self._call("GET", "/_fake/stats"))


@contextlib.contextmanager
def running_metadata_server(log_dir: str, *, instance_id: str = DEFAULT_INSTANCE_ID) -> Iterator[FakeMetadata]:
    """A fresh fake metadata service on a free 127.0.0.1 port; stopped (its whole group) afterwards."""
    from common.procs import GroupSpawner, Watch, free_port
    from testkit import REPO
    from testkit.waits import wait_for

    port = free_port("127.0.0.1")
    spawner = GroupSpawner(os.path.join(log_dir, "metadata-procs"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)}
    with open(os.path.join(log_dir, "metadata.log"), "w") as log:
        proc = spawner.spawn("metadata", [sys.executable, "-m", "testkit.metadata_server", "--port", str(port),
                                          "--instance-id", instance_id], env, stdout=log)
    fake = FakeMetadata(endpoint=f"http://127.0.0.1:{port}", instance_id=instance_id, process=proc)

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the fake metadata server exited: see {log_dir}/metadata.log")
        with contextlib.suppress(OSError):
            return fake.stats() is not None
        return False

    try:
        wait_for(up, timeout_s=START_TIMEOUT_S, what="the fake metadata server", poll_s=0.1)
        yield fake
    finally:
        spawner.kill_all(grace_s=5.0)
        proc.wait(timeout=5)
        Watch(groups=[proc.pid]).check("the fake metadata server")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--instance-id", default=DEFAULT_INSTANCE_ID)
    args = parser.parse_args(argv)
    serve(args.port, args.instance_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
