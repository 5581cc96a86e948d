"""All storage I/O of the pipeline goes through this module.

A URI is either ``s3://bucket/key`` or a local path (plain or ``file://``). Remote paths stay
strings: they never pass through ``pathlib``. The S3 client takes its endpoint and credentials
from the standard AWS environment variables (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``), so tests point it at a local S3 server by
setting the environment, not by passing clients around.

Source datasets are read through fsspec/s3fs instead (``data_checks.filesystems``, whose
``s3fs_options`` resolves the same endpoint and region). Shards, checkpoints and run artifacts
stay on boto3: the trainer image carries boto3 but not fsspec, s3fs or aiobotocore, and
checkpoints need the bounded retries and the multipart uploads tuned here.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from typing import Any

from common.settings import settings

log = logging.getLogger(__name__)

# Every S3 call is bounded: connect/read timeouts plus botocore's own retry with backoff.
_CONNECT_TIMEOUT_S = 10
_READ_TIMEOUT_S = 120
_MAX_ATTEMPTS = 5
# Inside ``fail_fast()``: one quick retry (a pooled connection the server closed) and a shorter
# wait for an answer. botocore's own retries with jittered backoff otherwise span up to about
# 31 s on a refused connection (measured 12-16 s), long enough to ride out a short outage
# silently: a caller with its own logged backoff would neither see nor count the failure.
_FAIL_FAST_MAX_ATTEMPTS = 1
_FAIL_FAST_READ_TIMEOUT_S = 30
_fail_fast = contextvars.ContextVar("storage_fail_fast", default=False)


class StorageError(RuntimeError):
    """A storage operation failed in a way the caller should report, not retry blindly."""


class AlreadyExists(StorageError):
    """A conditional write found the object already there (``If-None-Match: *``)."""


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``."""
    if not is_s3(uri):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    rest = uri[len("s3://"):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"S3 URI has no bucket: {uri!r}")
    return bucket, key


def join(base: str, *parts: str) -> str:
    """Join URI parts with single slashes (works for s3:// and local paths alike)."""
    out = base.rstrip("/")
    for p in parts:
        p = p.strip("/")
        if p:
            out = f"{out}/{p}"
    return out


