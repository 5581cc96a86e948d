"""Every S3 request of a job's processes, counted where it is made: a boto3 event hook.

``hook_dir(folder)`` writes a ``sitecustomize.py`` into ``folder``; a process with
``folder`` on its ``PYTHONPATH`` (the roles inherit the supervisor's, ``common.roles.role_env``)
and ``MXPIPE_S3_COUNT_FILE`` set calls ``install()`` at start. From then on every client it
creates appends one JSON line per HTTP request to that file (``before-send``: retries count,
each is a request the server serves) and one per response (``after-call``): time, pid, the
role (``DMLC_ROLE``, or ``supervisor``), operation, key, bytes sent and received. Lines are
single ``O_APPEND`` writes, so many processes share one file. The project's code is unchanged:
the hook patches ``botocore.session.Session.create_client`` in the counted processes only.

A hook rather than SeaweedFS's Prometheus counters: those count by bucket and operation, not by
process or key, and the resume's question is which reads each worker makes.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

ENV = "MXPIPE_S3_COUNT_FILE"
_SITECUSTOMIZE = "from testkit.s3_requests import install\ninstall()\n"


def hook_dir(folder: Path) -> dict[str, str]:
    """Write the ``sitecustomize`` into ``folder``; the ``PYTHONPATH`` that loads it (counting
    starts where ``ENV`` names a file as well)."""
    from testkit import REPO

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    # The checkout too: ``site`` imports sitecustomize before ``-m`` puts the working folder on
    # the path, so a supervisor (started as ``python -m training supervise``) finds testkit only so.
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), REPO, os.environ.get("PYTHONPATH", "")) if p)}


def _write(path: str, line: dict[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def _key(url: str) -> str:
    return unquote(urlsplit(url).path)


def install() -> None:
    """Count this process's S3 requests into ``$MXPIPE_S3_COUNT_FILE`` (nothing when unset)."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        import botocore.session
    except ImportError:
        return
    role = os.environ.get("DMLC_ROLE", "supervisor")
    original = botocore.session.Session.create_client

    def sent(request: Any, **kwargs: Any) -> None:
        body = request.body
        size = len(body) if isinstance(body, (bytes, bytearray)) else int(request.headers.get("Content-Length", 0) or 0)
        _write(path, {"t": time.time(), "pid": os.getpid(), "role": role, "kind": "request",
                      "op": kwargs.get("event_name", "").rsplit(".", 1)[-1], "key": _key(request.url), "out": size})

    def answered(http_response: Any, model: Any, **kwargs: Any) -> None:
        size = int(http_response.headers.get("content-length", 0) or 0) if http_response is not None else 0
        _write(path, {"t": time.time(), "pid": os.getpid(), "role": role, "kind": "response", "op": model.name,
                      "status": getattr(http_response, "status_code", 0), "in": size,
                      "key": _key(getattr(http_response, "url", "") or "")})

    def create_client(self: Any, service_name: str, *args: Any, **kwargs: Any) -> Any:
        client = original(self, service_name, *args, **kwargs)
        if service_name == "s3":
            client.meta.events.register("before-send.s3", sent)
            client.meta.events.register("after-call.s3", answered)
        return client

    botocore.session.Session.create_client = create_client  # type: ignore[method-assign]


def read(count_file: Path) -> list[dict[str, Any]]:
    if not count_file.exists():
        return []
    out = []
    for line in count_file.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            continue
    return out


def _part(key: str) -> str:
    return "checkpoints" if "/checkpoints/" in key else "shards" if "/shards/" in key else "other"


def summary(lines: list[dict[str, Any]], start: float, end: float) -> dict[str, Any]:
    """Requests and bytes between ``start`` and ``end``: in all, by role kind, and the workers'
    by what they read (``checkpoints/``, ``shards/``, anything else), and the busiest second."""
    window = [ln for ln in lines if start <= ln["t"] <= end]
    requests = [ln for ln in window if ln["kind"] == "request"]
    responses = [ln for ln in window if ln["kind"] == "response"]
    by_role: dict[str, int] = {}
    for ln in requests:
        by_role[ln["role"]] = by_role.get(ln["role"], 0) + 1
    worker_reads: dict[str, dict[str, int]] = {}
    for ln in window:
        if ln["role"] != "worker":
            continue
        got = worker_reads.setdefault(_part(ln.get("key", "")), {"requests": 0, "bytes_in": 0})
        got["requests"] += ln["kind"] == "request"
        got["bytes_in"] += ln.get("in", 0)
    per_second: dict[int, int] = {}
    for ln in requests:
        per_second[int(ln["t"])] = per_second.get(int(ln["t"]), 0) + 1
    return {"requests": len(requests), "bytes_in": sum(ln.get("in", 0) for ln in responses),
            "bytes_out": sum(ln.get("out", 0) for ln in requests), "by_role": by_role,
            "worker_by_part": worker_reads,
            "worker_bytes_in": sum(ln.get("in", 0) for ln in responses if ln["role"] == "worker"),
            "peak_requests_per_s": max(per_second.values(), default=0),
            "ops": sorted({ln["op"] for ln in requests})}
