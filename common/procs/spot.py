"""A role's watch for its spot instance's interruption notice: the supervisor hears of it from the
role's own output, two minutes before the instance goes.

EC2 gives a spot instance about two minutes' notice before it reclaims it (terminate, stop or
hibernate), and only through the instance metadata service of that instance: nothing outside it
(the supervisor on another instance, Airflow) can read it. So every role of a spot cluster
(``SPOT_WATCH_ENV``, set by the ``ec2`` backend when it launches spot instances) runs
``watch_spot()`` at its start, beside its supervisor watch (``common.procs.watchdog``): a daemon
thread that polls the notice every ``MXPIPE_SPOT_POLL_S`` (AWS's advice is 5 s), through IMDSv2:

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds``: a session token
  (renewed before it expires, and again when a request is refused with 401);
- ``GET /latest/meta-data/spot/instance-action`` with ``X-aws-ec2-metadata-token``: 404 while
  there is no notice, 200 with ``{"action": ..., "time": ...}`` once there is one;
- ``GET /latest/meta-data/instance-id``, to name the instance in the event.

On a notice the role writes one ``common.events.SpotInterruption`` line to its standard output
(the channel from a role on any host to its supervisor), flushed, and, where
``MXPIPE_SPOT_NOTICE_URI`` names a folder, records the same event there as
``<instance id>.json`` (``record_notice``; ``read_notices`` reads them): on ``ec2`` the supervisor
cannot read a running role's output (SSM returns it only once the command has ended), so it
polls that folder instead (``notice_folder``: beside the job's document, set by the backend).
Then the role goes on running: what happens next (rank 0's emergency checkpoint, a restart
elsewhere) is the supervisor's decision.
Every request has a short timeout (``REQUEST_TIMEOUT_S``); a metadata service that cannot be
reached, or answers nonsense, is said once on standard error and polled again at the next
interval: the watch never ends a role.

The endpoint is the AWS SDKs' own setting, ``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (default
``http://169.254.169.254``; tests point it at ``testkit.metadata_server``). The requests are
plain ``urllib``, not botocore: botocore's ``IMDSFetcher`` fetches a token and arbitrary paths
only through private methods (``_fetch_metadata_token``, ``_get_request``); its public fetchers
read IAM credentials and the region, nothing else.
"""
from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import TextIO

from pydantic import ValidationError

from common.events import SpotInterruption, event_line
from common.procs.watchdog import say
from common.settings import settings

SPOT_WATCH_ENV = "MXPIPE_SPOT_WATCH"
SPOT_NOTICE_ENV = "MXPIPE_SPOT_NOTICE_URI"
TOKEN_PATH = "/latest/api/token"
ACTION_PATH = "/latest/meta-data/spot/instance-action"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
# The longest token IMDSv2 issues (6 h); renewed TOKEN_RENEW_S before it runs out.
TOKEN_TTL_S = 21600
TOKEN_RENEW_S = 60.0
# The metadata service answers from the instance itself in milliseconds: a request that takes
# longer than this is a service that is not there (a role off EC2, a blocked hop).
REQUEST_TIMEOUT_S = 1.0


class MetadataError(RuntimeError):
    """The metadata service answered, but not as IMDSv2 does (a status or body it never sends)."""


class TokenRefused(MetadataError):
    """The service refused the session token (HTTP 401)."""