def _local(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
    """S3 requests made in this block (this thread) fail within seconds when S3 is unreachable,
    for a caller that retries on its own with backoff it logs (the checkpoint writer). The
    connect timeout stays: it also bounds sending a request's body."""
    token = _fail_fast.set(True)
    try:
        yield
    finally:
        _fail_fast.reset(token)


@functools.lru_cache(maxsize=8)
def _client_for(endpoint: str | None, key_id: str | None, region: str, fast: bool = False) -> Any:
    import boto3
    from botocore.config import Config

    # botocore logs at INFO where it found the credentials ("Found credentials in environment
    # variables."): one line per client in every CLI, task and role log. Its warnings still pass.
    logging.getLogger("botocore.credentials").setLevel(logging.WARNING)
    cfg = Config(
        connect_timeout=_CONNECT_TIMEOUT_S,
        read_timeout=_FAIL_FAST_READ_TIMEOUT_S if fast else _READ_TIMEOUT_S,
        retries={"max_attempts": _FAIL_FAST_MAX_ATTEMPTS if fast else _MAX_ATTEMPTS, "mode": "standard"},
        s3={"addressing_style": "path"},
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name=region, config=cfg)


def s3_client() -> Any:
    """A boto3 S3 client for the endpoint and credentials in the current environment (the
    fail-fast one inside ``fail_fast()``)."""
    env = settings()
    return _client_for(env.s3_endpoint, env.aws_access_key_id, env.aws_region, _fail_fast.get())


def _is_not_found(exc: Exception) -> bool:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


SSE_MODES = ("", "AES256", "aws:kms")


def sse_args(mode: str, kms_key_id: str = "") -> dict[str, str]:
    """S3 server-side encryption arguments of a put: ``""`` (none), ``AES256`` (SSE-S3) or
    ``aws:kms`` (SSE-KMS, with ``kms_key_id`` or the bucket's default key)."""
    if mode not in SSE_MODES:
        raise ValueError(f"server-side encryption must be one of {SSE_MODES}, got {mode!r}")
    if not mode:
        return {}
    args = {"ServerSideEncryption": mode}
    if mode == "aws:kms" and kms_key_id:
        args["SSEKMSKeyId"] = kms_key_id
    return args


def put_bytes(uri: str, data: bytes, *, if_none_match: bool = False, extra_args: Mapping[str, str] | None = None,
              multipart_threshold: int = 0, multipart_chunk: int = 16 << 20, max_concurrency: int = 4) -> None:
    """Write ``data`` to ``uri``. With ``if_none_match`` the write fails if the object exists.

    ``extra_args`` are added to the S3 request (e.g. ``sse_args(...)``; ignored for local
    paths). With ``multipart_threshold`` > 0, an S3 object at least that large is uploaded in
    parts of ``multipart_chunk`` bytes, ``max_concurrency`` at a time (not with
    ``if_none_match``: a conditional write is one request).
    """
    if is_s3(uri):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        extra = dict(extra_args or {})
        if multipart_threshold and not if_none_match and len(data) >= multipart_threshold:
            _put_multipart(uri, data, extra, multipart_threshold, multipart_chunk, max_concurrency)
            return
        kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Body": data, **extra}
        if if_none_match:
            kwargs["IfNoneMatch"] = "*"
        try:
            s3_client().put_object(**kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                raise AlreadyExists(f"{uri} already exists") from exc
            raise StorageError(f"cannot write {uri}: {code or exc}") from exc
        return
    path = _local(uri)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if if_none_match:
        try:
            with open(path, "xb") as fh:
                fh.write(data)
        except FileExistsError as exc:
            raise AlreadyExists(f"{uri} already exists") from exc
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _put_multipart(uri: str, data: bytes, extra: dict[str, str], threshold: int, chunk: int,
                   concurrency: int) -> None:
    import io

    from boto3.exceptions import S3UploadFailedError
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_s3(uri)
    cfg = TransferConfig(multipart_threshold=threshold, multipart_chunksize=chunk, max_concurrency=concurrency)
    try:
        s3_client().upload_fileobj(io.BytesIO(data), bucket, key, ExtraArgs=extra or None, Config=cfg)
    except (S3UploadFailedError, ClientError, BotoCoreError) as exc:
        raise StorageError(f"cannot write {uri}: {exc}") from exc


def get_bytes(uri: str) -> bytes:
    if is_s3(uri):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        try:
            return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if _is_not_found(exc):
                raise FileNotFoundError(uri) from exc
            raise StorageError(f"cannot read {uri}: {exc}") from exc
    with open(_local(uri), "rb") as fh:
        return fh.read()


def exists(uri: str) -> bool:
    if is_s3(uri):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        try:
            s3_client().head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as exc:
            if _is_not_found(exc):
                return False
            raise StorageError(f"cannot stat {uri}: {exc}") from exc
    return os.path.exists(_local(uri))


def list_uris(prefix: str) -> Iterator[str]:
    """Every object URI under ``prefix`` (recursive), in lexicographic order."""
    return (uri for uri, _ in list_objects(prefix))


def list_objects(prefix: str) -> Iterator[tuple[str, float]]:
    """Every object under ``prefix`` (recursive) with its modification time (epoch seconds: the
    S3 server's clock, or the file's mtime), in lexicographic order of the URI."""
    if is_s3(prefix):
        bucket, key = split_s3(prefix)
        key = key.rstrip("/") + "/" if key else ""
        paginator = s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=key):
            for obj in page.get("Contents", []):
                yield f"s3://{bucket}/{obj['Key']}", obj["LastModified"].timestamp()
        return
    root = _local(prefix)
    if not os.path.isdir(root):
        return
    found = []
    for dirpath, _, files in os.walk(root):
        found.extend(os.path.join(dirpath, f) for f in files)
    for path in sorted(found):
        try:
            yield path, os.stat(path).st_mtime
        except FileNotFoundError:  # deleted since the walk
            continue


def delete_uris(uris: list[str]) -> None:
    """Delete these objects (full URIs, of one bucket); a missing one is no error."""
    s3 = [u for u in uris if is_s3(u)]
    for i in range(0, len(s3), 1000):
        batch = s3[i:i + 1000]
        bucket = split_s3(batch[0])[0]
        s3_client().delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": split_s3(u)[1]} for u in batch],
                                                          "Quiet": True})
    for uri in uris:
        if not is_s3(uri):
            try:
                os.remove(_local(uri))
            except FileNotFoundError:
                pass


def delete_prefix(prefix: str) -> int:
    """Delete every object under ``prefix``; returns how many were deleted."""
    uris = list(list_uris(prefix))
    if is_s3(prefix):
        delete_uris(uris)
    else:
        shutil.rmtree(_local(prefix), ignore_errors=True)
    return len(uris)


def upload_file(local_path: str, uri: str) -> None:
    if is_s3(uri):
        bucket, key = split_s3(uri)
        s3_client().upload_file(local_path, bucket, key)
        return
    dest = _local(uri)
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    shutil.copyfile(local_path, dest)


def download_file(uri: str, local_path: str) -> None:
    os.makedirs(os.path.dirname(local_path) or ".", exist_ok=True)
    if is_s3(uri):
        from botocore.exceptions import ClientError

        bucket, key = split_s3(uri)
        try:
            s3_client().download_file(bucket, key, local_path)
        except ClientError as exc:
            if _is_not_found(exc):
                raise FileNotFoundError(uri) from exc
            raise
        return
    shutil.copyfile(_local(uri), local_path)


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
