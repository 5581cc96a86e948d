"""A role's spot watch (``common.procs.spot``) against a local metadata endpoint, the AWS SDKs'
endpoint setting pointed at ``testkit.metadata_server``: a real HTTP server with IMDSv2's token
flow, whose interruption notice the test switches on. The roles are real processes running the
watch as a role does (``watch_spot()`` at its start, then its work), read from their output;
last, a real local job that gets the notice mid-training: the supervisor checkpoints at once,
restarts the roles, and the job ends as an uninterrupted one does."""
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from common import storage
from common.events import SpotInterruption, parse_event
from common.roles import SERVER, JobLaunch, role_argv, role_env
from common.procs import free_port
from common.procs.spot import ACTION_PATH, INSTANCE_ID_PATH, TOKEN_PATH, SPOT_WATCH_ENV, MetadataClient, watch_spot
from testkit import REPO
from testkit.metadata_server import running_metadata_server
from testkit.waits import wait_for

pytestmark = pytest.mark.integration

POLL_S = 0.1
HOST = "10.1.2.3"
# A role: its spot watch, then its work (a real role trains or waits in ps-lite).
ROLE = "from common.procs.spot import watch_spot; watch_spot(); print('ready', flush=True); import time; time.sleep(120)"


@pytest.fixture(scope="module")
def imds(tmp_path_factory):
    with running_metadata_server(str(tmp_path_factory.mktemp("imds"))) as fake:
        yield fake


@pytest.fixture
def fake(imds):
    imds.clear()
    yield imds
    imds.clear()


