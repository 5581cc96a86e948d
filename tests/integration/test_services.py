"""The local service stack against real servers: SeaweedFS, MLflow, Airflow (infra.services and
the modules it is built from: stack_config, processes, s3_service, airflow_service)."""
from __future__ import annotations

import os
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from common import storage
from common.procs import GroupRecord, group_members
from infra.airflow_client import (
    DagNotFound,
    task_states,
    trigger_dag_run,
    wait_for_dag,
    wait_for_dag_run,
)
from infra.airflow_service import start_airflow, stop_airflow
from infra.processes import launch
from infra.s3_service import s3_client, start_s3, stop_s3
from infra.stack_config import StackConfig

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------------------------------------
# S3


def test_s3_round_trip_through_storage(s3_prefix: str) -> None:
    uri = storage.join(s3_prefix, "a", "b.bin")
    storage.put_bytes(uri, b"hello")
    assert storage.get_bytes(uri) == b"hello"
    assert storage.exists(uri)
    assert list(storage.list_uris(s3_prefix)) == [uri]
    assert storage.delete_prefix(s3_prefix) == 1
    assert not storage.exists(uri)


@pytest.mark.parametrize("which", ["secret", "key_id"])
def test_s3_wrong_credentials_are_refused(s3_server, s3_prefix: str, which: str) -> None:
    from botocore.exceptions import ClientError

    storage.put_bytes(f"{s3_prefix}/x", b"1")
    key = s3_server.access_key if which == "secret" else "MXWRONGKEY0000000000"
    secret = s3_server.secret_key + "x" if which == "secret" else s3_server.secret_key
    client = s3_client(s3_server.endpoint, key, secret)
    _, obj_key = storage.split_s3(f"{s3_prefix}/x")
    with pytest.raises(ClientError) as err:
        client.get_object(Bucket=s3_server.bucket, Key=obj_key)
    assert err.value.response["Error"]["Code"] in (
        "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied")
    with pytest.raises(ClientError):
        client.put_object(Bucket=s3_server.bucket, Key=f"{obj_key}-evil", Body=b"2")


def test_s3_unsigned_requests_are_refused(s3_server, s3_prefix: str) -> None:
    from botocore.exceptions import ClientError

    storage.put_bytes(f"{s3_prefix}/x", b"1")
    client = s3_client(s3_server.endpoint, None, None, unsigned=True)
    _, obj_key = storage.split_s3(f"{s3_prefix}/x")
    for call in (lambda: client.get_object(Bucket=s3_server.bucket, Key=obj_key),
                 lambda: client.list_objects_v2(Bucket=s3_server.bucket),
                 lambda: client.put_object(Bucket=s3_server.bucket, Key="anon", Body=b"")):
        with pytest.raises(ClientError) as err:
            call()
        assert err.value.response["Error"]["Code"] == "AccessDenied"


def test_s3_conditional_put_refuses_overwrite(s3_prefix: str) -> None:
    uri = f"{s3_prefix}/MANIFEST.json"
    storage.put_bytes(uri, b"first", if_none_match=True)
    with pytest.raises(storage.AlreadyExists):
        storage.put_bytes(uri, b"second", if_none_match=True)
    assert storage.get_bytes(uri) == b"first"


def test_s3_stop_leaves_no_process(tmp_path: Path, nothing_left) -> None:
    cfg = StackConfig.with_free_ports(tmp_path)
    handle = start_s3(cfg)
    nothing_left.session(handle.pgid)
    assert handle.is_running()
    assert group_members([handle.pgid], sessions=True)
    assert stop_s3(handle)
    nothing_left.check("SeaweedFS")
    assert not (tmp_path / "run" / "s3.json").exists()
    assert not list(Path("/tmp").glob(f"seaweedfs-*-{cfg.s3_port}.sock"))


def test_stop_never_signals_a_reused_pid(tmp_path: Path, nothing_left) -> None:
    """A pid file whose pid now belongs to another process must not kill that process."""
    handle = launch("sleeper", ["sleep", "60"], dict(os.environ), tmp_path)
    nothing_left.session(handle.pgid)
    try:
        stale = GroupRecord.from_json(handle.to_json())
        stale.start_time += 1  # as if the pid had been reused since the pid file was written
        assert not stale.may_be_ours() and not stale.is_running()
        assert stale.stop(timeout=1)
        assert handle.is_running()
    finally:
        assert handle.stop(timeout=5)


