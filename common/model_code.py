"""A custom network's code travelling with its run: packed, staged by digest, fetched, verified.

``model.code_uri`` names a folder (its contents become one ``sys.path`` entry, so
``folder/mynet/arch.py`` is ``mynet.arch``) or one ``.py`` file (a top-level module), on a local
disk or under ``s3://``. The first task packs it into a tar.gz whose bytes depend on the files'
paths and contents only (sorted entries, no times or owners), so the same code always has the
same sha256, and stages it under the run's ``code/`` prefix (``RunPaths.code``). Every role
that builds the network downloads that archive through storage (never a shared folder: hosts
and EC2 roles reach it as they reach the shards), checks its sha256 against the one the first
task recorded, extracts it into a private folder and puts that folder first on ``sys.path``.

Problems are ``ModelCodeError`` (a ``ConfigError``): the same code fails the same way, so they
are never retried.
"""
from __future__ import annotations

import atexit
import contextlib
import gzip
import io
import os
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from common import storage
from common.config import ConfigError

ARCHIVE_NAME = "model_code.tar.gz"
# A network's code is small; a bigger folder is most likely the wrong one (a whole home folder).
MAX_CODE_BYTES = 50 << 20
# Left out of the archive: byte code (rebuilt on import) and version-control or editor leftovers.
_SKIPPED_DIRS = frozenset({"__pycache__", ".git", ".hg", ".svn", ".mypy_cache", ".pytest_cache"})


class ModelCodeError(ConfigError):
    """The custom network's code cannot be packed, fetched, verified or imported."""


@dataclass(frozen=True)
class StagedCode:
    """Where the staged archive is and the sha256 every role checks it against."""

    uri: str
    sha256: str


def _source_files(source: str) -> dict[str, bytes]:
    """``{archive path: bytes}`` of the folder or ``.py`` file ``source`` (local or s3://)."""
    if source.endswith(".py"):
        try:
            return {source.rsplit("/", 1)[-1]: storage.get_bytes(source)}
        except FileNotFoundError:
            raise ModelCodeError(f"model.code_uri {source}: no such file") from None
    base = storage.join(source, "")
    files: dict[str, bytes] = {}
    total = 0
    for uri in storage.list_uris(base):
        rel = uri[len(base):].lstrip("/")
        parts = rel.split("/")
        if any(p in _SKIPPED_DIRS for p in parts[:-1]) or rel.endswith((".pyc", ".pyo")):
            continue
        data = storage.get_bytes(uri)
        total += len(data)
        if total > MAX_CODE_BYTES:
            raise ModelCodeError(f"model.code_uri {source} holds more than {MAX_CODE_BYTES >> 20} MB: point it "
                                 "at the folder of the network's package, not a larger one")
        files[rel] = data
    if not files:
        raise ModelCodeError(f"model.code_uri {source}: no such folder, or it holds no files")
    return files


def pack(source: str) -> bytes:
    """The tar.gz of ``source``: the same files give the same bytes (and sha256)."""
    buf = io.BytesIO()
    # gzip's header holds a time and a file name; fixed here so the digest is the content's.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(_source_files(source).items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def stage(source: str, prefix: str) -> StagedCode:
    """Pack ``source`` and upload it under ``prefix`` (the run's ``code/``)."""
    archive = pack(source)
    uri = storage.join(prefix, ARCHIVE_NAME)
    storage.put_bytes(uri, archive)
    return StagedCode(uri=uri, sha256=storage.sha256_bytes(archive))


def fetch(staged: StagedCode, into: str) -> str:
    """Download the staged archive, check its sha256 and extract it into ``into``."""
    try:
        archive = storage.get_bytes(staged.uri)
    except FileNotFoundError:
        raise ModelCodeError(f"the staged model code {staged.uri} is missing") from None
    got = storage.sha256_bytes(archive)
    if got != staged.sha256:
        raise ModelCodeError(f"the staged model code {staged.uri} has sha256 {got}, not the {staged.sha256} "
                             "staged for this run: it was changed or corrupted after staging")
    return _extract(archive, into)


def _extract(archive: bytes, into: str) -> str:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        # The "data" filter refuses absolute paths, "..", links out of the folder and devices.
        tar.extractall(into, filter="data")
    return into


@contextlib.contextmanager
def on_path(code: StagedCode | str) -> Iterator[str]:
    """The code (staged: fetched and verified; a ``model.code_uri``: packed as a run would stage
    it) first on ``sys.path`` for the duration; afterwards the folder, its path entry and every
    module imported from it are gone again (a task process may check several runs' networks,
    whose modules may share names)."""
    with tempfile.TemporaryDirectory(prefix="mxpipe-code-") as folder:
        if isinstance(code, StagedCode):
            fetch(code, folder)
        else:
            _extract(pack(code), folder)
        sys.path.insert(0, folder)
        try:
            yield folder
        finally:
            sys.path.remove(folder)
            for name, module in list(sys.modules.items()):
                if (getattr(module, "__file__", None) or "").startswith(folder + os.sep):
                    del sys.modules[name]


def activate(staged: StagedCode) -> str:
    """The staged code, fetched and first on ``sys.path`` for the rest of the process (a role);
    the folder is removed when the process exits normally."""
    folder = tempfile.mkdtemp(prefix="mxpipe-code-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    fetch(staged, folder)
    sys.path.insert(0, folder)
    return folder
