"""Security properties checked against real parts: the embedded SeaweedFS S3 server (credentials
enforced, buckets private), a real local-backend ps-lite job (role ports bound to loopback only),
and a whole ``dag.test()`` pipeline run plus an encrypted local job scanned for secrets.

The CloudFormation side (ps-lite ports admitted only from the cluster's own security group, no
CIDR, no SSH) is checked over the template by test_cloudformation.py
(``test_template_security_properties`` and the moto deployment); it is not repeated here.

The secrets: the S3 key pair is the S3 fixture's real, randomly generated one (the pipeline must
be able to use it, so it cannot be fake; it is as recognisable as a fake: 20 and 40 random
characters); the MLflow token (``MLFLOW_TRACKING_TOKEN``, which the MLflow client sends as a
bearer token; the test server ignores it) and the checkpoint encryption key are fake and
recognisable. The DAG run gets the key pair and the token only through the ``aws_default`` and
``mlflow_default`` connections, as a deployment does. The DAG does not expose ``checkpoint.encryption_key_env``, so the encryption key is
checked on the local-job path only (a detached supervisor on the local backend, as the ``train``
task runs it). Every scan also plants a control secret in each kind of source it reads and requires the
scanner to find it there: a scan that read nothing could not pass.
"""
import json
import os
import sqlite3
import threading
import time
import urllib.error
import urllib.request
import uuid

import psutil
import pytest
from botocore.exceptions import ClientError
from common import storage
from common.procs import tagged_processes
from data_checks.shard import shard_dataset
from infra.s3_service import s3_client
from common.config import recipe
from testkit.dag_runs import airflow_env, run_confs
from testkit.local_jobs import make_job, run_job
from tests.integration.secret_scan import Scanner

pytestmark = pytest.mark.integration

REFUSED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"}
FAKE_KEY = "5ec7e7" + "c0ffee" * 9 + "5ec7"  # 64 hex digits: a 32-byte AES key, recognisable
FAKE_TOKEN = "mlflow-FAKE-TOKEN-" + uuid.uuid4().hex


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code") or exc.response["ResponseMetadata"]["HTTPStatusCode"])


@pytest.fixture(scope="module")
def secret_object(s3_server):
    key = f"security/{uuid.uuid4().hex}.txt"
    storage.put_bytes(f"s3://{s3_server.bucket}/{key}", b"private data")
    return key


# -- S3 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["anonymous", "unknown key", "right key, wrong secret"])
def test_s3_refuses_requests_without_valid_credentials(s3_server, secret_object, who):
    client = {"anonymous": s3_client(s3_server.endpoint, None, None, unsigned=True),
              "unknown key": s3_client(s3_server.endpoint, "AKIAWRONGWRONGWRONG1", "wrong" * 8),
              "right key, wrong secret": s3_client(s3_server.endpoint, s3_server.access_key, "wrong" * 8)}[who]
    calls = {
        "list buckets": lambda: client.list_buckets(),
        "list objects": lambda: client.list_objects_v2(Bucket=s3_server.bucket),
        "get object": lambda: client.get_object(Bucket=s3_server.bucket, Key=secret_object)["Body"].read(),
        "put object": lambda: client.put_object(Bucket=s3_server.bucket, Key="security/intruder.txt", Body=b"x"),
        "create bucket": lambda: client.create_bucket(Bucket=f"intruder-{uuid.uuid4().hex[:8]}"),
    }
    answered = {}
    for name, call in calls.items():
        try:
            call()
            answered[name] = "ALLOWED"
        except ClientError as exc:
            answered[name] = _code(exc)
    assert {k: v for k, v in answered.items() if v not in REFUSED} == {}, answered
    owner = s3_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    assert "security/intruder.txt" not in [o["Key"] for o in owner.list_objects_v2(
        Bucket=s3_server.bucket, Prefix="security/").get("Contents", [])]


