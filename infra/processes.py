"""Service processes: launch in a session of their own, stop the whole session, bounded waits.

Every service is started in a session (and process group) of its own, recorded as a
``common.procs.GroupRecord``, and stopped by signalling the whole session, SIGTERM then SIGKILL
after a bound (``GroupRecord.stop``): MLflow and Airflow fork helpers, and Airflow task processes
move to process groups of their own but stay in the session. Before a stop signals anything it
checks that the pid still is the process it launched (the start time recorded at launch). Under
the stack's home::

    run/<name>.json    one pid file per service: pid, process group, start time, port, log
    logs/<name>.log    stdout+stderr of each service
"""
from __future__ import annotations

import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from common.procs import GroupRecord, start_time
from infra.stack_config import ServiceError

log = logging.getLogger(__name__)


def launch(name: str, cmd: list[str], env: Mapping[str, str], home: Path, *,
           port: int | None = None, cwd: str | os.PathLike[str] | None = None) -> GroupRecord:
    """Start ``cmd`` in a new session, output to ``<home>/logs/<name>.log``, pid file in run/."""
    logs, run = home / "logs", home / "run"
    logs.mkdir(parents=True, exist_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    with open(log_path, "ab") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} start: {' '.join(cmd)}\n".encode())
        out.flush()
        popen = subprocess.Popen(cmd, env=dict(env), cwd=cwd or home, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    handle = GroupRecord(name=name, pid=popen.pid, pgid=popen.pid,
                         start_time=start_time(popen.pid) or 0, log_path=str(log_path),
                         port=port, cmd=tuple(cmd), started_at=time.time(),
                         pid_file=str(run / f"{name}.json"), _popen=popen)
    Path(handle.pid_file).write_text(handle.to_json())  # type: ignore[arg-type]
    log.info("%s: started pid %s (log %s)", name, popen.pid, log_path)
    return handle


def load_handle(home: Path, name: str) -> GroupRecord | None:
    """The record of service ``name`` under ``home`` (its pid file), None if there is none."""
    path = home / "run" / f"{name}.json"
    if not path.exists():
        return None
    return GroupRecord.from_json(path.read_text())


def running_handle(home: Path, name: str) -> GroupRecord | None:
    """The recorded handle if that process still runs; stale records are cleaned up."""
    handle = load_handle(home, name)
    if handle is None:
        return None
    if handle.is_running():
        return handle
    handle.stop(timeout=5)  # leader gone: stop any helper it left behind, drop the pid file
    return None


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, *,
               interval_s: float = 0.5, handle: GroupRecord | None = None) -> Any:
    """Poll ``predicate`` until it returns a truthy value; bounded, fails early if ``handle`` dies."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        if handle is not None and not handle.is_running():
            handle.reap()
            raise ServiceError(f"{handle.name} exited while waiting for {what}; log tail:\n"
                               f"{handle.log_tail()}")
        try:
            result = predicate()
            if result:
                return result
        except Exception as exc:  # noqa: BLE001 - any failure means "not ready yet"
            last = exc
        if time.monotonic() >= deadline:
            tail = f"; log tail:\n{handle.log_tail()}" if handle else ""
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f}s (last error: {last}){tail}")
        time.sleep(interval_s)


# Health checks go to 127.0.0.1 only: never through an HTTP(S)_PROXY from the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with _NO_PROXY_OPENER.open(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_http(url: str, timeout_s: float, *, check: Callable[[bytes], bool] | None = None,
              interval_s: float = 0.5, handle: GroupRecord | None = None) -> bytes:
    """Poll ``url`` until it answers 200 (and ``check(body)`` holds); returns the body."""

    def ready() -> bytes | None:
        status, body = http_get(url, timeout_s=min(5.0, timeout_s))
        if status != 200:
            raise ServiceError(f"HTTP {status}: {body[:200]!r}")
        return body if check is None or check(body) else None

    return wait_until(ready, timeout_s, url, interval_s=interval_s, handle=handle)


def stop_all(handles: Iterable[GroupRecord], timeout: float = 30.0) -> bool:
    from concurrent.futures import ThreadPoolExecutor

    handles = list(handles)
    if not handles:
        return True
    with ThreadPoolExecutor(max_workers=len(handles)) as pool:
        return all(pool.map(lambda h: h.stop(timeout), handles))
