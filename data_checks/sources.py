"""Find the files of a source dataset, fingerprint them, and open them as byte streams.

A source is a file (``.csv``, ``.csv.gz``, ``.parquet``/``.pq``), a glob of files, or a folder
(a URI ending in ``/``): its table files, or an image folder when it holds ``labels.csv``.
Every URI goes through fsspec (``filesystems``): local paths and ``file://``, ``s3://`` (s3fs),
``gs://``, ``az://``, and single files over ``http(s)://`` (HTTP has no folder listing). URIs
stay as the user spelled them. The listing is cheap (one ``fs.info`` / ``fs.find`` /
``fs.glob``), and so is the fingerprint: the store's content identity + size per file (S3
ETag; see ``filesystems.store_identity``), sha256 per local file or file of a store that
reports none. Streams hash what they read, so the manifest records every source file's sha256
without a second pass.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from common import storage
from data_checks import filesystems
from data_checks.errors import DataError

_FORMATS = {".csv": "csv", ".csv.gz": "csv.gz", ".parquet": "parquet", ".pq": "parquet"}
LABELS_FILE = "labels.csv"
_READ_BLOCK = 8 << 20
_GLOB_CHARS = "*?["


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
    etag: str | None = None  # the store's content identity (S3 ETag; filesystems.store_identity)
    sha256: str | None = None  # local files, and files of stores that report no identity
    # Where the bytes are read from: the fsspec filesystem and the path on it (not the identity).
    fs: Any = field(default=None, compare=False, repr=False)
    path: str = field(default="", compare=False, repr=False)

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


class _Listed(NamedTuple):
    uri: str  # as the user spells it
    path: str  # on the filesystem
    info: dict[str, Any]  # what the filesystem reported (size, ETag, …)


def plan_source(spec: str) -> SourcePlan:
    """List the source's files (cheap: no data is read except local files' hashes)."""
    if not spec:
        raise DataError("data.source_uri is empty: nothing to shard")
    fs, path = filesystems.resolve(spec)
    if _is_glob(spec, fs):
        listed = _glob(fs, spec, path)
    else:
        if not spec.endswith("/"):
            with filesystems.read_errors(spec):
                info = fs.info(path)
            if info["type"] != "directory":
                table_format(spec)  # an unknown extension fails before reading any data
                return _table_plan(spec, fs, [_Listed(spec, path, info)])
            if not filesystems.is_local(fs):  # object stores: a key and a prefix may share a name
                raise DataError(f"source dataset not found: {spec} ({spec}/ is a folder: end the URI with '/')")
        folder = spec.rstrip("/") + "/"
        listed = _list(fs, folder, path)
        labels = storage.join(folder, LABELS_FILE)
        if any(f.uri == labels for f in listed):
            files = sorted(listed, key=lambda f: (f.uri != labels, f.uri))  # labels.csv first
            return SourcePlan(spec, "images", "images", _identified(fs, files), root=folder.rstrip("/"))
        listed = [f for f in listed if _is_table(f.uri)]
        if not listed:
            raise DataError(f"no CSV or Parquet files (and no {LABELS_FILE}) under {folder}")
    return _table_plan(spec, fs, listed)


def _table_plan(spec: str, fs: Any, listed: list[_Listed]) -> SourcePlan:
    formats = {table_format(f.uri) for f in listed}
    if len(formats) > 1:
        raise DataError(f"source {spec} mixes formats {sorted(formats)}: use one format per dataset")
    return SourcePlan(spec, "table", formats.pop(), _identified(fs, sorted(listed, key=lambda f: f.uri)))


def _is_table(uri: str) -> bool:
    try:
        table_format(uri)
        return True
    except DataError:
        return False


def _is_glob(spec: str, fs: Any) -> bool:
    text = spec.split("?", 1)[0] if filesystems.is_http(fs) else spec  # "?" starts an HTTP query
    return any(ch in text for ch in _GLOB_CHARS)


def _refuse_http_listing(fs: Any, spec: str) -> None:
    if filesystems.is_http(fs):
        raise DataError(f"cannot list {spec}: HTTP has no folder listing, so a glob or a folder is not "
                        f"supported over http(s); give the URL of one file (…/data.csv)")


def _list(fs: Any, folder: str, path: str) -> list[_Listed]:
    """Every file under ``folder`` (recursive), hidden files and folders and folder markers skipped."""
    _refuse_http_listing(fs, folder)
    with filesystems.read_errors(folder, "source folder not found"):
        found = fs.find(path, detail=True)
    if path in found:  # find() on a file returns the file
        raise DataError(f"source {folder} is a file, not a folder: drop the trailing '/'")
    out = _below(folder, path.rstrip("/") + "/", found)
    if not out:
        raise DataError(f"source folder is empty or missing: {folder}")
    return out


def _glob(fs: Any, spec: str, path: str) -> list[_Listed]:
    _refuse_http_listing(fs, spec)
    with filesystems.read_errors(spec):
        matched = fs.glob(path, detail=True)
    out = _below(spec[:_literal_end(spec)], path[:_literal_end(path)], matched)
    if not out:
        raise DataError(f"no source files match {spec}")
    return out


def _literal_end(pattern: str) -> int:
    """Where the folder part before a glob's first wildcard ends (after its last ``/``)."""
    first = min(pattern.index(ch) for ch in _GLOB_CHARS if ch in pattern)
    return pattern.rfind("/", 0, first) + 1


