"""Shared test setup: tier markers, and the real servers integration tests run against.

Every test carries one tier marker (unit, dag, integration, benchmark, topology); an unmarked test
fails collection. ``benchmark`` and ``topology`` tests are skipped unless selected with ``-m
benchmark`` / ``-m topology``.

Servers (SeaweedFS, MLflow) are started by session fixtures on free 127.0.0.1 ports in a temp
folder with fresh random credentials, and stopped (whole process group) at the end
(``testkit.servers``; the fixtures set the environment a test process reads).

``nothing_left``: a test that starts processes proves at its end that none is still running.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from common.procs import Watch
    from testkit.servers import MLflowServer, S3Server

TIERS = ("unit", "dag", "integration", "benchmark", "topology")
# Tiers that run only when selected by name: minutes each, and the topology takes the machine.
OPT_IN_TIERS = ("benchmark", "topology")


# ---------------------------------------------------------------------------------------------
# markers


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items
                if not any(item.get_closest_marker(tier) for tier in TIERS)]
    if unmarked:
        raise pytest.UsageError(
            f"every test needs one of the markers {TIERS}; unmarked:\n  " + "\n  ".join(unmarked))
    for tier in OPT_IN_TIERS:
        if tier not in (config.option.markexpr or ""):
            skip = pytest.mark.skip(reason=f"{tier}: run with -m {tier}")
            for item in items:
                if item.get_closest_marker(tier):
                    item.add_marker(skip)
    _longest_files_first(items)


# The seconds each test file took in a recorded run (scripts/test_durations.py writes them).
DURATIONS = Path(__file__).with_name("durations.json")
# A file with no recorded time: an integration file is assumed to take about a minute.
UNKNOWN_INTEGRATION_S = 60.0


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Order whole files longest first, keeping each file's own order. ``make test`` hands files
    to the two pytest-xdist workers in this order (``--dist loadfile --no-loadscope-reorder``):
    longest-processing-time first ends the workers close together, where xdist's own order
    (most tests first) left the long, few-test integration files to the end, one worker idle."""
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}

    def seconds(item: pytest.Item) -> float:
        path = item.nodeid.split("::", 1)[0]
        default = UNKNOWN_INTEGRATION_S if item.get_closest_marker("integration") else 0.0
        return float(recorded.get(path, default))

    weight = {}
    for item in items:
        weight.setdefault(item.nodeid.split("::", 1)[0], seconds(item))
    items.sort(key=lambda item: -weight[item.nodeid.split("::", 1)[0]])  # stable: a file keeps its order


# ---------------------------------------------------------------------------------------------
# processes

TEST_TAG = "MXPIPE_TEST_TAG"


@pytest.fixture
def nothing_left(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Watch]:
    """A ``common.procs.Watch`` checked when the test ends: it fails the test, naming pid and
    command line, if any watched process is still running after a bounded wait (and kills it).

    Watched from the start: processes carrying ``watch.env`` (a tag unique to this test) and the
    groups recorded under ``tmp_path/procs``; a test adds its own with ``watch.tag(...)``,
    ``.group(pgid)``, ``.session(pgid)``, ``.records(dir)``, and may ``watch.check()`` earlier.
    """
    from common.procs import Watch

    watch = Watch(tags=[(TEST_TAG, uuid.uuid4().hex)], record_dirs=[str(tmp_path / "procs")])
    yield watch
    watch.check(request.node.nodeid)


# ---------------------------------------------------------------------------------------------
# servers


@pytest.fixture(scope="session")
def _test_stack(tmp_path_factory: pytest.TempPathFactory):
    from testkit.servers import new_stack

    return new_stack(tmp_path_factory.mktemp("stack"))


@pytest.fixture(scope="session")
def s3_server(_test_stack) -> Iterator[S3Server]:
    """A real SeaweedFS S3 gateway with enforced random credentials; sets the AWS_* env."""
    from testkit.servers import running_s3

    with running_s3(_test_stack) as server, pytest.MonkeyPatch.context() as mp:
        for key, value in server.env.items():
            if key.startswith("AWS_"):
                mp.setenv(key, value)
        mp.delenv("AWS_ENDPOINT_URL", raising=False)
        mp.delenv("AWS_SESSION_TOKEN", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        yield server


@pytest.fixture(scope="session")
def mlflow_server(s3_server: S3Server) -> Iterator[MLflowServer]:
    """A real ``mlflow server`` (SQLite backend, artifacts proxied to the S3 fixture)."""
    from testkit.servers import running_mlflow

    with running_mlflow(s3_server.config) as server, pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", server.tracking_uri)
        # The client's default retry policy waits minutes on a dead server; fail sooner in tests.
        mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
        mp.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
        yield server


@pytest.fixture
def s3_prefix(s3_server: S3Server) -> str:
    """A fresh, unique ``s3://<bucket>/test-<uuid>`` prefix."""
    return f"s3://{s3_server.bucket}/test-{uuid.uuid4().hex}"


@pytest.fixture(scope="session")
def digits_csv() -> bytes:
    """The demo dataset as the pipeline's source format: a CSV table with a ``label`` column."""
    from testkit.digits import digits_csv

    return digits_csv()
