"""A small client for the Airflow 3 REST API v2 (``/api/v2``), every call bounded by a timeout.

Auth (simple auth manager): ``GET /auth/token`` returns ``{"access_token": JWT}`` without
credentials when ``[core] simple_auth_manager_all_admins`` is on (the local stack);
otherwise ``POST /auth/token`` with ``{"username", "password"}``. The JWT goes in an
``Authorization: Bearer`` header; on a 401 the token is fetched again once.

Never imports Airflow: it talks HTTP only, so it works from a shell, a test or a benchmark.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import requests

log = logging.getLogger(__name__)

TERMINAL_RUN_STATES = frozenset({"success", "failed"})
_PAGE = 100  # [api] maximum_page_limit
# The read timeout of a wait's polls: one poll that takes longer is repeated (``_poll``), within the
# wait's own deadline.
POLL_READ_TIMEOUT_S = 30.0
DB_BUSY_RETRIES = 3  # repeats of an idempotent call answered "Database error" (see AirflowClient.request)


class AirflowAPIError(RuntimeError):
    """The API answered with an error status."""


class DagNotFound(TimeoutError):
    """The DAG did not show up in time (the message carries the import errors, if any)."""


class AirflowClient:
    def __init__(self, base_url: str, *, username: str | None = None, password: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._username, self._password = username, password
        self.timeout_s = timeout_s
        self._session = _session_for(self.base_url)
        self._token: str | None = None

    # -- plumbing ---------------------------------------------------------------------------

    def token(self, *, refresh: bool = False) -> str:
        if self._token is None or refresh:
            self._token = get_token(self.base_url, self._username, self._password, self.timeout_s,
                                    session=self._session)
        return self._token

    def request(self, method: str, path: str, *, ok: tuple[int, ...] = (200,),
                **kwargs: Any) -> requests.Response:
        url = f"{self.base_url}/api/v2{path}"
        for busy in range(DB_BUSY_RETRIES + 1):
            for attempt in (0, 1):
                headers = {"Authorization": f"Bearer {self.token(refresh=attempt > 0)}"}
                resp = self._session.request(method, url, headers=headers,
                                             timeout=(5.0, self.timeout_s), **kwargs)
                if resp.status_code != 401:
                    break
            # The API server answers 500 "Database error" when its metadata database is busy (the
            # embedded stack's SQLite on a loaded machine): an idempotent call is worth repeating;
            # a POST is not, since it may have been applied (``trigger`` repeats its own by run id).
            if not (resp.status_code == 500 and "Database error" in resp.text and method.upper() != "POST"
                    and busy < DB_BUSY_RETRIES):
                break
            time.sleep(1.0 + busy)
        if resp.status_code not in ok:
            raise AirflowAPIError(f"{method} {path}: HTTP {resp.status_code}: {resp.text[:500]}")
        return resp

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> "AirflowClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- API --------------------------------------------------------------------------------

    def get_dag(self, dag_id: str) -> dict[str, Any] | None:
        resp = self.request("GET", f"/dags/{dag_id}", ok=(200, 404))
        return resp.json() if resp.status_code == 200 else None

    def import_errors(self) -> list[dict[str, Any]]:
        return self._paged("/importErrors", "import_errors")

    def set_paused(self, dag_id: str, paused: bool) -> None:
        self.request("PATCH", f"/dags/{dag_id}", params={"update_mask": "is_paused"},
                     json={"is_paused": paused})

    def trigger(self, dag_id: str, conf: Mapping[str, Any] | None = None, *,
                logical_date: datetime | str | None = None, run_id: str | None = None) -> str:
        if isinstance(logical_date, datetime):
            if logical_date.tzinfo is None:
                raise ValueError("logical_date must be timezone-aware")
            logical_date = logical_date.isoformat()
        # The run is named here, the way Airflow names a manual run, so that a trigger answered
        # "Database error" (a busy metadata database) can be repeated: a repeat that finds the run
        # already there (409) means the first attempt was applied.
        run_id = run_id or f"manual__{datetime.now(timezone.utc).isoformat()}"
        body: dict[str, Any] = {"logical_date": logical_date, "conf": dict(conf or {}), "dag_run_id": run_id}
        path = f"/dags/{dag_id}/dagRuns"
        for busy in range(DB_BUSY_RETRIES + 1):
            resp = self.request("POST", path, ok=(200, 201, 409, 500), json=body)
            if resp.status_code in (200, 201) or (resp.status_code == 409 and busy > 0):
                return run_id
            if not (resp.status_code == 500 and "Database error" in resp.text and busy < DB_BUSY_RETRIES):
                break
            time.sleep(1.0 + busy)
        raise AirflowAPIError(f"POST {path}: HTTP {resp.status_code}: {resp.text[:500]}")

    def dag_run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}").json()

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return self._paged(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", "task_instances")

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str | None]:
        """``{task_id (or task_id[map_index]): state}`` of one run."""
        states = {}
        for ti in self.task_instances(dag_id, run_id):
            key = ti["task_id"] if ti.get("map_index", -1) < 0 else f"{ti['task_id']}[{ti['map_index']}]"
            states[key] = ti.get("state")
        return dict(sorted(states.items()))

    # -- human in the loop (ApprovalOperator & co.) -----------------------------------------

    def _hitl_path(self, dag_id: str, run_id: str, task_id: str, map_index: int) -> str:
        return f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/hitlDetails"

    def hitl_detail(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, Any] | None:
        """The request a HITL task wrote (subject, body, options, params), or ``None`` before it exists."""
        resp = self.request("GET", self._hitl_path(dag_id, run_id, task_id, map_index), ok=(200, 404))
        return resp.json() if resp.status_code == 200 else None

    def respond(self, dag_id: str, run_id: str, task_id: str, options: list[str],
                params_input: Mapping[str, Any] | None = None, map_index: int = -1) -> dict[str, Any]:
        """Answer a waiting HITL task (what a reviewer's click in the UI sends); 409 if already answered."""
        body = {"chosen_options": list(options), "params_input": dict(params_input or {})}
        return self.request("PATCH", self._hitl_path(dag_id, run_id, task_id, map_index), json=body).json()

    # -- runs, assets, links ------------------------------------------------------------------

    def dag_runs(self, dag_id: str) -> list[dict[str, Any]]:
        """Every run of ``dag_id`` (``run_type`` tells a manual run from an asset-triggered one)."""
        return self._paged(f"/dags/{dag_id}/dagRuns", "dag_runs")

    def asset_id(self, uri: str) -> int | None:
        """The id of the active Asset with exactly this URI (``None`` before a DAG declared it)."""
        assets = self.request("GET", "/assets", params={"uri_pattern": uri, "limit": _PAGE}).json()["assets"]
        return next((a["id"] for a in assets if a["uri"] == uri), None)

    def create_asset_event(self, uri: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Record an event on an Asset, as a producer outside Airflow would: consumers run."""
        asset_id = self.asset_id(uri)
        if asset_id is None:
            raise AirflowAPIError(f"no asset with URI {uri!r}")
        return self.request("POST", "/assets/events", json={"asset_id": asset_id, "extra": dict(extra or {})}).json()

    def extra_links(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> dict[str, str | None]:
        """``{link name: URL}`` of a task instance, as the API server resolves them for the UI."""
        resp = self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/links",
                            params={"map_index": map_index})
        return resp.json()["extra_links"]

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1,
                 map_index: int = -1) -> list[dict[str, Any]]:
        """A task try's log as the UI shows it (the task's own entries and its trigger's): one
        dict per entry (``event``: the message; ``timestamp``, ``level``, ``logger`` where it has
        them)."""
        resp = self.request("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}",
                            params={"full_content": "true", "map_index": map_index})
        return [e if isinstance(e, dict) else {"event": str(e)} for e in resp.json().get("content") or []]

    def _paged(self, path: str, key: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        while True:
            page = self.request("GET", path, params={"limit": _PAGE, "offset": len(items)}).json()
            items.extend(page[key])
            if not page[key] or len(items) >= page.get("total_entries", 0):
                return items


# ---------------------------------------------------------------------------------------------
# module-level helpers (one short-lived client per call)


def _session_for(base_url: str) -> requests.Session:
    session = requests.Session()
    if urlsplit(base_url).hostname in ("127.0.0.1", "localhost", "::1"):
        session.trust_env = False  # a local API never goes through HTTP(S)_PROXY
    return session


def get_token(base_url: str, username: str | None = None, password: str | None = None,
              timeout_s: float = 30.0, *, session: requests.Session | None = None) -> str:
    """A JWT from the simple auth manager (no credentials needed when all users are admin)."""
    url = f"{base_url.rstrip('/')}/auth/token"
    http = session or _session_for(base_url)
    try:
        if username is None:
            resp = http.get(url, timeout=(5.0, timeout_s))
        else:
            resp = http.post(url, json={"username": username, "password": password},
                             timeout=(5.0, timeout_s))
    finally:
        if session is None:
            http.close()
    if resp.status_code not in (200, 201):
        hint = "" if username else " (is [core] simple_auth_manager_all_admins on?)"
        raise AirflowAPIError(f"token: HTTP {resp.status_code}{hint}: {resp.text[:300]}")
    return resp.json()["access_token"]


def wait_for_dag(base_url: str, dag_id: str, timeout_s: float = 120.0, poll_s: float = 2.0,
                 *, dag_file: str | None = None) -> dict[str, Any]:
    """Wait until ``dag_id`` is parsed and visible; raise :class:`DagNotFound` with import errors.

    With ``dag_file`` (a file name or path suffix) an import error for that file fails at once.
    """
    deadline = time.monotonic() + timeout_s
    with AirflowClient(base_url) as client:
        while True:
            try:
                dag = client.get_dag(dag_id)
                if dag is not None:
                    return dag
                if dag_file:
                    errors = [e for e in client.import_errors() if e["filename"].endswith(dag_file)]
                    if errors:
                        raise DagNotFound(f"{dag_id}: import error in {dag_file}:\n"
                                          + _format_errors(errors))
            except (requests.RequestException, AirflowAPIError) as exc:  # starting up
                log.debug("Airflow API not answering yet: %s", exc)
            if time.monotonic() >= deadline:
                try:
                    errors = client.import_errors()
                except (requests.RequestException, AirflowAPIError) as exc:
                    errors = [{"filename": "?", "stack_trace": f"(cannot list import errors: {exc})"}]
                detail = _format_errors(errors) if errors else "no import errors reported"
                raise DagNotFound(f"DAG {dag_id} not visible after {timeout_s:.0f}s; {detail}")
            time.sleep(poll_s)


def trigger_dag_run(base_url: str, dag_id: str, conf: Mapping[str, Any] | None = None,
                    logical_date: datetime | str | None = None, *, run_id: str | None = None) -> str:
    """Unpause ``dag_id`` and trigger a run; returns the run id."""
    with AirflowClient(base_url) as client:
        client.set_paused(dag_id, False)
        run = client.trigger(dag_id, conf, logical_date=logical_date, run_id=run_id)
    log.info("triggered %s run %s", dag_id, run)
    return run


def task_states(base_url: str, dag_id: str, run_id: str) -> dict[str, str | None]:
    with AirflowClient(base_url) as client:
        return client.task_states(dag_id, run_id)


def wait_for_dag_run(base_url: str, dag_id: str, run_id: str, timeout_s: float = 600.0,
                     poll_s: float = 2.0,
                     on_progress: Callable[[dict[str, str | None]], None] | None = None) -> str:
    """Poll a run until it ends; ``on_progress(states)`` is called whenever task states change.

    Returns the final run state (``success`` or ``failed``); raises ``TimeoutError`` otherwise.
    """
    deadline = time.monotonic() + timeout_s
    last: dict[str, str | None] = {}
    state = "unknown"
    with AirflowClient(base_url, timeout_s=POLL_READ_TIMEOUT_S) as client:
        while True:
            polled = _poll(lambda: (client.dag_run(dag_id, run_id)["state"], client.task_states(dag_id, run_id)))
            if polled is not None:
                state, states = polled
                if states != last:
                    last = states
                    log.info("%s %s: %s %s", dag_id, run_id, state, states)
                    if on_progress is not None:
                        on_progress(states)
                if state in TERMINAL_RUN_STATES:
                    return state
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{dag_id} run {run_id} still {state} after {timeout_s:.0f}s; "
                                   f"tasks: {last}")
            time.sleep(poll_s)


def wait_for_task_state(base_url: str, dag_id: str, run_id: str, task_id: str, wanted: str,
                        timeout_s: float = 300.0, poll_s: float = 2.0) -> None:
    """Poll until ``task_id`` is in state ``wanted`` (e.g. ``awaiting_input``); fail early if the run ends."""
    deadline = time.monotonic() + timeout_s
    states: dict[str, str | None] = {}
    with AirflowClient(base_url, timeout_s=POLL_READ_TIMEOUT_S) as client:
        while True:
            polled = _poll(lambda: (client.task_states(dag_id, run_id), client.dag_run(dag_id, run_id)["state"]))
            if polled is not None:
                states, run_state = polled
                if states.get(task_id) == wanted:
                    return
                if run_state in TERMINAL_RUN_STATES:
                    raise AirflowAPIError(f"{dag_id} run {run_id} ended {run_state} before {task_id} was "
                                          f"{wanted}; tasks: {states}")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{task_id} of {dag_id} run {run_id} not {wanted} after {timeout_s:.0f}s; "
                                   f"tasks: {states}")
            time.sleep(poll_s)


def wait_for_new_run(base_url: str, dag_id: str, known: set[str], timeout_s: float = 180.0,
                     poll_s: float = 2.0, *, run_type: str | None = None) -> dict[str, Any]:
    """Wait until a run of ``dag_id`` whose id is not in ``known`` (and, if given, of ``run_type``,
    e.g. ``asset_triggered``) exists."""
    deadline = time.monotonic() + timeout_s
    with AirflowClient(base_url, timeout_s=POLL_READ_TIMEOUT_S) as client:
        while True:
            runs = _poll(lambda: client.dag_runs(dag_id)) or []
            fresh = [r for r in runs if r["dag_run_id"] not in known and (run_type is None or r["run_type"] == run_type)]
            if fresh:
                return fresh[0]
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no new run of {dag_id} after {timeout_s:.0f}s")
            time.sleep(poll_s)


def _poll(read: Callable[[], Any]) -> Any:
    """One poll of a wait: ``read()``, or None when the API server did not answer in time or
    the connection failed. A wait has its own deadline, so one slow answer (an API server on a
    loaded machine can take longer than the client's read timeout) is worth only another poll;
    an HTTP error answer is not transient and is raised."""
    try:
        return read()
    except (requests.Timeout, requests.ConnectionError) as exc:
        log.warning("Airflow API did not answer this poll (%s); polling again", exc)
        return None


def _format_errors(errors: list[dict[str, Any]]) -> str:
    return "\n".join(f"{e.get('filename')}:\n{e.get('stack_trace', '')}" for e in errors)