class MetadataClient:
    """The few IMDSv2 requests the watch makes, against ``endpoint``."""

    def __init__(self, endpoint: str, *, timeout_s: float = REQUEST_TIMEOUT_S, token_ttl_s: int = TOKEN_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self.clock = clock
        self._token: str | None = None
        self._token_until = 0.0
        # No proxy, whatever http_proxy says: the metadata service is link-local, and a proxy
        # would answer for its own host, not this instance (botocore bypasses proxies for it too).
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _send(self, request: urllib.request.Request) -> str:
        with self._opener.open(request, timeout=self.timeout_s) as resp:
            return resp.read().decode()

    def token(self) -> str:
        """A session token: the one held while it has more than ``TOKEN_RENEW_S`` left, else a new one."""
        if self._token is None or self.clock() >= self._token_until:
            started = self.clock()
            req = urllib.request.Request(self.endpoint + TOKEN_PATH, method="PUT",
                                         headers={TOKEN_TTL_HEADER: str(self.token_ttl_s)})
            self._token = self._send(req).strip()
            if not self._token:
                raise MetadataError(f"{self.endpoint}{TOKEN_PATH} gave an empty token")
            self._token_until = started + max(0.0, self.token_ttl_s - TOKEN_RENEW_S)
        return self._token

    def _get(self, path: str) -> str | None:
        req = urllib.request.Request(self.endpoint + path, headers={TOKEN_HEADER: self.token()})
        try:
            return self._send(req)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            error = TokenRefused if exc.code == 401 else MetadataError
            raise error(f"{self.endpoint}{path}: HTTP {exc.code} {exc.reason}") from None

    def get(self, path: str) -> str | None:
        """The body at ``path``; None where there is none (404). A refused token (401: it
        expired, or the service restarted) is renewed once."""
        try:
            return self._get(path)
        except TokenRefused:
            self._token = None
            return self._get(path)

    def instance_id(self) -> str:
        instance = (self.get(INSTANCE_ID_PATH) or "").strip()
        if not instance:
            raise MetadataError(f"{self.endpoint}{INSTANCE_ID_PATH}: no instance id")
        return instance

    def instance_action(self) -> dict[str, str] | None:
        """The interruption notice (``action``, ``time``), or None while there is none."""
        body = self.get(ACTION_PATH)
        if body is None:
            return None
        try:
            notice = json.loads(body)
            return {"action": str(notice["action"]), "time": str(notice["time"])}
        except (ValueError, KeyError, TypeError):
            raise MetadataError(f"{self.endpoint}{ACTION_PATH}: not a notice: {body[:200]!r}") from None


def _say(text: str) -> None:
    say("spot watch", text)


# A recorded notice's writes (storage trouble: the event line has gone out anyway).
RECORD_ATTEMPTS, RECORD_WAIT_S = 3, 1.0


def notice_folder(job_uri: str) -> str:
    """Where the roles of the job at ``job_uri`` record their spot notices: beside its document."""
    from common import storage

    return storage.join(job_uri.rsplit("/", 1)[0], "spot_notices")


def record_notice(folder: str, event: SpotInterruption) -> bool:
    """Write ``event`` as ``<folder>/<instance id>.json`` (retried, bounded); whether it landed."""
    from common import storage

    uri = storage.join(folder, f"{event.instance_id}.json")
    for attempt in range(RECORD_ATTEMPTS):
        try:
            storage.put_bytes(uri, event.model_dump_json().encode())
            return True
        except Exception as exc:  # noqa: BLE001 - any storage error: said, tried again, never fatal
            _say(f"could not record the notice at {uri} (attempt {attempt + 1} of {RECORD_ATTEMPTS}): {exc}")
            time.sleep(RECORD_WAIT_S)
    return False


def read_notices(folder: str) -> list[SpotInterruption]:
    """The notices recorded under ``folder`` (none while it is empty or missing); an object that
    is not a notice is skipped."""
    from common import storage

    notices = []
    for uri in storage.list_uris(folder):
        try:
            notices.append(SpotInterruption.model_validate_json(storage.get_bytes(uri)))
        except (ValidationError, FileNotFoundError):
            continue
    return notices


class SpotWatch:
    """One role's watch: ``poll`` once, or ``run`` until the notice came (or ``stop`` is set)."""

    def __init__(self, client: MetadataClient, *, host: str, interval_s: float, out: TextIO | None = None,
                 record_to: str = "") -> None:
        self.client = client
        self.host = host
        self.interval_s = interval_s
        self.out = out
        self.record_to = record_to  # a folder to record the notice in (``record_notice``), or none
        self.failing = False  # the last poll failed (said once, until a poll succeeds again)

    def poll(self) -> SpotInterruption | None:
        """The notice as an event, or None while there is none. Raises ``OSError`` (the service
        cannot be reached: ``urllib.error.URLError``, a timeout) or ``MetadataError``."""
        notice = self.client.instance_action()
        if notice is None:
            return None
        try:
            return SpotInterruption(instance_id=self.client.instance_id(), host=self.host, **notice)
        except ValidationError as exc:  # an action EC2 does not document
            raise MetadataError(f"{self.client.endpoint}{ACTION_PATH}: not a notice: {notice}: {exc}") from None

    def _write(self, event: SpotInterruption) -> None:
        out = self.out if self.out is not None else sys.stdout
        try:
            out.write(event_line(event) + "\n")
            out.flush()
        except (OSError, ValueError):  # nobody reads the role's output any more: nothing to tell
            pass

    def run(self, stop: threading.Event | None = None) -> SpotInterruption | None:
        """Poll every ``interval_s`` until the notice: write its event once and return it. None
        once ``stop`` is set first."""
        stop = stop or threading.Event()
        while not stop.is_set():
            try:
                event = self.poll()
            # OSError: unreachable, a timeout; HTTPException: a broken answer; ValueError: not text.
            except (OSError, MetadataError, http.client.HTTPException, ValueError) as exc:
                if not self.failing:
                    _say(f"the instance metadata at {self.client.endpoint} cannot be read ({exc}); "
                         f"polling on every {self.interval_s:g}s, quietly")
                self.failing = True
            else:
                if self.failing:
                    _say(f"the instance metadata at {self.client.endpoint} answers again")
                self.failing = False
                if event is not None:
                    self._write(event)
                    if self.record_to:
                        record_notice(self.record_to, event)
                    _say(f"interruption notice: instance {event.instance_id} will {event.action} at {event.time}")
                    return event
            stop.wait(self.interval_s)
        return None


def watch_spot(environ: Mapping[str, str] | None = None, *, out: TextIO | None = None) -> threading.Thread | None:
    """Start this role's spot watch (see the module docstring); None when ``SPOT_WATCH_ENV`` is off."""
    s = settings(environ)
    if not s.spot_watch:
        return None
    watch = SpotWatch(MetadataClient(s.ec2_metadata_endpoint), host=s.node_host or socket.gethostname(),
                      interval_s=s.spot_poll_s, out=out, record_to=s.spot_notice_uri)
    thread = threading.Thread(target=watch.run, name="spot-watch", daemon=True)
    thread.start()
    return thread
