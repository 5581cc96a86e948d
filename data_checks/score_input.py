"""The table a batch-scoring run reads: its files, its fingerprint, its parts, its rows in chunks.

The input is named like a training source (``sources``: a file, a glob or a folder ending in
``/``; CSV, CSV.gz or Parquet; local, ``s3://`` and the other fsspec stores) but has no label
column: it is whatever the model takes. ``plan_input`` lists it (one ``fs.info`` / ``glob``; the
fingerprint is ``SourcePlan.digest()``: the store's content identity and size of every file) and
reads every file's column names and types from its header (CSV: the first MiB; Parquet: the
footer, by ranged reads), so the schema check runs before any row is read.

``parts`` cuts the input into the units one mapped scoring task takes: a CSV file is one part (a
text file cannot be entered in the middle), a Parquet file one part per run of row groups of at
most ``part_rows`` rows. ``read_rows`` streams one part (or file) as pandas frames of at most
``chunk_rows`` rows: memory follows the chunk (and a Parquet row group), never the table.

pyarrow and pandas are imported inside the functions.
"""
from __future__ import annotations

import io
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from data_checks import sources
from data_checks.errors import DataError

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class InputFile:
    """One file of the input: where, its identity, its columns (name → Arrow type as read) and,
    for Parquet, the rows of each row group (CSV: unknown until read)."""

    uri: str
    format: str
    identity: dict[str, Any]
    columns: dict[str, str]
    row_groups: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class InputPlan:
    spec: str
    fingerprint: str  # sha256 of the files' identities (sources.SourcePlan.digest)
    files: list[InputFile]

    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "fingerprint": self.fingerprint, "files": [f.to_dict() for f in self.files]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InputPlan:
        return cls(d["spec"], d["fingerprint"], [InputFile(**f) for f in d["files"]])


def plan_input(spec: str) -> InputPlan:
    """List the input's files and read each one's columns; a folder of images is refused."""
    plan = sources.plan_source(spec)
    if plan.kind != "table":
        raise DataError(f"scoring input {spec} is an image folder; batch scoring reads tables (CSV or Parquet)")
    files = []
    for source in plan.files:
        if source.bytes == 0:
            raise DataError(f"scoring input file is empty (no header, no rows): {source.uri}")
        if plan.format == "parquet":
            columns, groups = _parquet_layout(source)
        else:
            columns, groups = _csv_columns(source, plan.format == "csv.gz"), []
        files.append(InputFile(source.uri, plan.format, source.identity(), columns, groups))
    return InputPlan(spec, plan.digest(), files)