class _Role:
    """A role process whose stdout and stderr lines are collected as they come."""

    def __init__(self, env: dict[str, str], argv: list[str] | None = None, *, ready: str = "ready") -> None:
        self.proc = subprocess.Popen(argv or [sys.executable, "-c", ROLE], cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": REPO, **env}, start_new_session=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                        for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()
        if ready:
            wait_for(lambda: ready in self.out, timeout_s=30, what="the role's start")

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def events(self) -> list:
        return [e for e in map(parse_event, self.out) if e is not None]

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # its group: a server role's helpers too
        self.proc.wait(timeout=30)
        for reader in self.readers:
            reader.join(timeout=10)


def _watching(fake, **extra: str) -> dict[str, str]:
    return {**fake.watching(POLL_S), "DMLC_NODE_HOST": HOST, **extra}


def test_no_notice_no_event_then_a_notice_is_one_event_and_the_role_runs_on(fake):
    role = _Role(_watching(fake))
    try:
        start = fake.stats()["action_polls"]
        # It polls (every 0.1 s) and, with no notice, says nothing.
        wait_for(lambda: fake.stats()["action_polls"] >= start + 5, timeout_s=10, what="five notice polls")
        assert role.events() == [] and role.err == []
        fake.notice("terminate", "2026-12-06T20:07:00Z")
        noticed = time.monotonic()
        (event,) = wait_for(role.events, timeout_s=10, what="the spot_interruption event")
        took = time.monotonic() - noticed
        assert event == SpotInterruption(instance_id=fake.instance_id, action="terminate",
                                         time="2026-12-06T20:07:00Z", host=HOST)
        assert took < 2.0, f"the event came {took:.1f}s after the notice (poll every {POLL_S}s)"
        # Once: the notice stays on, later polls write nothing more, and the role keeps running.
        time.sleep(10 * POLL_S)
        assert len(role.events()) == 1 and role.proc.poll() is None
        assert any("will terminate at 2026-12-06T20:07:00Z" in line for line in role.err)
    finally:
        role.stop()


def test_a_notice_is_also_recorded_where_the_backend_asks(fake, tmp_path):
    """``ec2``'s supervisor cannot read a running role's output (SSM): the role records its event
    in the folder ``MXPIPE_SPOT_NOTICE_URI`` names, which the supervisor polls."""
    from common.procs.spot import SPOT_NOTICE_ENV, read_notices

    folder = str(tmp_path / "spot_notices")
    role = _Role(_watching(fake, **{SPOT_NOTICE_ENV: folder}))
    try:
        assert read_notices(folder) == []
        fake.notice("terminate", "2026-12-06T20:07:00Z")
        (event,) = wait_for(lambda: read_notices(folder), timeout_s=10, what="the recorded notice")
        assert event == SpotInterruption(instance_id=fake.instance_id, action="terminate",
                                         time="2026-12-06T20:07:00Z", host=HOST)
        assert wait_for(role.events, timeout_s=10, what="the event line") == [event]  # as without the folder
    finally:
        role.stop()


@pytest.mark.parametrize("action", ["stop", "hibernate"])
def test_each_action_of_a_notice_is_carried(fake, action):
    role = _Role(_watching(fake))
    try:
        fake.notice(action, "2026-12-06T21:00:00Z")
        (event,) = wait_for(role.events, timeout_s=10, what="the spot_interruption event")
        assert (event.action, event.time, event.host) == (action, "2026-12-06T21:00:00Z", HOST)
    finally:
        role.stop()


def test_the_endpoint_refuses_a_request_without_a_valid_token(fake):
    def status(method: str, path: str, headers: dict[str, str]) -> int:
        req = urllib.request.Request(fake.endpoint + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    fake.notice()
    assert status("GET", ACTION_PATH, {}) == 401  # IMDSv1 (no token): refused
    assert status("GET", INSTANCE_ID_PATH, {"X-aws-ec2-metadata-token": "made-up"}) == 401
    assert status("PUT", TOKEN_PATH, {}) == 400  # a token needs its time to live
    client = MetadataClient(fake.endpoint)
    assert client.instance_id() == fake.instance_id
    assert client.instance_action() == {"action": "terminate", "time": "2026-12-06T20:07:00Z"}
    # An expired token is refused; the client takes a new one, once, and reads on.
    old = client.token()
    fake.expire_tokens()
    assert status("GET", INSTANCE_ID_PATH, {"X-aws-ec2-metadata-token": old}) == 401
    tokens = fake.stats()["tokens"]
    assert client.instance_id() == fake.instance_id
    assert fake.stats()["tokens"] == tokens + 1 and client.token() != old


def test_an_unreachable_endpoint_is_said_once_and_the_role_runs_on(fake):
    nothing = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # free a moment ago: nothing listens
    role = _Role(_watching(fake, AWS_EC2_METADATA_SERVICE_ENDPOINT=nothing))
    try:
        wait_for(lambda: role.err, timeout_s=10, what="the watch saying the endpoint cannot be read")
        time.sleep(20 * POLL_S)  # twenty more failed polls
        assert role.proc.poll() is None and role.events() == []
        assert len(role.err) == 1 and nothing in role.err[0] and "cannot be read" in role.err[0]
    finally:
        role.stop()


def test_a_server_role_blocked_in_ps_lite_writes_the_event(fake):
    """The exact command of a server role (``common.roles.role_argv``): mxnet's import runs the
    server and blocks in ps-lite for its life (here waiting for a scheduler that never comes);
    the watch started before it still polls and writes."""
    launch = JobLaunch(job_uri="s3://b/job.json", num_workers=1, num_servers=1)
    env = role_env(launch, SERVER, node_host="127.0.0.1", root_uri="127.0.0.1", root_port=free_port("127.0.0.1"),
                   base={"PATH": os.environ["PATH"]}, repo_root=REPO)
    role = _Role({**env, **_watching(fake, DMLC_NODE_HOST="127.0.0.1")}, role_argv(SERVER, "s3://b/job.json"),
                 ready="")
    try:
        start = fake.stats()["action_polls"]
        wait_for(lambda: fake.stats()["action_polls"] >= start + 3, timeout_s=60, what="the server's polls")
        fake.notice("terminate", "2026-12-06T20:09:00Z")
        (event,) = wait_for(role.events, timeout_s=10, what="the server role's spot_interruption event")
        assert (event.host, event.time) == ("127.0.0.1", "2026-12-06T20:09:00Z")
        assert role.proc.poll() is None  # still serving (blocked in ps-lite)
    finally:
        role.stop()


def test_a_worker_role_watches_from_its_start(fake):
    """The worker's command (``python -m training worker``) starts the watch before anything
    else (mxnet's import, its job): with the notice already on, the event comes even from a
    worker whose job cannot be read and that fails."""
    fake.notice("terminate", "2026-12-06T20:11:00Z")
    done = subprocess.run([sys.executable, "-m", "training", "worker", "/nonexistent/job.json"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO, **_watching(fake)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "/nonexistent/job.json" in done.stderr + done.stdout
    events = [e for e in map(parse_event, done.stdout.splitlines()) if e is not None]
    assert events == [SpotInterruption(instance_id=fake.instance_id, action="terminate",
                                       time="2026-12-06T20:11:00Z", host=HOST)]


def test_no_watch_unless_asked(fake):
    assert watch_spot({**fake.env}) is None
    assert watch_spot({**fake.env, SPOT_WATCH_ENV: "0"}) is None


def test_a_notice_mid_training_checkpoints_at_once_and_the_job_ends_bit_identical(fake, s3_server, digits_csv,
                                                                                   s3_prefix, tmp_path):
    """A real two-worker job on the local backend with every role's watch on (every backend passes
    ``MXPIPE_*`` and ``AWS_*`` on to its roles): the notice arrives mid-epoch, far from a periodic
    checkpoint. The supervisor stops every role in order at once, rank 0 first for its emergency
    checkpoint, restarts them (the local cluster keeps its shape), and they resume from that
    checkpoint: no step lost, where a crash at the same moment would have lost every step since
    the newest periodic checkpoint; the final parameters equal an uninterrupted run's."""
    import io

    import numpy as np

    from testkit.local_jobs import make_job, run_job, shard_digits
    from testkit.spot_runs import run_with_notice
    from training.checkpoint.store import store_for

    cfg, shards = shard_digits(s3_prefix, digits_csv)
    cfg = cfg.replace(optim={"epochs": 3}, checkpoint={"every_n_steps": 25},
                      cluster={"num_workers": 2, "num_servers": 1, "optimizer_on": "workers"})
    ref_prefix = storage.join(s3_prefix, "reference")
    reference = make_job(cfg, shards, ref_prefix)
    run_job(reference, ref_prefix, tmp_path)
    prefix = storage.join(s3_prefix, "noticed")
    job = make_job(cfg, shards, prefix)
    # Rank 0's steps slowed (the arithmetic untouched) so the notice lands mid-training.
    slow = {"MXPIPE_FAULT_STEP_DELAY_S": "0.2", "MXPIPE_FAULT_KILL_RANK": "0"}
    outcome = run_with_notice(job, prefix, tmp_path, fake, notice_at_step=30, env=slow)
    print("spot notice:", outcome.as_dict())
    assert outcome.restarts == 1
    assert outcome.emergency_step > outcome.newest_before_notice  # written after the notice, not periodic
    assert outcome.resumed_from == outcome.emergency_step and outcome.steps_lost == 0
    assert outcome.steps_lost_by_a_crash > 0

    def final(j):
        store = store_for(j.checkpoint_prefix, j.config.checkpoint)
        step = store.committed_steps()[0]
        with np.load(io.BytesIO(store.load(step).files["params.npz"])) as arrays:
            return step, {k: arrays[k].copy() for k in arrays.files}

    (step, params), (ref_step, ref_params) = final(job), final(reference)
    assert step == ref_step and all(np.array_equal(params[k], ref_params[k]) for k in ref_params)

