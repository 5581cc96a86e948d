"""Find the files of a source dataset, fingerprint them, and open them as byte streams.

A source is a file (``.csv``, ``.csv.gz``, ``.parquet``/``.pq``), a glob of files, or a folder
(a URI ending in ``/``): its table files, or an image folder when it holds ``labels.csv``.
Local paths and ``s3://`` URIs work alike. The listing is cheap (S3 ``ListObjectsV2`` /
``HeadObject``), and so is the fingerprint: S3 ETag + size per object (content-derived), sha256
per local file. Streams hash what they read, so the manifest records every source file's
sha256 without a second pass.
"""
from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from common import storage
from data_checks.errors import DataError

_FORMATS = {".csv": "csv", ".csv.gz": "csv.gz", ".parquet": "parquet", ".pq": "parquet"}
LABELS_FILE = "labels.csv"
_READ_BLOCK = 8 << 20


def table_format(uri: str) -> str:
    """``csv``, ``csv.gz`` or ``parquet``, from the URI's extension."""
    name = uri.lower().split("?", 1)[0]
    for ext in sorted(_FORMATS, key=len, reverse=True):  # ".csv.gz" before ".gz"
        if name.endswith(ext):
            return _FORMATS[ext]
    raise DataError(f"unsupported source format for {uri}: expected one of {sorted(_FORMATS)}")


@dataclass(frozen=True)
class SourceFile:
    uri: str
    bytes: int
    etag: str | None = None  # S3 objects
    sha256: str | None = None  # local files (computed by the fingerprint)

    def identity(self) -> dict[str, Any]:
        return {"uri": self.uri, "bytes": self.bytes, "etag": self.etag, "sha256": self.sha256}


@dataclass(frozen=True)
class SourcePlan:
    """What will be read: ``kind`` ``table`` (``format`` csv/csv.gz/parquet) or ``images``."""

    spec: str
    kind: str
    format: str
    files: tuple[SourceFile, ...]  # tables: data files in read order; images: every file
    root: str = ""  # images: the folder holding labels.csv

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def identity(self) -> list[dict[str, Any]]:
        return [f.identity() for f in self.files]

    def digest(self) -> str:
        """sha256 of the files' identities: changes when any file's bytes change."""
        canon = json.dumps({"kind": self.kind, "format": self.format, "files": self.identity()}, sort_keys=True)
        return hashlib.sha256(canon.encode()).hexdigest()


def plan_source(spec: str) -> SourcePlan:
    """List the source's files (cheap: no data is read except local files' hashes)."""
    if not spec:
        raise DataError("data.source_uri is empty: nothing to shard")
    if any(ch in spec for ch in "*?["):
        files = _glob(spec)
    elif spec.endswith("/") or (not storage.is_s3(spec) and os.path.isdir(_local(spec))):
        folder = spec.rstrip("/") + "/"
        listed = _list(folder)
        labels = storage.join(folder, LABELS_FILE)
        if any(f.uri == labels for f in listed):
            files = sorted(listed, key=lambda f: (f.uri != labels, f.uri))  # labels.csv first
            return SourcePlan(spec, "images", "images", tuple(_with_local_sha(files)), root=folder.rstrip("/"))
        files = [f for f in listed if _is_table(f.uri)]
        if not files:
            raise DataError(f"no CSV or Parquet files (and no {LABELS_FILE}) under {folder}")
    else:
        if not _is_table(spec) and storage.is_s3(spec) and _s3_folder(spec):
            raise DataError(f"source dataset not found: {spec} ({spec}/ is a folder: end the URI with '/')")
        table_format(spec)  # an unknown extension fails before reading any data
        files = [_stat(spec)]
    formats = {table_format(f.uri) for f in files}
    if len(formats) > 1:
        raise DataError(f"source {spec} mixes formats {sorted(formats)}: use one format per dataset")
    return SourcePlan(spec, "table", formats.pop(), tuple(_with_local_sha(sorted(files, key=lambda f: f.uri))))


def _is_table(uri: str) -> bool:
    try:
        table_format(uri)
        return True
    except DataError:
        return False


