"""SeaweedFS as the stack's S3: ``weed mini`` with the home's credentials enforced, one bucket.

Traps (measured on this 2-core machine): ``weed mini`` also opens master, volume, filer and admin
ports, each with a gRPC port at +10000. All are passed explicitly: ``weed mini`` persists its
flags in ``<dir>/mini.options`` and reloads them on the next start, and its embedded maintenance
worker dials the admin at ``admin.port + 10000`` whatever ``-admin.port.grpc`` says. Telemetry
(on by default, to a public URL), WebDAV, Iceberg and Lance are switched off. The filer HTTP
port serves objects without S3 auth; it is bound to 127.0.0.1 (``StackConfig.s3_host``: only a
test's isolated bridge address otherwise). Data lives in
``<home>/s3/``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from common.procs import GroupRecord
from infra.processes import launch, wait_until
from infra.stack_config import (
    BIN_DIR,
    REGION,
    WEED_GRPC_OFFSET,
    ServiceError,
    StackConfig,
    check_ports_free,
    load_credentials,
    service_env,
)

log = logging.getLogger(__name__)


def weed_command(cfg: StackConfig) -> list[str]:
    ports = {"master": cfg.weed_master_port, "volume": cfg.weed_volume_port,
             "filer": cfg.weed_filer_port, "s3": cfg.s3_port, "admin": cfg.weed_admin_port}
    cmd = [str(BIN_DIR / "weed"), "mini", f"-dir={cfg.home / 's3'}", f"-ip={cfg.s3_host}",
           f"-ip.bind={cfg.s3_host}", "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
           "-s3.port.iceberg=0", "-s3.port.lance=0"]
    for part, port in ports.items():
        cmd += [f"-{part}.port={port}", f"-{part}.port.grpc={port + WEED_GRPC_OFFSET}"]
    return cmd


def s3_client(endpoint: str, access_key: str | None, secret_key: str | None, *,
              unsigned: bool = False) -> Any:
    """A boto3 client with short timeouts and no retries (for health checks and tests)."""
    import boto3
    import botocore
    from botocore.config import Config

    cfg = Config(connect_timeout=3, read_timeout=10, retries={"max_attempts": 1},
                 s3={"addressing_style": "path"},
                 signature_version=botocore.UNSIGNED if unsigned else None)
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, config=cfg,
        aws_access_key_id=access_key, aws_secret_access_key=secret_key)


def ensure_bucket(endpoint: str, access_key: str, secret_key: str, bucket: str) -> None:
    from botocore.exceptions import ClientError

    client = s3_client(endpoint, access_key, secret_key)
    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
        client.create_bucket(Bucket=bucket, ACL="private")
        log.info("created bucket %s", bucket)


def _check_auth_enforced(endpoint: str) -> None:
    """SeaweedFS enforces keys only when it was given some; make sure it did."""
    from botocore.exceptions import ClientError

    try:
        s3_client(endpoint, None, None, unsigned=True).list_buckets()
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "AccessDenied":
            return
        raise
    raise ServiceError(f"S3 at {endpoint} answers unsigned requests: credentials not enforced")


def start_s3(cfg: StackConfig, *, timeout_s: float = 60.0) -> GroupRecord:
    """Start ``weed mini`` with the home's credentials enforced; create the bucket."""
    creds = load_credentials(cfg.home)
    check_ports_free(cfg.weed_ports, "s3")
    (cfg.home / "s3").mkdir(parents=True, exist_ok=True)
    env = service_env({"AWS_ACCESS_KEY_ID": creds["access_key"],
                       "AWS_SECRET_ACCESS_KEY": creds["secret_key"]})
    handle = launch("s3", weed_command(cfg), env, cfg.home, port=cfg.s3_port)
    try:
        client = s3_client(cfg.s3_endpoint, creds["access_key"], creds["secret_key"])
        wait_until(lambda: client.list_buckets() is not None, timeout_s, "S3 list_buckets",
                   handle=handle)
        _check_auth_enforced(cfg.s3_endpoint)
        ensure_bucket(cfg.s3_endpoint, creds["access_key"], creds["secret_key"], cfg.bucket)
    except BaseException:
        stop_s3(handle)
        raise
    return handle


def stop_s3(handle: GroupRecord, timeout: float = 20.0) -> bool:
    ok = handle.stop(timeout)
    if ok and handle.port:  # weed leaves unix sockets named after its ports in /tmp
        cfg_ports = [int(a.split("=")[1]) for a in handle.cmd if ".port" in a and "=" in a]
        for port in cfg_ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
    return ok

