"""The Airflow client repeats an idempotent call that the API server answered with its busy
database's "Database error" (HTTP 500), and never repeats a POST, which may have been applied.
A real HTTP server on loopback plays the API server."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from infra.airflow_client import AirflowAPIError, AirflowClient

pytestmark = pytest.mark.unit


class _Busy(BaseHTTPRequestHandler):
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
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


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