# ---------------------------------------------------------------------------------------------
# MLflow


def test_mlflow_metric_and_artifact_land_in_s3(mlflow_server, s3_server, tmp_path: Path) -> None:
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    client = MlflowClient(tracking_uri=mlflow_server.tracking_uri)
    exp_id = client.create_experiment(f"test-{uuid.uuid4().hex[:8]}")
    run = client.create_run(exp_id)
    client.log_metric(run.info.run_id, "loss", 0.25, step=3)
    artifact = tmp_path / "note.txt"
    artifact.write_text("stored behind the tracking server")
    client.log_artifact(run.info.run_id, str(artifact), artifact_path="notes")
    client.set_terminated(run.info.run_id)

    got = client.get_run(run.info.run_id)
    assert got.data.metrics["loss"] == 0.25
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    local = download_artifacts(run_id=run.info.run_id, artifact_path="notes/note.txt",
                               dst_path=str(tmp_path / "dl"),
                               tracking_uri=mlflow_server.tracking_uri)
    assert Path(local).read_text() == "stored behind the tracking server"
    in_s3 = list(storage.list_uris(f"s3://{s3_server.bucket}/mlflow-artifacts"))
    assert any(u.endswith(f"{run.info.run_id}/artifacts/notes/note.txt") for u in in_s3), in_s3


# ---------------------------------------------------------------------------------------------
# Airflow

SMOKE_DAG = textwrap.dedent('''
    from __future__ import annotations

    import pendulum
    from airflow.sdk import dag, get_current_context, task


    @dag(dag_id="mxpipe_services_smoke", schedule=None, catchup=False,
         start_date=pendulum.datetime(2024, 1, 1, tz="UTC"), params={"out": ""})
    def mxpipe_services_smoke():
        @task
        def write() -> str:
            from common import storage  # PYTHONPATH holds the repo root

            out = get_current_context()["params"]["out"]
            storage.put_bytes(out, b"written by an Airflow task")
            return out

        @task
        def check(uri: str) -> None:
            from common import storage

            assert storage.get_bytes(uri) == b"written by an Airflow task"

        check(write())


    mxpipe_services_smoke()
''')

BROKEN_DAG = "from airflow.sdk import dag\n\nraise RuntimeError('broken on purpose')\n"


def test_airflow_stack_runs_a_dag(s3_server, s3_prefix: str, tmp_path: Path, nothing_left) -> None:
    dags, plugins = tmp_path / "dags", tmp_path / "plugins"
    dags.mkdir()
    plugins.mkdir()
    (dags / "smoke_dag.py").write_text(SMOKE_DAG)
    (dags / "broken_dag.py").write_text(BROKEN_DAG)
    cfg = StackConfig.with_free_ports(tmp_path / "home", dags_folder=dags,
                                               plugins_folder=plugins)
    t0 = time.monotonic()
    handles = start_airflow(cfg, client_env=s3_server.env)
    for handle in handles:
        nothing_left.session(handle.pgid)
    try:
        started = time.monotonic() - t0
        wait_for_dag(cfg.airflow_url, "mxpipe_services_smoke", timeout_s=90, dag_file="smoke_dag.py")
        visible = time.monotonic() - t0
        with pytest.raises(DagNotFound, match="broken on purpose"):
            wait_for_dag(cfg.airflow_url, "broken", timeout_s=60, dag_file="broken_dag.py")
        out = f"{s3_prefix}/marker.txt"
        run_id = trigger_dag_run(cfg.airflow_url, "mxpipe_services_smoke", {"out": out})
        seen: list[dict] = []
        state = wait_for_dag_run(cfg.airflow_url, "mxpipe_services_smoke", run_id,
                                 timeout_s=180, poll_s=2, on_progress=seen.append)
        final = task_states(cfg.airflow_url, "mxpipe_services_smoke", run_id)
        assert state == "success", (final, [h.log_tail(20) for h in handles])
        assert final == {"check": "success", "write": "success"}
        assert seen and seen[-1] == final
        assert storage.get_bytes(out) == b"written by an Airflow task"
        print(f"airflow: healthy after {started:.1f}s, DAG visible after {visible:.1f}s, "
              f"run done after {time.monotonic() - t0:.1f}s")
    finally:
        assert stop_airflow(handles)
    nothing_left.check("the Airflow stack")
