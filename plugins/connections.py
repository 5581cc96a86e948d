"""What the deployment's Airflow holds for the pipeline: the S3 and MLflow Connections, and the
cluster backends' settings as Variables, turned into what the layers below read.

The layers below are Airflow-free and read the standard environment: ``common.storage`` and
s3fs build their clients from ``AWS_ENDPOINT_URL_S3``, ``AWS_DEFAULT_REGION`` and the credentials
boto3 finds itself; ``training.tracking.server`` reads ``MLFLOW_TRACKING_URI`` and MLflow its
``MLFLOW_TRACKING_TOKEN`` / ``_USERNAME`` / ``_PASSWORD``. So a task resolves its connections
once, at its start, and applies them to its own process's environment for its duration
(``task_environment``); the roles of a job get the S3 part through the environment the train task
starts them with (``role_base_env``). Nothing of it goes into logs (every credential is handed
to Airflow's secrets masker), XCom, rendered templates or MLflow.

- **S3**: the Amazon provider's AWS connection ``aws_default``, or the one the training DAG's
  ``aws_conn_id`` Param names, read through ``AwsBaseHook`` (client type ``s3``): credentials
  from ``get_credentials()`` (frozen; short-lived when the connection assumes a role, valid for
  the role session's duration, one hour unless the connection's ``assume_role_kwargs`` say
  otherwise), the endpoint from the extra ``endpoint_url`` or ``service_config.s3.endpoint_url``,
  the region from ``region_name``. A connection with no credential source of its own (no keys,
  role or profile: the provider's "empty connection") leaves the credentials to boto3's chain.
- **MLflow**: the connection ``mlflow_default`` (or the ``mlflow_conn_id`` Param's): the server
  from the extra ``uri``, else ``schema://host:port`` like Airflow's HTTP connections (schema
  ``http`` unless set; a host that holds a scheme is taken whole); the extra ``token``, else
  login + password (basic auth), else the password alone as a token.
- **Cluster settings**: the Variables ``mxpipe_hosts`` and ``mxpipe_ec2`` hold the JSON the
  ``MXPIPE_HOSTS_FILE`` / ``MXPIPE_EC2_FILE`` files hold (``infra.cluster_settings``).

Fallback: where the default connection does not exist (no ``aws_default``, no
``mlflow_default``) the task's environment stays as it is, as in a shell without Airflow. A
connection named by a Param must exist. What a connection sets replaces the environment's
value; what it leaves unset (an endpoint, a region) the environment still may set.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from common.errors import DeterministicError
from common.roles import TRACKING_SECRETS
from plugins.failures import fail_without_retry

if TYPE_CHECKING:
    from airflow.sdk import Connection

    from infra.cluster_settings import SettingsSource

AWS_DEFAULT_CONN_ID = "aws_default"
MLFLOW_DEFAULT_CONN_ID = "mlflow_default"
# The training DAG's Params that name other connections (empty: the default ids above).
AWS_CONN_PARAM, MLFLOW_CONN_PARAM = "aws_conn_id", "mlflow_conn_id"
CLUSTER_VARIABLES = {"hosts": "mxpipe_hosts", "ec2": "mxpipe_ec2"}

MLFLOW_AUTH = TRACKING_SECRETS

# The value None in an environment change means "unset this variable".
EnvChanges = dict[str, "str | None"]
F = TypeVar("F", bound=Callable[..., Any])


class ConnectionSettingsError(DeterministicError, ValueError):
    """A connection is missing or cannot say what the pipeline needs (deterministic)."""


def _mask(*values: str | None) -> None:
    from airflow.sdk.log import mask_secret

    for value in values:
        if value:
            mask_secret(value)


def _connection(conn_id: str, *, required: bool) -> Connection | None:
    """The connection ``conn_id`` from Airflow's secrets backends (environment variables, a
    configured backend, the metadata DB); None when it is not defined and not ``required``."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        if required:
            raise ConnectionSettingsError(f"Airflow connection {conn_id!r} is not defined") from None
        return None


def aws_env(conn_id: str) -> EnvChanges:
    """The AWS environment of connection ``conn_id``, resolved by the Amazon provider's hook."""
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    hook = AwsBaseHook(aws_conn_id=conn_id, client_type="s3")
    config = hook.conn_config
    env: EnvChanges = {}
    endpoint = config.get_service_endpoint_url("s3")
    if endpoint:
        env["AWS_ENDPOINT_URL_S3"] = endpoint
    if hook.region_name:
        env["AWS_DEFAULT_REGION"] = hook.region_name
    if config.aws_access_key_id or config.role_arn or config.profile_name:
        creds = hook.get_credentials(region_name=hook.region_name)
        _mask(creds.access_key, creds.secret_key, creds.token)
        # A token or profile of the environment must not travel with the connection's keys.
        env.update({"AWS_ACCESS_KEY_ID": creds.access_key, "AWS_SECRET_ACCESS_KEY": creds.secret_key,
                    "AWS_SESSION_TOKEN": creds.token or None, "AWS_PROFILE": None})
    return env


