"""Airflow connections and Variables → the environment the layers below read
(``plugins.connections``), with real ``Connection`` objects written to ``AIRFLOW_CONN_*`` in
their URI or JSON form and resolved by Airflow's own secrets backends and the Amazon provider's
hook. Role assumption goes to an in-process moto STS."""
import json
import os
import re

import pytest
from airflow.sdk import Connection
from airflow.sdk.exceptions import AirflowFailException

from infra.cluster_settings import ClusterSettingsError, SettingsSource, cluster_options
from plugins import connections
from plugins.connections import ConnectionSettingsError, connection_env, role_base_env, task_environment

pytestmark = pytest.mark.unit

KEY, SECRET = "AKIAMXPIPEUNITTEST01", "unit/secret+key=" + "s" * 24
S3_ENDPOINT = "http://127.0.0.1:18333"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No connection, Variable or AWS/MLflow variable from outside; a throwaway Airflow home."""
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    for key in list(os.environ):
        if key.startswith(("AIRFLOW_CONN_", "AIRFLOW_VAR_", "AWS_", "MLFLOW_TRACKING_")):
            monkeypatch.delenv(key)


def _define(monkeypatch, conn: Connection, form: str) -> None:
    value = conn.get_uri() if form == "uri" else conn.as_json()
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn.conn_id.upper()}", value)


def _aws(conn_id="aws_default", extra=None, **fields) -> Connection:
    return Connection(conn_id=conn_id, conn_type="aws", extra=json.dumps(extra or {}), **fields)


def _mlflow(conn_id="mlflow_default", extra=None, **fields) -> Connection:
    return Connection(conn_id=conn_id, conn_type="http", extra=json.dumps(extra or {}), **fields)


# -- S3 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["uri", "json"])
def test_a_role_less_key_pair_gives_keys_endpoint_and_region(monkeypatch, form):
    _define(monkeypatch, _aws(login=KEY, password=SECRET,
                              extra={"endpoint_url": S3_ENDPOINT, "region_name": "eu-west-1"}), form)
    assert connection_env() == {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                                "AWS_SESSION_TOKEN": None, "AWS_PROFILE": None,
                                "AWS_ENDPOINT_URL_S3": S3_ENDPOINT, "AWS_DEFAULT_REGION": "eu-west-1"}


def test_a_session_token_and_the_s3_service_endpoint_are_carried(monkeypatch):
    _define(monkeypatch, _aws(extra={"aws_access_key_id": KEY, "aws_secret_access_key": SECRET,
                                     "aws_session_token": "session-token-1", "endpoint_url": "http://global:1",
                                     "service_config": {"s3": {"endpoint_url": S3_ENDPOINT}}}), "json")
    env = connection_env()
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SESSION_TOKEN"]) == (KEY, "session-token-1")
    assert env["AWS_ENDPOINT_URL_S3"] == S3_ENDPOINT  # the service's own endpoint wins


def test_a_role_is_assumed_into_short_lived_credentials(monkeypatch):
    from moto import mock_aws

    _define(monkeypatch, _aws(login=KEY, password=SECRET,
                              extra={"role_arn": "arn:aws:iam::123456789012:role/mxpipe-training",
                                     "region_name": "us-east-1"}), "json")
    with mock_aws():
        env = connection_env()
    assert env["AWS_ACCESS_KEY_ID"] and env["AWS_ACCESS_KEY_ID"] != KEY
    assert env["AWS_SECRET_ACCESS_KEY"] != SECRET and env["AWS_SESSION_TOKEN"]


def test_an_empty_aws_connection_leaves_the_credentials_to_boto3(monkeypatch):
    _define(monkeypatch, _aws(extra={"endpoint_url": S3_ENDPOINT}), "uri")
    assert connection_env() == {"AWS_ENDPOINT_URL_S3": S3_ENDPOINT}


def test_the_credentials_are_masked_in_logs(monkeypatch):
    from airflow.sdk._shared.secrets_masker import redact

    _define(monkeypatch, _aws(login=KEY, password=SECRET), "json")
    _define(monkeypatch, _mlflow(host="mlflow", extra={"token": "mlflow-token-masked"}), "json")
    connection_env()
    line = f"key={KEY} secret={SECRET} token=mlflow-token-masked"
    assert redact(line) == "key=*** secret=*** token=***"


# -- MLflow -------------------------------------------------------------------------------------


@pytest.mark.parametrize("conn,uri,auth", [
    # host/schema/port, the password as a token
    (_mlflow(host="mlflow.example", schema="https", port=8443, password="tok-1"), "https://mlflow.example:8443",
     {"MLFLOW_TRACKING_TOKEN": "tok-1"}),
    # the extra's uri and token win
    (_mlflow(host="ignored", extra={"uri": "http://127.0.0.1:5000/mlflow", "token": "tok-2"}),
     "http://127.0.0.1:5000/mlflow", {"MLFLOW_TRACKING_TOKEN": "tok-2"}),
    # login + password: basic auth; a host with a scheme is taken whole
    (_mlflow(host="http://tracking", port=5000, login="reviewer", password="pw"), "http://tracking:5000",
     {"MLFLOW_TRACKING_USERNAME": "reviewer", "MLFLOW_TRACKING_PASSWORD": "pw"}),
    # no auth at all: schema defaults to http
    (_mlflow(host="tracking"), "http://tracking", {}),
])
@pytest.mark.parametrize("form", ["uri", "json"])
def test_mlflow_connection_gives_uri_and_auth(monkeypatch, conn, uri, auth, form):
    _define(monkeypatch, conn, form)
    expected = {"MLFLOW_TRACKING_URI": uri, **dict.fromkeys(connections.MLFLOW_AUTH), **auth}
    assert connection_env() == expected


@pytest.mark.parametrize("conn,needle", [
    (_mlflow(login="someone"), "names no MLflow server"),
    (_mlflow(host="tracking", login="someone"), "login but no password"),
])
def test_an_unusable_mlflow_connection_is_named(monkeypatch, conn, needle):
    _define(monkeypatch, conn, "json")
    with pytest.raises(ConnectionSettingsError, match=needle):
        connection_env()


# -- which connections, and the task's environment ----------------------------------------------


def test_without_connections_the_environment_is_the_fallback(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://from-env:5000")
    assert connection_env({"aws_conn_id": "", "mlflow_conn_id": ""}) == {}
    with task_environment({}):
        assert os.environ["AWS_ACCESS_KEY_ID"] == KEY
        assert os.environ["MLFLOW_TRACKING_URI"] == "http://from-env:5000"


def test_params_name_other_connections(monkeypatch):
    _define(monkeypatch, _aws(login="AKIADEFAULT000000000", password="default-secret"), "json")
    _define(monkeypatch, _aws(conn_id="s3_prod", login=KEY, password=SECRET), "json")
    _define(monkeypatch, _mlflow(conn_id="tracking_prod", host="prod"), "json")
    env = connection_env({"aws_conn_id": "s3_prod", "mlflow_conn_id": "tracking_prod"})
    assert (env["AWS_ACCESS_KEY_ID"], env["MLFLOW_TRACKING_URI"]) == (KEY, "http://prod")


def test_a_named_connection_that_does_not_exist_fails_the_task():
    with pytest.raises(AirflowFailException, match="connection 'nope' is not defined"):
        with task_environment({"aws_conn_id": "nope"}):
            pass


def test_the_task_environment_is_applied_then_restored(monkeypatch):
    monkeypatch.setenv("AWS_SESSION_TOKEN", "stale-token")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "another-servers-token")
    _define(monkeypatch, _aws(login=KEY, password=SECRET, extra={"endpoint_url": S3_ENDPOINT}), "uri")
    _define(monkeypatch, _mlflow(host="tracking", port=5000), "uri")
    with task_environment({}):
        assert (os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_ENDPOINT_URL_S3"]) == (KEY, S3_ENDPOINT)
        assert "AWS_SESSION_TOKEN" not in os.environ and "MLFLOW_TRACKING_TOKEN" not in os.environ
        assert os.environ["MLFLOW_TRACKING_URI"] == "http://tracking:5000"
    assert "AWS_ACCESS_KEY_ID" not in os.environ and "MLFLOW_TRACKING_URI" not in os.environ
    assert os.environ["AWS_SESSION_TOKEN"] == "stale-token"
    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "another-servers-token"


def test_roles_get_the_s3_settings_but_not_airflows_or_mlflows_secrets():
    task_env = {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL_S3": S3_ENDPOINT,
                "MXPIPE_ARTIFACT_ROOT": "s3://b/runs", "PATH": "/usr/bin",
                "AIRFLOW_CONN_AWS_DEFAULT": "{...}", "AIRFLOW__CORE__FERNET_KEY": "f", "AIRFLOW_CTX_DAG_ID": "d",
                "MLFLOW_TRACKING_URI": "http://t", "MLFLOW_TRACKING_TOKEN": "tok", "MLFLOW_TRACKING_PASSWORD": "pw"}
    assert role_base_env(task_env) == {
        "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL_S3": S3_ENDPOINT,
        "MXPIPE_ARTIFACT_ROOT": "s3://b/runs", "PATH": "/usr/bin", "MLFLOW_TRACKING_URI": "http://t"}


# -- cluster settings from Variables ------------------------------------------------------------

HOSTS = [{"name": "h0", "address": "10.0.0.1"}]


def test_the_hosts_variable_wins_over_the_file(monkeypatch, tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps([{"name": "from-file", "address": "10.9.9.9"}]))
    monkeypatch.setenv("MXPIPE_HOSTS_FILE", str(path))
    monkeypatch.setenv("AIRFLOW_VAR_MXPIPE_HOSTS", json.dumps(HOSTS))
    source = connections.cluster_settings("hosts")
    assert source == SettingsSource("Airflow Variable mxpipe_hosts", json.dumps(HOSTS))
    assert cluster_options("hosts", source) == {"hosts": HOSTS}
    monkeypatch.delenv("AIRFLOW_VAR_MXPIPE_HOSTS")
    assert cluster_options("hosts", connections.cluster_settings("hosts"))["hosts"][0]["name"] == "from-file"
    assert connections.cluster_settings("local") is None


@pytest.mark.parametrize("text,needle", [
    ("[{oops", "Airflow Variable mxpipe_ec2: not a JSON document"),
    ('["lt-1"]', "Airflow Variable mxpipe_ec2: expected a JSON object, got list"),
])
def test_a_malformed_variable_is_named(monkeypatch, text, needle):
    monkeypatch.setenv("AIRFLOW_VAR_MXPIPE_EC2", text)
    with pytest.raises(ClusterSettingsError, match=needle):
        cluster_options("ec2", connections.cluster_settings("ec2"))


def test_missing_settings_name_the_variable_and_the_file(monkeypatch):
    monkeypatch.delenv("MXPIPE_EC2_FILE", raising=False)
    with pytest.raises(ClusterSettingsError, match="needs MXPIPE_EC2_FILE .* or the Airflow Variable mxpipe_ec2"):
        cluster_options("ec2", connections.cluster_settings("ec2"))


# The Variables are checked as strictly as the config: a typo or a value of the wrong type fails
# the run's provision task without a retry, naming the Variable, instead of taking the default.
@pytest.mark.parametrize("backend,value,needle", [
    ("ec2", {"launch_template": "lt-1", "spto": True},
     "Airflow Variable mxpipe_ec2: unknown config key 'spto' (did you mean 'spot'?)"),
    ("ec2", {"launch_template": "lt-1", "spot": "true"},
     "Airflow Variable mxpipe_ec2: spot must be true or false, got 'true' (a string)"),
    ("hosts", [{"name": "h0", "address": "10.0.0.1", "ssh_prot": 2222}],
     "Airflow Variable mxpipe_hosts: hosts[0]: unknown config key 'ssh_prot' (did you mean 'ssh_port'?)"),
    ("hosts", [{"name": "h0", "address": "10.0.0.1"}, {"name": "h1", "address": "10.0.0.2", "ssh_port": "22"}],
     "Airflow Variable mxpipe_hosts: hosts[1]: ssh_port must be an integer, got '22' (a string)"),
])
def test_a_variable_with_an_unknown_key_or_a_wrong_type_fails_the_provision_task_naming_it(monkeypatch, backend,
                                                                                           value, needle):
    from plugins.pipeline_tasks import cluster_spec

    monkeypatch.setenv(f"AIRFLOW_VAR_{connections.CLUSTER_VARIABLES[backend].upper()}", json.dumps(value))
    with pytest.raises(ClusterSettingsError) as refused:
        cluster_options(backend, connections.cluster_settings(backend))
    assert needle in str(refused.value).splitlines()
    config = {"cluster": {"backend": backend}}
    with pytest.raises(AirflowFailException, match=f"provision: {re.escape(needle)}"):
        cluster_spec(config, {}, "mxnet_training", "run-1")
