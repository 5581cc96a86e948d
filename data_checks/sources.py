"""Read a source table (CSV or Parquet) from a local path or an s3:// URI.

Bytes come through ``common.storage``, so no s3fs is needed and tests can point the same code at
a temp folder or a local S3 server. pandas is imported lazily.
"""
from __future__ import annotations

import io
from typing import TYPE_CHECKING

from common import storage
from data_checks.errors import DataError

if TYPE_CHECKING:
    import pandas as pd

_FORMATS = {".csv": "csv", ".csv.gz": "csv.gz", ".parquet": "parquet", ".pq": "parquet"}


def table_format(uri: str) -> str:
    """``csv``, ``csv.gz`` or ``parquet``, from the URI's extension."""
    name = uri.lower().split("?", 1)[0]
    # Longest suffix first so ".csv.gz" wins over a bare ".gz" mismatch.
    for ext in sorted(_FORMATS, key=len, reverse=True):
        if name.endswith(ext):
            return _FORMATS[ext]
    raise DataError(f"unsupported source format for {uri}: expected one of {sorted(_FORMATS)}")


def read_bytes(uri: str) -> bytes:
    """The raw bytes of ``uri``; a missing object is a ``DataError`` naming it."""
    try:
        return storage.get_bytes(uri)
    except FileNotFoundError as exc:
        raise DataError(f"source dataset not found: {uri}") from exc
    except IsADirectoryError as exc:
        raise DataError(f"source dataset is a folder, not a file: {uri}") from exc


def parse_table(data: bytes, uri: str) -> "pd.DataFrame":
    """Parse ``data`` (the bytes of ``uri``) by the URI's extension."""
    import pandas as pd

    fmt = table_format(uri)
    buf = io.BytesIO(data)
    try:
        if fmt == "parquet":
            return pd.read_parquet(buf)
        return pd.read_csv(buf, compression="gzip" if fmt == "csv.gz" else None)
    except pd.errors.EmptyDataError as exc:
        raise DataError(f"source dataset is empty (no header, no rows): {uri}") from exc
    except (ValueError, OSError, pd.errors.ParserError) as exc:
        raise DataError(f"cannot parse {uri} as {fmt}: {exc}") from exc


def read_table(uri: str) -> "pd.DataFrame":
    table_format(uri)  # fail on an unknown extension before any I/O
    return parse_table(read_bytes(uri), uri)


def fingerprint(uri: str) -> str:
    """sha256 of the source's bytes: the identity of the data a run trained on."""
    return storage.sha256_bytes(read_bytes(uri))
