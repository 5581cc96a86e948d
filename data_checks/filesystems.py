"""Which fsspec filesystem reads a source URI, with which options, and what its errors mean.

Every source URI (a local path, ``file://``, ``s3://``, ``gs://``, ``az://``, ``http(s)://``)
resolves to an fsspec filesystem and a path on it. S3 goes through s3fs with the endpoint and
region the rest of the project uses (``s3fs_options``, the one place that builds them). A
filesystem is made fresh for each resolution (no instance cache): a plan sees the current
environment and credentials, and never a listing cached by an earlier plan.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from data_checks.errors import DataError

_S3_PROTOCOLS = ("s3", "s3a")
_HTTP_PROTOCOLS = ("http", "https")
_DENIED = (401, 403)


def s3fs_options() -> dict[str, Any]:
    """The s3fs options of the project's S3: the endpoint and region ``common.storage`` gives
    boto3, path-style addressing like it. The credentials are not passed: aiobotocore reads
    them from the same AWS environment (or profile, or instance role) as boto3 does."""
    from common.settings import settings

    s = settings()
    return {"endpoint_url": s.s3_endpoint,
            "client_kwargs": {"region_name": s.aws_region},
            "config_kwargs": {"s3": {"addressing_style": "path"}}}


def resolve(uri: str) -> tuple[Any, str]:
    """``(filesystem, path)`` of ``uri``; a protocol without a filesystem is a ``DataError``."""
    import fsspec
    from fsspec.core import url_to_fs
    from fsspec.utils import get_protocol

    protocol = get_protocol(uri)
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise DataError(f"unsupported protocol {protocol}:// in {uri}: no fsspec filesystem reads it "
                        f"(sources are local paths or file://, s3://, gs://, az://, http(s):// URIs)") from None
    except ImportError as exc:
        raise DataError(f"{_install_hint(protocol, exc)} to read {protocol}:// sources ({uri})") from None
    options = s3fs_options() if protocol in _S3_PROTOCOLS else {}
    return url_to_fs(uri, skip_instance_cache=True, **options)


def _install_hint(protocol: str, exc: ImportError) -> str:
    """``install gcsfs``: the package that carries the protocol (fsspec's own message if it
    is fsspec's implementation that lacks a dependency, e.g. aiohttp for HTTP)."""
    from fsspec.registry import known_implementations

    package = known_implementations.get(protocol, {}).get("class", "").split(".")[0]
    return f"install {package}" if package and package != "fsspec" else str(exc)


def is_local(fs: Any) -> bool:
    return "file" in _protocols(fs)


def is_http(fs: Any) -> bool:
    return any(p in _HTTP_PROTOCOLS for p in _protocols(fs))


def _protocols(fs: Any) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def store_identity(info: dict[str, Any]) -> str | None:
    """The content identity the store reports for a file, or None (then the bytes are hashed).

    Best first: GCS ``md5Hash`` and HTTP ``Content-MD5`` are the MD5 of the bytes; an ETag
    (``ETag`` on S3 and HTTP, ``etag`` on GCS and Azure) changes whenever the bytes are
    rewritten, and on S3 it is the content MD5 of a single-part upload. ``fs.checksum()`` is
    not used: it tokenizes the whole info dict, modification time included, so it is not
    derived from the content. ``Last-Modified`` is not either, and is ignored.
    """
    for key in ("md5Hash", "Content-MD5", "ETag", "etag"):
        if info.get(key):
            return str(info[key]).strip('"')
    return None


def _status(exc: BaseException | None) -> Any:
    return getattr(exc, "status", None) or getattr(exc, "code", None)


@contextmanager
def read_errors(uri: str, missing: str = "source dataset not found") -> Iterator[None]:
    """fsspec's errors on ``uri`` as ``DataError`` s naming the problem (``missing``: the
    words for a file that is not there); an unreachable server stays a retryable error."""
    try:
        yield
    except PermissionError as exc:
        raise DataError(f"permission denied reading {uri}: {exc}") from None
    except IsADirectoryError:
        raise DataError(f"source path is a folder, not a file: {uri}") from None
    except FileNotFoundError as exc:
        cause = exc.__cause__  # fsspec's HTTP filesystem reports any failed request as not found
        if _status(cause) in _DENIED:
            raise DataError(f"permission denied reading {uri}: {cause}") from None
        if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
            raise ConnectionError(f"cannot reach {uri}: {cause}") from cause
        raise DataError(f"{missing}: {uri}") from None
    except Exception as exc:
        if _status(exc) in _DENIED:
            raise DataError(f"permission denied reading {uri}: {exc}") from None
        raise