def _below(base_uri: str, base_path: str, found: dict[str, dict[str, Any]]) -> list[_Listed]:
    """The files in ``found`` (paths under ``base_path``), named as ``base_uri`` + the rest."""
    out = []
    for path, info in found.items():
        if not path.startswith(base_path):
            raise RuntimeError(f"the filesystem listed {path} outside {base_path}")
        rest = path[len(base_path):]
        hidden = any(part.startswith(".") for part in rest.split("/"))
        if info.get("type") == "file" and rest and not rest.endswith("/") and not hidden:
            out.append(_Listed(base_uri + rest, path, info))
    return sorted(out, key=lambda f: f.uri)


def _identified(fs: Any, listed: list[_Listed]) -> tuple[SourceFile, ...]:
    """The files with their fingerprint: the store's content identity and size, else (local
    files, HTTP servers without ETag) the sha256 and size of the bytes, read now."""
    out = []
    for f in listed:
        tag = filesystems.store_identity(f.info)
        if tag is not None and f.info.get("size") is not None:
            out.append(SourceFile(f.uri, int(f.info["size"]), etag=tag, fs=fs, path=f.path))
            continue
        with HashingReader(_open(fs, f.path, f.uri)) as reader:
            while reader.read(_READ_BLOCK):
                pass
        out.append(SourceFile(f.uri, reader.count, sha256=reader.sha256.hexdigest(), fs=fs, path=f.path))
    return tuple(out)


def _open(fs: Any, path: str, uri: str, cache_type: str = "readahead") -> Any:
    """``path`` opened for reading in bounded blocks.

    HTTP: one streaming GET (``block_size=0``): fsspec's random-access HTTP file needs Range
    requests, which many servers (Python's ``http.server`` among them) ignore. Elsewhere,
    ranged reads of ``_READ_BLOCK``: ``readahead`` fetches the next block with each miss,
    ``none`` just the bytes asked for.
    """
    options: dict[str, Any] = ({"block_size": 0} if filesystems.is_http(fs)
                               else {"block_size": _READ_BLOCK, "cache_type": cache_type})
    with filesystems.read_errors(uri, "source file not found"):
        return fs.open(path, "rb", **options)