def test_pipeline_bucket_is_private(s3_server, secret_object):
    # A plain browser-style GET (no signature at all) of an object and of the bucket listing.
    for path in (f"/{s3_server.bucket}/{secret_object}", f"/{s3_server.bucket}", "/"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(s3_server.endpoint + path, timeout=10).read()
        assert refused.value.code == 403, path
    owner = s3_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    # The ACL, where SeaweedFS reports one, grants nothing to everyone or to any authenticated user.
    acl = owner.get_bucket_acl(Bucket=s3_server.bucket)
    public = [g for g in acl.get("Grants", []) if "acs.amazonaws.com/groups/global" in str(g.get("Grantee"))]
    assert public == [], acl["Grants"]
    try:
        policy = json.loads(owner.get_bucket_policy(Bucket=s3_server.bucket)["Policy"])
    except ClientError as exc:
        assert _code(exc) in ("NoSuchBucketPolicy", "NotImplemented", "404"), exc
    else:
        assert not [s for s in policy.get("Statement", []) if s.get("Effect") == "Allow"
                    and s.get("Principal") in ("*", {"AWS": "*"})], policy


# -- ps-lite ports ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(s3_server, digits_csv):
    base = f"s3://{s3_server.bucket}/security-data"
    storage.put_bytes(storage.join(base, "digits.csv"), digits_csv)
    cfg = recipe("debug", storage.join(base, "digits.csv"))
    shard_dataset(cfg, storage.join(base, "shards"))
    return cfg, storage.join(base, "shards")


def _listening(pid: int) -> list[str]:
    """``addr:port`` of every listening TCP socket (v4 and v6) that process ``pid`` holds."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:  # the process just exited
        return []
    return [f"{c.laddr.ip}:{c.laddr.port}" if "." in c.laddr.ip else f"[{c.laddr.ip}]:{c.laddr.port}"
            for c in conns if c.status == psutil.CONN_LISTEN]


def test_local_job_binds_every_role_port_to_loopback(shards, s3_prefix, tmp_path):
    cfg, shards_prefix = shards
    tag = uuid.uuid4().hex
    job = make_job(cfg, shards_prefix, s3_prefix, optim={"epochs": 3})
    seen: dict[int, set[str]] = {}
    done = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            run_job(job, s3_prefix, tmp_path, env={"MXPIPE_SECURITY_TAG": tag})
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test thread
            failure.append(exc)
        finally:
            done.set()

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    while not done.wait(0.5):  # every socket any role process holds, polled for the whole job
        for pid in tagged_processes("MXPIPE_SECURITY_TAG", tag):
            seen.setdefault(pid, set()).update(_listening(pid))
    runner.join()
    assert not failure, failure
    listeners = sorted({a for addrs in seen.values() for a in addrs})
    assert len(seen) >= 4, seen  # scheduler, server, two workers were all observed
    assert listeners, "no listening socket seen: the poll missed the job"
    assert [a for a in listeners if not a.startswith("127.0.0.1:")] == [], listeners


# -- secrets ------------------------------------------------------------------------------------------


def _secrets(s3_server) -> dict[str, str | bytes]:
    return {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key,
            "MLFLOW_TRACKING_TOKEN": FAKE_TOKEN, "checkpoint key (hex)": FAKE_KEY,
            "checkpoint key (bytes)": bytes.fromhex(FAKE_KEY)}


def _plant(control: str, s3_server, paths: list[str]) -> None:
    """Put the control secret where the scan must look, one per kind of source."""
    for path in paths:
        with open(os.path.join(path, "control-plant.txt"), "w") as fh:
            fh.write(f"planted {control}\n")
    storage.put_bytes(f"s3://{s3_server.bucket}/security/control-plant.txt", control.encode())


def _check(scanner: Scanner, control: str, kinds: set[str]) -> None:
    found_in = {scanner.kinds.get(h.where) for h in scanner.hits if h.secret == "control"}
    missed = kinds - found_in
    assert not missed, f"the scan missed the planted control in: {missed}"
    leaks = [h for h in scanner.hits if h.secret != "control"]
    assert leaks == [], "secrets leaked:\n" + "\n".join(f"{h.secret} in {h.where}" for h in leaks)


def _connections(s3_server, mlflow_server) -> dict[str, str]:
    """The fixtures' servers as the ``aws_default`` and ``mlflow_default`` connections (JSON form),
    the S3 key pair and the MLflow token planted in them."""
    from urllib.parse import urlsplit

    from airflow.sdk import Connection

    tracking = urlsplit(mlflow_server.tracking_uri)
    aws = Connection(conn_id="aws_default", conn_type="aws", login=s3_server.access_key,
                     password=s3_server.secret_key,
                     extra=json.dumps({"endpoint_url": s3_server.endpoint, "region_name": "us-east-1"}))
    mlflow = Connection(conn_id="mlflow_default", conn_type="http", host=tracking.hostname, port=tracking.port,
                        schema=tracking.scheme, extra=json.dumps({"token": FAKE_TOKEN}))
    return {"AIRFLOW_CONN_AWS_DEFAULT": aws.as_json(), "AIRFLOW_CONN_MLFLOW_DEFAULT": mlflow.as_json()}


@pytest.mark.timeout(900)
def test_dag_run_through_connections_only_succeeds_and_leaks_no_secret(s3_server, mlflow_server,
                                                                        tmp_path_factory, digits_csv):
    """S3 and MLflow reach the tasks only as Airflow connections: no AWS or MLflow variable is in
    the run's environment. The run goes shard → register, and the secrets planted in the
    connections appear nowhere it leaves anything."""
    home = str(tmp_path_factory.mktemp("sec-home"))
    env = airflow_env(home, MXPIPE_ARTIFACT_ROOT=f"s3://{s3_server.bucket}/security-runs",
                      **_connections(s3_server, mlflow_server))
    env = {k: v for k, v in env.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    source = f"s3://{s3_server.bucket}/security-data/dag-digits.csv"
    storage.put_bytes(source, digits_csv)
    conf = {"dataset_uri": source, "label_column": "label", "recipe": "debug", "epochs": 2, "num_workers": 2,
            "num_servers": 1, "checkpoint_every_n_steps": 10, "registered_model_name": "digits-security"}
    report, output = run_confs(env, [conf])
    result = report["results"][0]
    assert result.get("state") == "success", (report, output[-4000:])
    # (the mapped shard and validate_shard tasks are not listed by the runner; the reuse branch is
    # skipped: this run trains)
    assert {t: v["state"] for t, v in result["tasks"].items()} == {
        **dict.fromkeys(("shard", "shard_parts", "shard_merge", "shard_names", "validate", "check_reuse", "provision",
                         "train", "release", "register"), "success"), "reuse": "skipped"}
    from mlflow.tracking import MlflowClient

    version = MlflowClient(mlflow_server.tracking_uri).get_model_version_by_alias("digits-security", "challenger")
    run = MlflowClient(mlflow_server.tracking_uri).get_run(version.run_id)
    assert run.data.tags["airflow.run_id"] == result["run_id"]

    control = "CONTROL-" + uuid.uuid4().hex
    airflow_home = env["AIRFLOW_HOME"]
    _plant(control, s3_server, [airflow_home])
    scanner = Scanner({**_secrets(s3_server), "control": control})
    scanner.text(output + f"\ncontrol {control}", "dag.test output (task logs)", "task log")
    scanner.tree(home, "file")  # task log files, cluster state, the Airflow DB file as bytes
    _scan_airflow_db(scanner, os.path.join(airflow_home, "airflow.db"), control)
    scanner.s3(s3_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key), s3_server.bucket)
    scanner.mlflow(mlflow_server.tracking_uri)
    _check(scanner, control, {"task log", "file", "airflow-db", "s3"})
    # The run's artifacts also live in the bucket (the server proxies them to S3), so the S3 scan
    # reads them whole; the API pass proves the MLflow side was reached at all.
    assert scanner.scanned.get("mlflow-field", 0) > 10 and scanner.scanned.get("mlflow-artifact", 0) >= 1, \
        scanner.scanned


def _scan_airflow_db(scanner: Scanner, db: str, control: str) -> None:
    """XCom values, rendered templates, DAG run confs and every other table, as text."""
    con = sqlite3.connect(db)
    try:
        for table in ("xcom", "rendered_task_instance_fields", "dag_run", "task_instance"):
            rows = con.execute(f"SELECT * FROM {table}").fetchall()  # noqa: S608 - fixed table names
            assert table != "xcom" or rows, "no XCom rows: the scan would prove nothing"
            scanner.text(repr(rows), f"airflow table {table}", "airflow-db")
        scanner.text("\n".join(con.iterdump()), "airflow db dump", "airflow-db")
    finally:
        con.close()
    scanner.text(f"planted {control}", "airflow table control", "airflow-db")


def test_encrypted_local_job_leaks_no_key(shards, s3_server, s3_prefix, tmp_path, caplog):
    cfg, shards_prefix = shards
    events = tmp_path / "events.jsonl"
    job = make_job(cfg, shards_prefix, s3_prefix, optim={"epochs": 2},
                   checkpoint={"encryption_key_env": "MXPIPE_TEST_CKPT_KEY", "every_n_steps": 10})
    # INFO: what a task log holds. At DEBUG botocore logs the signed Authorization header, which
    # names the access key id (never the secret); that is botocore's, and off in every task.
    caplog.set_level("INFO")
    run_job(job, s3_prefix, tmp_path, env={"MXPIPE_TEST_CKPT_KEY": FAKE_KEY, "MXPIPE_EVENTS_FILE": str(events),
                                           "MLFLOW_TRACKING_TOKEN": FAKE_TOKEN})
    assert events.exists() and "checkpoint committed" in events.read_text()
    control = "CONTROL-" + uuid.uuid4().hex
    _plant(control, s3_server, [str(tmp_path)])
    scanner = Scanner({**_secrets(s3_server), "control": control})
    scanner.text(caplog.text + f"\ncontrol {control}", "supervisor log", "task log")
    scanner.tree(str(tmp_path), "file")  # role output (events), process records
    scanner.s3(s3_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key), s3_server.bucket,
               prefix=s3_prefix.split("/", 3)[3])
    scanner.s3(s3_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key), s3_server.bucket,
               prefix="security/control")
    _check(scanner, control, {"task log", "file", "s3"})
    ckpts = storage.list_uris(job.checkpoint_prefix)
    assert ckpts, "no checkpoint written"


def test_scanner_finds_a_planted_secret_in_every_encoding():
    import base64

    scanner = Scanner({"key": bytes.fromhex(FAKE_KEY), "token": FAKE_TOKEN})
    for i, blob in enumerate([FAKE_TOKEN.encode(), b"x" + bytes.fromhex(FAKE_KEY) + b"y",
                              base64.b64encode(bytes.fromhex(FAKE_KEY)), FAKE_KEY.encode(),
                              base64.b64encode(FAKE_TOKEN.encode())]):
        scanner.bytes(blob, f"blob {i}", "test")
    assert sorted(h.where for h in scanner.hits) == [f"blob {i}" for i in range(5)]
    scanner.bytes(b"nothing here " + time.ctime().encode(), "clean", "test")
    assert len(scanner.hits) == 5
