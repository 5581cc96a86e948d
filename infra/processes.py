"""Service processes: launch in a session of their own, stop the whole session, bounded waits.

Every service is started in a session (and process group) of its own and stopped by signalling
the whole session, SIGTERM then SIGKILL after a bound (``common.procs.stop_groups``): MLflow
and Airflow fork helpers, and Airflow task processes move to process groups of their own but
stay in the session. Before a stop signals anything it checks that the pid still is the process
it launched (the start time recorded at launch). Under the stack's home::

    run/<name>.json    one pid file per service: pid, process group, start time, port, log
    logs/<name>.log    stdout+stderr of each service
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from common.procs import group_members, is_running, start_time, still_ours, stop_groups
from infra.stack_config import ServiceError

log = logging.getLogger(__name__)

SIGKILL_WAIT_S = 10.0


@dataclass
class ServiceHandle:
    """One launched service: the leader of its own session/process group."""

    name: str
    pid: int
    pgid: int
    start_time: int  # common.procs.start_time, to tell our process from a reused pid
    log_path: str
    port: int | None = None
    cmd: list[str] = field(default_factory=list)
    started_at: float = 0.0
    pid_file: str | None = None
    _popen: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def is_running(self) -> bool:
        return is_running(self.pid, self.start_time)

    def owns_group(self) -> bool:
        """False if the pid now belongs to another process (then its group is not ours)."""
        return still_ours(self.pid, self.start_time)

    def processes(self) -> list[int]:
        return [p.pid for p in group_members([self.pgid], sessions=True)] if self.owns_group() else []

    def stop(self, timeout: float = 20.0) -> bool:
        """SIGTERM the whole session, SIGKILL what is left after ``timeout``; True if all gone."""
        if not self.owns_group():
            log.warning("%s: pid %s was reused by another process; not signalling", self.name, self.pid)
            self._remove_pid_file()
            return True
        left = stop_groups([self.pgid], grace_s=timeout, kill_wait_s=SIGKILL_WAIT_S, sessions=True)
        self._reap()
        if left:
            log.error("%s: processes %s survived SIGKILL", self.name, [p.pid for p in left])
            return False
        self._remove_pid_file()
        return True

    def _reap(self) -> None:
        if self._popen is not None:
            self._popen.poll()

    def _remove_pid_file(self) -> None:
        if self.pid_file:
            Path(self.pid_file).unlink(missing_ok=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 16384))
                text = fh.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ServiceHandle":
        return cls(**json.loads(text))


def launch(name: str, cmd: list[str], env: Mapping[str, str], home: Path, *,
           port: int | None = None, cwd: str | os.PathLike[str] | None = None) -> ServiceHandle:
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
    handle = ServiceHandle(name=name, pid=popen.pid, pgid=popen.pid,
                           start_time=start_time(popen.pid) or 0, log_path=str(log_path),
                           port=port, cmd=list(cmd), started_at=time.time(),
                           pid_file=str(run / f"{name}.json"), _popen=popen)
    Path(handle.pid_file).write_text(handle.to_json())  # type: ignore[arg-type]
    log.info("%s: started pid %s (log %s)", name, popen.pid, log_path)
    return handle


def load_handle(home: Path, name: str) -> ServiceHandle | None:
    path = home / "run" / f"{name}.json"
    if not path.exists():
        return None
    return ServiceHandle.from_json(path.read_text())


def running_handle(home: Path, name: str) -> ServiceHandle | None:
    """The recorded handle if that process still runs; stale records are cleaned up."""
    handle = load_handle(home, name)
    if handle is None:
        return None
    if handle.is_running():
        return handle
    handle.stop(timeout=5)  # leader gone: stop any helper it left behind, drop the pid file
    return None


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, *,
               interval_s: float = 0.5, handle: ServiceHandle | None = None) -> Any:
    """Poll ``predicate`` until it returns a truthy value; bounded, fails early if ``handle`` dies."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        if handle is not None and not handle.is_running():
            handle._reap()
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
              interval_s: float = 0.5, handle: ServiceHandle | None = None) -> bytes:
    """Poll ``url`` until it answers 200 (and ``check(body)`` holds); returns the body."""

    def ready() -> bytes | None:
        status, body = http_get(url, timeout_s=min(5.0, timeout_s))
        if status != 200:
            raise ServiceError(f"HTTP {status}: {body[:200]!r}")
        return body if check is None or check(body) else None

    return wait_until(ready, timeout_s, url, interval_s=interval_s, handle=handle)


def stop_all(handles: Iterable[ServiceHandle], timeout: float = 30.0) -> bool:
    from concurrent.futures import ThreadPoolExecutor

    handles = list(handles)
    if not handles:
        return True
    with ThreadPoolExecutor(max_workers=len(handles)) as pool:
        return all(pool.map(lambda h: h.stop(timeout), handles))
