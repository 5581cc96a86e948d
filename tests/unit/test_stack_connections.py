"""The local stack hands S3 and MLflow to Airflow as connections: the components' environment
(``infra.airflow_service.airflow_process_env``) holds ``AIRFLOW_CONN_AWS_DEFAULT`` /
``AIRFLOW_CONN_MLFLOW_DEFAULT`` and no AWS or MLflow variable, while ``python -m infra.services
env`` still prints the plain variables for a shell."""
import json
import os

import pytest
from airflow.sdk import Connection

from infra.airflow_service import airflow_process_env
from infra.services import main as services_main
from infra.stack_config import StackConfig, load_credentials

pytestmark = pytest.mark.unit


@pytest.fixture
def stack(tmp_path, monkeypatch):
    # Stray settings of the caller's shell must not reach the components.
    for key, value in {"AWS_ACCESS_KEY_ID": "AKIASTRAY", "AWS_SECRET_ACCESS_KEY": "stray",
                       "MLFLOW_TRACKING_URI": "http://stray", "MLFLOW_TRACKING_TOKEN": "stray-token",
                       "AIRFLOW_CONN_AWS_DEFAULT": "aws://stray"}.items():
        monkeypatch.setenv(key, value)
    cfg = StackConfig.with_free_ports(tmp_path)
    cfg.save()
    return cfg


def test_airflow_components_get_connections_and_no_aws_or_mlflow_variables(stack):
    env = airflow_process_env(stack)
    creds = load_credentials(stack.home)
    assert not [k for k in env if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
                or k.startswith(("AWS_ENDPOINT_URL", "MLFLOW_TRACKING_"))]
    aws = Connection.from_json(env["AIRFLOW_CONN_AWS_DEFAULT"], conn_id="aws_default")
    assert (aws.conn_type, aws.login, aws.password) == ("aws", creds["access_key"], creds["secret_key"])
    assert aws.extra_dejson == {"endpoint_url": stack.s3_endpoint, "region_name": "us-east-1"}
    mlflow = json.loads(env["AIRFLOW_CONN_MLFLOW_DEFAULT"])
    assert mlflow["extra"]["uri"] == stack.mlflow_uri
    assert env["MXPIPE_ARTIFACT_ROOT"] == f"s3://{stack.bucket}/runs"


def test_the_env_command_prints_plain_variables_for_a_shell(stack, capsys):
    assert services_main(["--home", str(stack.home), "env"]) == 0
    out = capsys.readouterr().out
    assert f"export AWS_ENDPOINT_URL_S3={stack.s3_endpoint}" in out
    assert f"export MLFLOW_TRACKING_URI={stack.mlflow_uri}" in out
    assert "AWS_SECRET_ACCESS_KEY=" in out and "AIRFLOW_CONN_" not in out
    assert services_main(["--home", str(stack.home), "env", "--airflow"]) == 0
    assert "export AIRFLOW_CONN_AWS_DEFAULT=" in capsys.readouterr().out


def test_task_logs_go_to_the_artifact_buckets_s3_through_the_aws_connection(stack):
    """Airflow's remote logging is on for a stack whose artifacts are in S3 (its task logs are
    readable from any host), with the connection the tasks use; off without an S3 root."""
    env = airflow_process_env(stack)
    assert env["AIRFLOW__LOGGING__REMOTE_LOGGING"] == "True"
    assert env["AIRFLOW__LOGGING__REMOTE_BASE_LOG_FOLDER"] == f"s3://{stack.bucket}/airflow-logs"
    assert env["AIRFLOW__LOGGING__REMOTE_LOG_CONN_ID"] == "aws_default"
    local = airflow_process_env(stack, client_env={"MXPIPE_ARTIFACT_ROOT": "/data/runs"})
    assert "AIRFLOW__LOGGING__REMOTE_LOGGING" not in local