class _Wrapper(io.RawIOBase):
    """A read-only stream over another one, which it closes."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        try:
            self._raw.close()
        finally:
            super().close()


class HashingReader(_Wrapper):
    """A read-only stream that hashes and counts the bytes passing through it."""

    def __init__(self, raw: Any, on_bytes: Callable[[int], None] | None = None) -> None:
        super().__init__(raw)
        self._on_bytes = on_bytes
        self.sha256 = hashlib.sha256()
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size if size is not None and size >= 0 else -1) or b""
        self.sha256.update(data)
        self.count += len(data)
        if self._on_bytes is not None and data:
            self._on_bytes(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


@contextmanager
def open_stream(source: SourceFile, on_bytes: Callable[[int], None] | None = None,
                span: tuple[int, int] | None = None, header: int = 0) -> Iterator[HashingReader]:
    """A hashing byte stream of ``source``, read in blocks of at most ``_READ_BLOCK`` ahead.

    ``span`` (a text file cut by byte ranges, ``data_checks.parts``): the first ``header`` bytes,
    then the lines that start inside ``[span[0], span[1])``: a line belongs to the range its first
    byte is in, so ranges that tile the file give every line to exactly one of them.
    """
    raw = _open(source.fs, source.path, source.uri)
    if span is not None:
        raw = _LineRange(raw, header, line_start(raw, span[0], header, source.bytes),
                         line_start(raw, span[1], header, source.bytes))
    reader = HashingReader(raw, on_bytes)
    try:
        yield reader
    finally:
        reader.close()


def open_ranged(source: SourceFile) -> Any:
    """``source`` opened for random access (a Parquet footer, then its row groups), read in
    ranged blocks of ``_READ_BLOCK``; the caller closes it."""
    return _open(source.fs, source.path, source.uri)


def line_start(raw: Any, offset: int, header: int, size: int) -> int:
    """The first line start at or after ``offset`` (a line starts after the header or a newline)."""
    if offset <= header:
        return header
    pos = offset - 1
    raw.seek(pos)
    while pos < size:
        block = raw.read(1 << 16)
        if not block:
            break
        found = block.find(b"\n")
        if found >= 0:
            return pos + found + 1
        pos += len(block)
    return size


class _LineRange(_Wrapper):
    """Bytes ``[0, header)`` then ``[start, stop)`` of a seekable file: one part's CSV text."""

    def __init__(self, raw: Any, header: int, start: int, stop: int) -> None:
        super().__init__(raw)
        self._pieces = [(0, header), (start, max(start, stop))]
        self._pos: int | None = None

    def read(self, size: int = -1) -> bytes:
        while self._pieces:
            begin, end = self._pieces[0]
            if self._pos is None:
                self._raw.seek(begin)
                self._pos = begin
            left = end - self._pos
            if left <= 0:
                self._pieces.pop(0)
                self._pos = None
                continue
            data = self._raw.read(left if size is None or size < 0 else min(size, left)) or b""
            if not data:
                raise OSError(f"unexpected end of file at byte {self._pos} (the file changed while read?)")
            self._pos += len(data)
            return data
        return b""


def read_head(source: SourceFile, limit: int = 1 << 20) -> bytes:
    """The first ``limit`` bytes (a ranged read where the store has them)."""
    blocks: list[bytes] = []
    with _open(source.fs, source.path, source.uri, cache_type="none") as raw:
        got = 0
        while got < limit and (block := raw.read(limit - got)):  # a stream may return fewer bytes
            blocks.append(block)
            got += len(block)
    return b"".join(blocks)


def local_copy(source: SourceFile, work_dir: str, on_bytes: Callable[[int], None] | None = None) -> tuple[str, str]:
    """A local path of ``source`` (downloaded into ``work_dir`` if remote) and its sha256.

    Parquet needs random access (its footer comes last); a local copy keeps memory bounded by
    the row group, not the file, at the price of disk space for one file at a time.
    """
    if filesystems.is_local(source.fs) and source.sha256:  # hashed by the plan
        if on_bytes is not None:
            on_bytes(source.bytes)
        return source.path, source.sha256
    path = os.path.join(work_dir, "source-" + hashlib.sha256(source.uri.encode()).hexdigest()[:16])
    with open_stream(source, on_bytes) as stream, open(path, "wb") as out:
        while block := stream.read(_READ_BLOCK):
            out.write(block)
        digest = stream.sha256.hexdigest()
    return path, digest


def read_bytes(source: SourceFile) -> bytes:
    """A whole (small) file, e.g. one image; a missing one is a ``DataError`` naming it."""
    with filesystems.read_errors(source.uri, "source file not found"):
        return source.fs.cat_file(source.path)
