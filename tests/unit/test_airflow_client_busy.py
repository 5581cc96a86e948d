"""The Airflow client repeats an idempotent call that the API server answered with its busy
database's "Database error" (HTTP 500), and never repeats a POST, which may have been applied, except
a trigger, which names its run and so can tell its repeat from a second run; a wait polls again
after an answer slower than its read timeout. A real HTTP server on loopback
plays the API server."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra import airflow_client
from infra.airflow_client import AirflowAPIError, AirflowClient

pytestmark = pytest.mark.unit


class _JsonHandler(BaseHTTPRequestHandler):
    """A loopback API server's handler: JSON answers, no request log."""

    def send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up on a slow answer
            pass

    def log_message(self, *args: object) -> None:
        pass


class _Busy(_JsonHandler):
    """Answers the first ``busy`` calls of each method with the API server's database error."""

    busy = 2
    calls: dict[str, int] = {}

    def _answer(self) -> None:
        n = self.calls[self.command] = self.calls.get(self.command, 0) + 1
        if self.command == "GET" and self.path.endswith("/auth/token"):
            body, status = {"access_token": "t"}, 201
        elif n <= self.busy:
            body, status = {"detail": {"reason": "Database error", "message": "Serious error"}}, 500
        else:
            body, status = {"ok": True}, 200
        self.send_json(status, body)

    do_GET = do_PATCH = do_POST = _answer


@pytest.fixture
def api():
    _Busy.calls = {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _client(url: str) -> AirflowClient:
    client = AirflowClient(url, timeout_s=10)
    client._token = "t"  # no login round trip: the calls under test are the API's
    return client


def test_an_idempotent_call_is_repeated_while_the_database_is_busy(api):
    with _client(api) as client:
        assert client.request("PATCH", "/dags/d/dagRuns/r", json={"state": "failed"}).json() == {"ok": True}
    assert _Busy.calls["PATCH"] == 3


def test_a_post_is_not_repeated(api):
    with _client(api) as client, pytest.raises(AirflowAPIError, match="HTTP 500"):
        client.request("POST", "/dags/d/dagRuns", json={})
    assert _Busy.calls["POST"] == 1


class _AppliedButBusy(_JsonHandler):
    """Creates the named run on the first POST yet answers it with the database error (the commit
    went through, the answer did not); a POST naming an existing run gets the API's 409."""

    runs: dict[str, dict] = {}
    posts = 0

    def do_POST(self) -> None:
        type(self).posts += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        run_id = body["dag_run_id"]
        if run_id in self.runs:
            status, answer = 409, {"detail": f"DAG run {run_id} already exists"}
        else:
            self.runs[run_id] = body["conf"]
            status, answer = 500, {"detail": {"reason": "Database error", "message": "Serious error"}}
        self.send_json(status, answer)


def test_a_trigger_answered_busy_is_repeated_by_its_run_id_and_makes_one_run():
    _AppliedButBusy.runs, _AppliedButBusy.posts = {}, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AppliedButBusy)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with _client(f"http://127.0.0.1:{server.server_address[1]}") as client:
            run_id = client.trigger("d", {"epochs": 1})
            assert run_id.startswith("manual__") and _AppliedButBusy.runs == {run_id: {"epochs": 1}}
            assert _AppliedButBusy.posts == 2  # the repeat found the run: no second one
            # A run id the caller names that exists already is refused, not taken for a repeat.
            with pytest.raises(AirflowAPIError, match="HTTP 409"):
                client.trigger("d", {"epochs": 2}, run_id=run_id)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert _AppliedButBusy.runs == {run_id: {"epochs": 1}}


class _Slow(_JsonHandler):
    """Answers a run's state, the first time only after ``delay_s`` (an API server on a loaded
    machine), then ``success``; its task instances at once."""

    delay_s = 1.5
    run_calls = 0

    def do_GET(self) -> None:
        if self.path.endswith("/auth/token"):
            body: dict = {"access_token": "t"}
        elif "/taskInstances" in self.path:
            body = {"task_instances": [{"task_id": "t", "map_index": -1, "state": "success"}], "total_entries": 1}
        else:
            type(self).run_calls += 1
            if type(self).run_calls == 1:
                time.sleep(self.delay_s)
            body = {"state": "success"}
        self.send_json(200, body)


def test_a_wait_polls_again_after_an_answer_slower_than_the_read_timeout(monkeypatch):
    monkeypatch.setattr(airflow_client, "POLL_READ_TIMEOUT_S", 0.5)
    _Slow.run_calls = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        state = airflow_client.wait_for_dag_run(f"http://127.0.0.1:{server.server_address[1]}", "d", "r",
                                                timeout_s=20, poll_s=0.1)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert state == "success" and _Slow.run_calls >= 2