def _local(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri


def _stat(uri: str) -> SourceFile:
    if storage.is_s3(uri):
        from botocore.exceptions import ClientError

        bucket, key = storage.split_s3(uri)
        try:
            head = storage.s3_client().head_object(Bucket=bucket, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                hint = f" ({uri}/ is a folder: end the URI with '/')" if _s3_folder(uri) else ""
                raise DataError(f"source dataset not found: {uri}{hint}") from None
            raise
        return SourceFile(uri, int(head["ContentLength"]), etag=head.get("ETag", "").strip('"'))
    path = _local(uri)
    if not os.path.exists(path):
        raise DataError(f"source dataset not found: {uri}")
    return SourceFile(uri, os.path.getsize(path))


def _s3_folder(uri: str) -> bool:
    bucket, key = storage.split_s3(uri)
    listed = storage.s3_client().list_objects_v2(Bucket=bucket, Prefix=key.rstrip("/") + "/", MaxKeys=1)
    return bool(listed.get("KeyCount"))


def _list(folder: str) -> list[SourceFile]:
    """Every object under ``folder`` (recursive), hidden files and folder markers skipped."""
    out: list[SourceFile] = []
    if storage.is_s3(folder):
        bucket, key = storage.split_s3(folder)
        paginator = storage.s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=key):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(key):]
                if name and not name.endswith("/") and not name.rsplit("/", 1)[-1].startswith("."):
                    out.append(SourceFile(f"s3://{bucket}/{obj['Key']}", int(obj["Size"]),
                                          etag=obj.get("ETag", "").strip('"')))
    else:
        root = _local(folder).rstrip("/")
        if not os.path.isdir(root):
            raise DataError(f"source folder not found: {folder}")
        for dirpath, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(names):
                if not name.startswith("."):
                    path = os.path.join(dirpath, name)
                    out.append(SourceFile(path, os.path.getsize(path)))
    if not out:
        raise DataError(f"source folder is empty or missing: {folder}")
    return sorted(out, key=lambda f: f.uri)


def _glob(spec: str) -> list[SourceFile]:
    first = min(spec.index(ch) for ch in "*?[" if ch in spec)
    base = spec[:first].rsplit("/", 1)[0] + "/"
    try:
        listed = _list(base)
    except DataError:
        listed = []
    pattern = spec if storage.is_s3(spec) else _local(spec)
    matched = [f for f in listed if fnmatch.fnmatchcase(f.uri, pattern)]
    if not matched:
        raise DataError(f"no source files match {spec}")
    return matched


def _with_local_sha(files: list[SourceFile]) -> list[SourceFile]:
    """Local files get their sha256 now (the fingerprint); S3 objects are identified by ETag."""
    return [f if storage.is_s3(f.uri) else SourceFile(f.uri, f.bytes, sha256=storage.sha256_file(_local(f.uri)))
            for f in files]


class HashingReader(io.RawIOBase):
    """A read-only stream that hashes and counts the bytes passing through it."""

    def __init__(self, raw: Any, on_bytes: Callable[[int], None] | None = None) -> None:
        self._raw = raw
        self._on_bytes = on_bytes
        self.sha256 = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size if size is not None and size >= 0 else None) or b""
        self.sha256.update(data)
        self.count += len(data)
        if self._on_bytes is not None and data:
            self._on_bytes(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


@contextmanager
def open_stream(uri: str, on_bytes: Callable[[int], None] | None = None) -> Iterator[HashingReader]:
    """A hashing byte stream of ``uri`` (one GET for S3; bounded by the client's read timeout)."""
    if storage.is_s3(uri):
        bucket, key = storage.split_s3(uri)
        raw: Any = storage.s3_client().get_object(Bucket=bucket, Key=key)["Body"]
    else:
        raw = open(_local(uri), "rb")
    reader = HashingReader(raw, on_bytes)
    try:
        yield reader
    finally:
        reader.close()


def read_head(uri: str, limit: int = 1 << 20) -> bytes:
    """The first ``limit`` bytes (a ranged GET on S3)."""
    if storage.is_s3(uri):
        bucket, key = storage.split_s3(uri)
        return storage.s3_client().get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{limit - 1}")["Body"].read()
    with open(_local(uri), "rb") as fh:
        return fh.read(limit)


def local_copy(source: SourceFile, work_dir: str, on_bytes: Callable[[int], None] | None = None) -> tuple[str, str]:
    """A local path of ``source`` (downloaded into ``work_dir`` if remote) and its sha256.

    Parquet needs random access (its footer comes last); a local copy keeps memory bounded by
    the row group, not the file, at the price of disk space for one file at a time.
    """
    if not storage.is_s3(source.uri):
        if on_bytes is not None:
            on_bytes(source.bytes)
        return _local(source.uri), source.sha256 or storage.sha256_file(_local(source.uri))
    path = os.path.join(work_dir, "source-" + hashlib.sha256(source.uri.encode()).hexdigest()[:16])
    with open_stream(source.uri, on_bytes) as stream, open(path, "wb") as out:
        while block := stream.read(_READ_BLOCK):
            out.write(block)
        digest = stream.sha256.hexdigest()
    return path, digest


def read_bytes(uri: str) -> bytes:
    """A whole (small) object, e.g. one image; a missing one is a ``DataError`` naming it."""
    try:
        return storage.get_bytes(uri)
    except FileNotFoundError as exc:
        raise DataError(f"source file not found: {uri}") from exc
    except IsADirectoryError as exc:
        raise DataError(f"source path is a folder, not a file: {uri}") from exc