def _parquet_layout(source: sources.SourceFile) -> tuple[dict[str, str], list[int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with _open_parquet(source) as pf:
            schema = pf.schema_arrow
            groups = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"cannot read {source.uri} as Parquet (truncated or corrupt?): {exc}") from None
    return {n: str(schema.field(n).type) for n in schema.names if not n.startswith("__index_level_")}, groups


def _csv_columns(source: sources.SourceFile, gz: bool) -> dict[str, str]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    from data_checks.readers import _csv_head  # the training reader's: whole lines of the first MiB

    head = _csv_head(source, gz)
    try:
        sample = pcsv.read_csv(io.BytesIO(head), read_options=pcsv.ReadOptions(use_threads=False))
    except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
        raise DataError(f"cannot parse {source.uri} as CSV: {exc}") from None
    return {n: str(sample.schema.field(n).type) for n in sample.column_names}


@contextmanager
def _open_parquet(source: sources.SourceFile) -> Iterator[Any]:
    """``pq.ParquetFile`` over the fsspec file (ranged reads: the footer, then the row groups read)."""
    import pyarrow.parquet as pq

    raw = sources.open_ranged(source)
    try:
        yield pq.ParquetFile(raw)
    finally:
        raw.close()


def parts(plan: InputPlan, part_rows: int) -> list[dict[str, Any]]:
    """The mapped tasks' units, in input order: ``{"index", "file", "uri", "row_groups": [first,
    stop] | None}``; a CSV file is one part, a Parquet file one part per ``part_rows`` rows of
    whole row groups (at least one group each)."""
    out: list[dict[str, Any]] = []
    for k, f in enumerate(plan.files):
        if f.format != "parquet":
            out.append({"index": len(out), "file": k, "uri": f.uri, "row_groups": None})
            continue
        start, rows = 0, 0
        for g, n in enumerate(f.row_groups):
            if rows and rows + n > part_rows:
                out.append({"index": len(out), "file": k, "uri": f.uri, "row_groups": [start, g]})
                start, rows = g, 0
            rows += n
        if start < len(f.row_groups) or not f.row_groups:
            out.append({"index": len(out), "file": k, "uri": f.uri, "row_groups": [start, len(f.row_groups)]})
    return out


def source_file(plan: InputPlan, k: int) -> sources.SourceFile:
    """File ``k`` listed again, refused if its bytes changed since the plan was made (a scoring
    task must read what the checks read)."""
    recorded = plan.files[k]
    (now,) = sources.plan_source(recorded.uri).files
    if now.identity() != recorded.identity:
        raise DataError(f"scoring input {recorded.uri} changed since it was checked: was {recorded.identity}, "
                        f"now {now.identity()}; start a new run")
    return now


def read_rows(plan: InputPlan, part: dict[str, Any], columns: Sequence[str], text_columns: Sequence[str],
              chunk_rows: int) -> Iterator[pd.DataFrame]:
    """The rows of ``part`` (``columns`` only, in that order) as frames of at most ``chunk_rows``
    rows; ``text_columns`` are read as text (a CSV column of digits is still a category)."""
    f = plan.files[part["file"]]
    source = source_file(plan, part["file"])
    if f.format == "parquet":
        yield from _parquet_rows(source, part["row_groups"], list(columns), chunk_rows)
    else:
        yield from _csv_rows(source, f.format == "csv.gz", list(columns), set(text_columns), f.columns, chunk_rows)


def _parquet_rows(source: sources.SourceFile, groups: list[int] | None, columns: list[str],
                  chunk_rows: int) -> Iterator[pd.DataFrame]:
    import pyarrow as pa

    with _open_parquet(source) as pf:
        chosen = list(range(*groups)) if groups else list(range(pf.num_row_groups))
        try:
            for batch in pf.iter_batches(batch_size=chunk_rows, row_groups=chosen, columns=columns):
                yield batch.to_pandas()
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"cannot read {source.uri} as Parquet (truncated or corrupt?): {exc}") from None


def _csv_rows(source: sources.SourceFile, gz: bool, columns: list[str], text: set[str], types: dict[str, str],
              chunk_rows: int) -> Iterator[pd.DataFrame]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    # Numbers as float32, as the sharder parsed them for training (the model casts to float32 too).
    column_types = {c: pa.string() if c in text or types.get(c) in ("string", "large_string") else pa.float32()
                    for c in columns}
    convert = pcsv.ConvertOptions(column_types=column_types, strings_can_be_null=True, include_columns=columns)
    with sources.open_stream(source) as stream:
        raw: Any = pa.CompressedInputStream(pa.PythonFile(stream, mode="r"), "gzip") if gz else stream
        try:
            reader = pcsv.open_csv(raw, read_options=pcsv.ReadOptions(block_size=4 << 20), convert_options=convert)
            pending: list[Any] = []
            rows = 0
            for batch in reader:
                pending.append(batch)
                rows += batch.num_rows
                while rows >= chunk_rows:
                    table = pa.Table.from_batches(pending)
                    yield table.slice(0, chunk_rows).to_pandas()
                    rest = table.slice(chunk_rows)
                    pending, rows = rest.to_batches(), rest.num_rows
            if rows:
                yield pa.Table.from_batches(pending).to_pandas()
        except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
            raise DataError(f"cannot parse {source.uri} as CSV: {exc}") from None