def mlflow_uri(conn: Connection) -> str:
    """The tracking server of an MLflow connection: the extra ``uri``, else schema://host:port."""
    uri = conn.extra_dejson.get("uri")
    if uri:
        return str(uri)
    if not conn.host:
        raise ConnectionSettingsError(f"connection {conn.conn_id!r} names no MLflow server: set its host "
                               "(with schema and port) or the extra 'uri'")
    base = conn.host if "://" in conn.host else f"{conn.schema or 'http'}://{conn.host}"
    return f"{base}:{conn.port}" if conn.port else base


def mlflow_env(conn: Connection) -> EnvChanges:
    """The MLflow environment of a connection: its server, and its token or basic auth; the
    auth variables it does not set are unset (another server's credentials are not sent)."""
    env: EnvChanges = {"MLFLOW_TRACKING_URI": mlflow_uri(conn), **dict.fromkeys(MLFLOW_AUTH)}
    token = conn.extra_dejson.get("token")
    if token:
        env["MLFLOW_TRACKING_TOKEN"] = str(token)
    elif conn.login and conn.password:
        env.update({"MLFLOW_TRACKING_USERNAME": conn.login, "MLFLOW_TRACKING_PASSWORD": conn.password})
    elif conn.login:
        raise ConnectionSettingsError(f"connection {conn.conn_id!r} has a login but no password: basic auth "
                               "needs both (or put a token in the password or the extra 'token')")
    elif conn.password:
        env["MLFLOW_TRACKING_TOKEN"] = conn.password
    _mask(*(env[k] for k in MLFLOW_AUTH))
    return env


def _conn_id(params: Mapping[str, Any], param: str, default: str) -> tuple[str, bool]:
    """The connection id a Param names (then it must exist), else the default id."""
    named = str(params.get(param) or "").strip()
    return (named, True) if named else (default, False)


def connection_env(params: Mapping[str, Any] | None = None) -> EnvChanges:
    """The environment changes of the run's AWS and MLflow connections (see the module docstring);
    empty where neither exists."""
    params = params or {}
    env: EnvChanges = {}
    aws_id, required = _conn_id(params, AWS_CONN_PARAM, AWS_DEFAULT_CONN_ID)
    if _connection(aws_id, required=required) is not None:
        env.update(aws_env(aws_id))
    mlflow_id, required = _conn_id(params, MLFLOW_CONN_PARAM, MLFLOW_DEFAULT_CONN_ID)
    conn = _connection(mlflow_id, required=required)
    if conn is not None:
        env.update(mlflow_env(conn))
    return env


def aws_conn_id(params: Mapping[str, Any] | None) -> str:
    """The AWS connection id of a run: its ``aws_conn_id`` Param's, else the default id."""
    return _conn_id(params or {}, AWS_CONN_PARAM, AWS_DEFAULT_CONN_ID)[0]


def storage_env(conn_id: str) -> EnvChanges:
    """The AWS environment of ``conn_id`` where it is defined, else nothing (the process's own):
    for code that reads S3 outside a task (a trigger in the triggerer)."""
    return aws_env(conn_id) if _connection(conn_id, required=False) is not None else {}


def _apply(changes: EnvChanges) -> None:
    """Set (or, for None, unset) each variable in this process's environment."""
    for key, value in changes.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextmanager
def task_environment(params: Mapping[str, Any] | None = None) -> Iterator[None]:
    """This process's environment with the run's connections applied, restored on the way out.
    A missing or unusable connection fails the task without a retry."""
    # The one helper that snapshots variables and puts them back (tests/unit/test_settings.py).
    from training.tracking.runs import environ_restored

    try:
        changes = connection_env(params)
    except ConnectionSettingsError as exc:
        raise fail_without_retry(f"connections: {exc}") from exc
    with environ_restored(changes):
        _apply(changes)
        yield


def with_connections(func: F) -> F:
    """Run a task function inside ``task_environment`` of its run's Params."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from airflow.sdk import get_current_context

        with task_environment(get_current_context()["params"]):
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def apply_connections() -> None:
    """The default connections applied for the rest of this process: a task of its own (Airflow 3
    runs each task in a process of its own), for code that cannot wrap its work."""
    try:
        _apply(connection_env())
    except ConnectionSettingsError as exc:
        raise fail_without_retry(f"connections: {exc}") from exc


def role_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a job's roles start from: the task's, without what only Airflow and the
    tracking side use (Airflow's config and connections, MLflow credentials); the roles read S3
    and nothing else of it."""
    return {k: v for k, v in environ.items() if not k.startswith("AIRFLOW") and k not in MLFLOW_AUTH}


def supervisor_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a job's supervisor starts from: the roles' plus the MLflow credentials
    its live run uses (it keeps them from the roles: ``training.launch.supervise``)."""
    return {**role_base_env(environ), **{k: v for k, v in environ.items() if k in MLFLOW_AUTH}}


def cluster_settings(backend: str) -> SettingsSource | None:
    """The backend's settings from its Airflow Variable (JSON text; None where the backend has
    none: ``local``). A Variable that is not set leaves the settings file as the fallback."""
    from airflow.sdk import Variable

    from infra.cluster_settings import SettingsSource

    name = CLUSTER_VARIABLES.get(backend)
    if name is None:
        return None
    return SettingsSource(f"Airflow Variable {name}", Variable.get(name, default=None))
