"""Stream a table source (CSV, CSV.gz, Parquet; one or many files) as bounded chunks.

Memory follows ``data.chunk_rows`` (and pyarrow's CSV block, sized from it), never the
dataset: CSV is parsed by pyarrow's streaming reader straight from the byte stream (an fsspec
file read in blocks); Parquet is read row group by row group from a local copy. Every problem that
stops rows from being decoded at all is a ``DataError`` naming the file and, where known, the
column and the value: a missing label column, a feature column that is neither numeric nor
text (text columns are categorical: their values are read as codes), a truncated gzip
or Parquet file, bytes that are not UTF-8, a file whose columns differ from the first file's.
Problems *in* decodable values (NaN, inf, out-of-range, labels outside the declared set,
duplicate ids) are left for validation to report.
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from data_checks import sources
from data_checks.errors import DataError

if TYPE_CHECKING:
    import pyarrow as pa

    from common.config import DataConfig

log = logging.getLogger(__name__)

_HEAD_BYTES = 1 << 20
_MIN_BLOCK, _MAX_BLOCK = 256 << 10, 4 << 20
_PANDAS_INDEX = re.compile(r"__index_level_\d+__")


@dataclass
class Chunk:
    features: np.ndarray  # [n, num_features] float32 (NaN/inf kept for validation to report);
    # a categorical column holds the code of its value in TableReader.categories, NaN if missing
    label_codes: np.ndarray  # [n] int64 indices into label_values
    label_values: list[Any]  # canonical class values (see canonical_label)
    row_ids: np.ndarray  # [n] int64 row numbers over the whole source
    id_hashes: np.ndarray | None  # [n] uint64 hash of the id column, None without one
    # Regression: [n, num_targets] float32 (NaN/inf kept for validation); None for classes.
    targets: np.ndarray | None = None

    def payload(self) -> np.ndarray:
        """What a record holds after its header: the features, then the targets (regression)."""
        return self.features if self.targets is None else np.hstack([self.features, self.targets])


@dataclass
class Layout:
    """Which source columns play which role; fixed by the first file."""

    label_column: str
    id_column: str
    feature_columns: list[str]
    source_columns: list[dict[str, str]] = field(default_factory=list)  # name + type, as read
    target_columns: list[str] = field(default_factory=list)  # regression: the float targets, in order
    categorical: list[str] = field(default_factory=list)  # text feature columns, read as codes

    def schema(self) -> dict[str, Any]:
        targets = {"target_columns": self.target_columns, "target_dtype": "float32"} if self.target_columns else {}
        return {"label_column": self.label_column, "id_column": self.id_column or None,
                "feature_columns": self.feature_columns, "feature_dtype": "float32", **targets,
                "source_columns": self.source_columns, "categorical_columns": self.categorical}

    @property
    def role_columns(self) -> list[str]:
        """The columns that are not features: the label (or the targets), then the id."""
        return [*(self.target_columns or [self.label_column]), *([self.id_column] if self.id_column else [])]


@dataclass
class Part:
    """What a reader of one part of a source needs besides its files (``data_checks.parts``)."""

    layout: Layout  # the whole source's (its first file's)
    first_row: int = 0  # the row number of the part's first row in the whole source
    span: tuple[int, int] | None = None  # one CSV file's byte range: rows whose line starts in it
    categories: dict[str, dict[str, int]] | None = None  # the whole source's codes (None: learn them)
    counting: bool = False  # the counting pass: read labels and categories only


def canonical_label(value: Any) -> Any:
    """A class value as JSON keeps it: ints (also "3", 3.0, "3.0") stay ints, the rest is text.

    CSV labels are read as text and Parquet labels as typed values; both pass through here so
    the same data gives the same classes in either format. ``None`` means missing.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return int(value) if float(value).is_integer() else str(value)
    text = str(value)
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return text
    return int(number) if math.isfinite(number) and number.is_integer() else text


def hash_ids(values: np.ndarray) -> np.ndarray:
    """64-bit hashes of id values (as text): stable across runs, machines and chunkings."""
    import pandas as pd

    return pd.util.hash_array(np.asarray(values, dtype=object), categorize=True).astype(np.uint64)


class TableReader:
    """Iterate :class:`Chunk` s over every file of a table source, in file order.

    ``targets`` (regression): the float target columns, read into ``Chunk.targets``; the label
    column then plays no part. ``()`` (classification): the label column is read as classes.
    """

    def __init__(self, plan: sources.SourcePlan, data: "DataConfig", work_dir: str,
                 on_bytes: Callable[[int], None] | None = None, targets: tuple[str, ...] = (),
                 part: "Part | None" = None) -> None:
        self.plan = plan
        # One part of the source (mapped sharding, ``data_checks.parts``): its files or byte range,
        # the whole source's layout and category codes, and the row number of its first row.
        self.part = part
        self.data = data
        self.targets = list(targets)
        self.work_dir = work_dir
        self.on_bytes = on_bytes
        self.layout: Layout | None = None
        self.files_read: list[dict[str, Any]] = []  # uri, bytes, sha256 (+ etag) per file read
        self.rows = 0
        # Per categorical column: its values in order of first appearance (a value's code is its
        # position), over every split; preprocessing keeps the train split's.
        self.categories: dict[str, dict[str, int]] = {}
        if part is not None:
            self.layout = part.layout
            self.categories = {c: dict(v) for c, v in part.categories.items()} if part.categories is not None \
                else {c: {} for c in part.layout.categorical}
            self.rows = part.first_row

    def chunks(self) -> Iterator[Chunk]:
        for source in self.plan.files:
            if source.bytes == 0:
                raise DataError(f"source dataset is empty (no header, no rows): {source.uri}")
            read = self._csv if self.plan.format.startswith("csv") else self._parquet
            before = self.rows
            yield from read(source)
            if self.rows == before and (self.part is None or self.part.span is None):
                log.warning("source file %s has a header but no rows", source.uri)
        if self.rows == 0 and self.part is None:  # a part may be empty; the merge checks the whole
            raise DataError(f"source dataset has no rows (header only): {self.plan.spec}")

    def probe_layout(self) -> Layout:
        """The first file's layout, from its head (CSV) or its footer (Parquet): no rows are read.
        A wrong label, id or feature column fails here, before any part is read."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = self.plan.files[0]
        if source.bytes == 0:
            raise DataError(f"source dataset is empty (no header, no rows): {source.uri}")
        if self.plan.format.startswith("csv"):
            self._csv_sample(source)
        else:
            with contextlib.closing(sources.open_ranged(source)) as fh:
                try:
                    schema = pq.ParquetFile(fh).schema_arrow
                except (pa.ArrowInvalid, OSError) as exc:
                    raise DataError(f"cannot read {source.uri} as Parquet (truncated or corrupt?): {exc}") from None
            names = [n for n in schema.names if not _PANDAS_INDEX.fullmatch(n)]
            self.layout = self._layout(source.uri, names, {n: str(schema.field(n).type) for n in names},
                                       {n: _numeric_type(schema.field(n).type) for n in names}, lambda c: None,
                                       {n: _text_type(schema.field(n).type) for n in names})
        assert self.layout is not None
        return self.layout

    # -- layout ---------------------------------------------------------------------------------

    def _layout(self, uri: str, names: list[str], types: dict[str, str], numeric: dict[str, bool],
                example: Callable[[str], Any], text: dict[str, bool]) -> Layout:
        d = self.data
        missing_targets = [c for c in self.targets if c not in names]
        if missing_targets:
            raise DataError(f"target columns {missing_targets} (data.target_columns, else data.label_column) not "
                            f"found in {uri}; available columns: {names}")
        if not self.targets and d.label_column not in names:
            raise DataError(f"label column {d.label_column!r} not found in {uri}; available columns: {names}")
        if d.id_column and d.id_column not in names:
            raise DataError(f"id column {d.id_column!r} (data.id_column) not found in {uri}; "
                            f"available columns: {names}")
        if self.layout is not None:  # every later file must have the first file's columns
            first = [*self.layout.role_columns, *self.layout.feature_columns]
            missing = [c for c in first if c not in names]
            extra = [c for c in names if c not in first] if not d.feature_columns else []
            if missing or extra:
                raise DataError(f"columns of {uri} differ from the first file {self.plan.files[0].uri}: "
                                f"missing {missing}, extra {extra}")
            return self.layout
        if d.feature_columns:
            missing = [c for c in d.feature_columns if c not in names]
            if missing:
                raise DataError(f"declared feature columns {missing} (data.feature_columns) not found in {uri}; "
                                f"available columns: {names}")
            features = list(d.feature_columns)
        else:
            features = [c for c in names if c not in (*(self.targets or [d.label_column]), d.id_column)]
        if not features:
            raise DataError(f"{uri} has no feature columns besides the label column {d.label_column!r}")
        bad_targets = [c for c in self.targets if not numeric[c]]
        if bad_targets:
            shown = "; ".join(f"{c!r} ({types[c]}, e.g. {example(c)!r})" for c in bad_targets)
            raise DataError(f"non-numeric target columns in {uri}: {shown}; model.task='regression' needs float "
                            "targets")
        bad = [c for c in features if not (numeric[c] or text[c])]
        if bad:
            shown = "; ".join(f"{c!r} ({types[c]}, e.g. {example(c)!r})" for c in bad[:10])
            raise DataError(f"feature columns in {uri} are neither numbers nor text: {shown}"
                            f"{' …' if len(bad) > 10 else ''}; every column except the label {d.label_column!r}"
                            f"{f' and the id {d.id_column!r}' if d.id_column else ''} must be numeric or "
                            "categorical text")
        categorical = [c for c in features if text[c]]
        if categorical and d.input_shape:
            raise DataError(f"data.input_shape is set but {uri} has text (categorical) feature columns "
                            f"{categorical[:10]}: an image-shaped input must be numeric")
        self.categories = {c: {} for c in categorical}
        shape = d.input_shape
        if shape and math.prod(shape) != len(features):
            raise DataError(f"data.input_shape {tuple(shape)} holds {math.prod(shape)} values but {uri} has "
                            f"{len(features)} feature columns")
        return Layout("" if self.targets else d.label_column, d.id_column, features,
                      [{"name": n, "type": types[n]} for n in names], list(self.targets), categorical)

    # -- CSV ------------------------------------------------------------------------------------

    def _csv(self, source: sources.SourceFile) -> Iterator[Chunk]:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        gz = self.plan.format == "csv.gz"
        head, sample = self._csv_sample(source)
        names = sample.column_names
        lay = self.layout
        assert lay is not None
        # Parsed straight to float32 (what the records hold; half the memory of float64).
        types = {c: pa.string() if c in lay.categorical else
                 pa.bool_() if pa.types.is_boolean(sample.schema.field(c).type) else pa.float32()
                 for c in [*lay.feature_columns, *lay.target_columns]}
        if not lay.target_columns:
            types[lay.label_column] = pa.string()
        if lay.id_column:
            types[lay.id_column] = pa.string()
        # pyarrow's streaming reader reads up to 32 blocks ahead of the consumer, whatever the
        # consumer does: a block of a quarter chunk's text keeps that within ~8 chunks of text.
        line_bytes = max(1, len(head) // max(1, head.count(b"\n")))
        block = int(min(_MAX_BLOCK, max(_MIN_BLOCK, self.data.chunk_rows * line_bytes // 4)))
        columns = self._columns()
        convert = pcsv.ConvertOptions(column_types={c: t for c, t in types.items() if c in columns},
                                      strings_can_be_null=True, include_columns=columns)
        span = self.part.span if self.part is not None else None
        with sources.open_stream(source, self.on_bytes, span=span, header=len(head.split(b"\n", 1)[0]) + 1) \
                as stream:
            raw: Any = pa.CompressedInputStream(pa.PythonFile(stream, mode="r"), "gzip") if gz else stream
            try:
                reader = pcsv.open_csv(raw, read_options=pcsv.ReadOptions(block_size=block),
                                       convert_options=convert)
                yield from self._rebatch(reader, source.uri)
            except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
                raise _csv_error(exc, source.uri, names, gz) from None
            except OSError as exc:  # a broken gzip stream is data; a lost connection is not (retry it)
                if gz and not isinstance(exc, (ConnectionError, TimeoutError)):
                    raise _csv_error(exc, source.uri, names, gz) from None
                raise
            while stream.read(8 << 20):  # hash any bytes the parser did not need (e.g. a gzip trailer)
                pass
            if span is None:  # a byte range's hash is not the file's (parts.merge says what is recorded)
                self._record(source, stream.sha256.hexdigest(), stream.count)

    def _csv_sample(self, source: sources.SourceFile) -> tuple[bytes, Any]:
        """The head of a CSV file and its rows as parsed (types); sets (or checks) the layout."""
        import pyarrow as pa
        import pyarrow.csv as pcsv

        head = _csv_head(source, self.plan.format == "csv.gz")
        try:
            sample = pcsv.read_csv(io.BytesIO(head), read_options=pcsv.ReadOptions(use_threads=False))
        except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
            raise _csv_error(exc, source.uri, []) from None
        names = sample.column_names
        numeric = {n: _numeric_type(sample.schema.field(n).type) for n in names}
        self.layout = self._layout(source.uri, names, {n: str(sample.schema.field(n).type) for n in names},
                                   numeric, lambda c: _first_non_numeric(sample.column(c)),
                                   {n: _text_type(sample.schema.field(n).type) for n in names})
        return head, sample

    def _columns(self) -> list[str]:
        """The columns read: every role and feature column, or (a part's counting pass) the label
        (else the first target) and the categorical columns only."""
        lay = self.layout
        assert lay is not None
        if self.part is not None and self.part.counting:
            return [*(lay.target_columns[:1] or [lay.label_column]), *lay.categorical]
        return [*lay.role_columns, *lay.feature_columns]

    # -- Parquet --------------------------------------------------------------------------------

    def _parquet(self, source: sources.SourceFile) -> Iterator[Chunk]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path, digest = sources.local_copy(source, self.work_dir, self.on_bytes)
        try:
            try:
                pf = pq.ParquetFile(path)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataError(f"cannot read {source.uri} as Parquet (truncated or corrupt?): {exc}") from None
            schema = pf.schema_arrow
            # pandas writes a non-default index as "__index_level_0__": bookkeeping, not data.
            names = [n for n in schema.names if not _PANDAS_INDEX.fullmatch(n)]

            def example(column: str) -> Any:
                values = pf.read_row_group(0, columns=[column]).column(column).drop_null()
                return values[0].as_py() if len(values) else None

            self.layout = self._layout(source.uri, names, {n: str(schema.field(n).type) for n in names},
                                       {n: _numeric_type(schema.field(n).type) for n in names}, example,
                                       {n: _text_type(schema.field(n).type) for n in names})
            columns = self._columns()
            try:
                yield from self._rebatch(pf.iter_batches(batch_size=self.data.chunk_rows, columns=columns),
                                         source.uri)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataError(f"cannot read {source.uri} as Parquet (truncated or corrupt?): {exc}") from None
            self._record(source, digest, source.bytes)
        finally:
            if path != source.uri and path.startswith(self.work_dir):
                os.unlink(path)

    # -- batches → chunks -----------------------------------------------------------------------

    def _rebatch(self, batches: Any, uri: str) -> Iterator[Chunk]:
        """Record batches (any size) → chunks of ``chunk_rows`` rows (the last may be smaller)."""
        import pyarrow as pa

        pending: list[Any] = []
        rows, size = 0, self.data.chunk_rows
        for batch in batches:
            pending.append(batch)
            rows += batch.num_rows
            while rows >= size:
                table = pa.Table.from_batches(pending).combine_chunks()
                yield self._chunk(table.slice(0, size), uri)
                rest = table.slice(size)
                pending, rows = rest.to_batches(), rest.num_rows
        if rows:
            yield self._chunk(pa.Table.from_batches(pending).combine_chunks(), uri)

    def _chunk(self, batch: "pa.Table", uri: str) -> Chunk:
        lay = self.layout
        assert lay is not None
        n = batch.num_rows
        if self.part is not None and self.part.counting:  # the label and the categories' values only
            for name in lay.categorical:
                _codes(batch.column(name).combine_chunks(), self.categories[name])
            X = np.empty((n, 0), dtype=np.float32)
            if lay.target_columns:
                return self._counted(Chunk(X, np.zeros(n, np.int64), [0], self._row_ids(n), None))
            return self._counted(Chunk(X, *self._labels(batch, uri, n), self._row_ids(n), None))
        X = np.empty((n, len(lay.feature_columns)), dtype=np.float32)
        for j, name in enumerate(lay.feature_columns):
            column = batch.column(name).combine_chunks()
            if name in self.categories:
                X[:, j] = _codes(column, self.categories[name])
                continue
            X[:, j] = _float32_column(column)
        if lay.target_columns:  # regression: float targets, no classes (one stratum for the split)
            targets = _float32_columns(batch, lay.target_columns)
            return self._counted(Chunk(X, np.zeros(n, np.int64), [0], self._row_ids(n),
                                       self._id_hashes(batch, uri, n), targets))
        return self._counted(Chunk(X, *self._labels(batch, uri, n), self._row_ids(n), self._id_hashes(batch, uri, n)))

    def _labels(self, batch: "pa.Table", uri: str, n: int) -> tuple[np.ndarray, list[Any]]:
        """The label column as (codes, canonical class values)."""
        import pyarrow.compute as pc

        lay = self.layout
        assert lay is not None
        labels = batch.column(lay.label_column).combine_chunks()
        if labels.null_count:
            first = np.flatnonzero(labels.is_null().to_numpy(zero_copy_only=False))[:5] + self.rows
            raise DataError(f"label column {lay.label_column!r} in {uri} has {labels.null_count} missing values "
                            f"in rows {self.rows}..{self.rows + n - 1} (first at rows {first.tolist()})")
        encoded = pc.dictionary_encode(labels)
        raw_values = [canonical_label(v) for v in encoded.dictionary.to_pylist()]
        values = list(dict.fromkeys(raw_values))  # "3" and "3.0" are one class
        remap = np.array([values.index(v) for v in raw_values], dtype=np.int64)
        return remap[encoded.indices.to_numpy(zero_copy_only=False)], values

    def _row_ids(self, n: int) -> np.ndarray:
        return np.arange(self.rows, self.rows + n, dtype=np.int64)

    def _id_hashes(self, batch: "pa.Table", uri: str, n: int) -> np.ndarray | None:
        import pyarrow as pa
        import pyarrow.compute as pc

        lay = self.layout
        assert lay is not None
        if not lay.id_column:
            return None
        ids = batch.column(lay.id_column).combine_chunks()
        if ids.null_count:
            raise DataError(f"id column {lay.id_column!r} in {uri} has {ids.null_count} missing values "
                            f"in rows {self.rows}..{self.rows + n - 1}")
        return hash_ids(pc.cast(ids, pa.string()).to_numpy(zero_copy_only=False))

    def _counted(self, chunk: Chunk) -> Chunk:
        self.rows += len(chunk.row_ids)
        return chunk

    def _record(self, source: sources.SourceFile, sha256: str, nbytes: int) -> None:
        self.files_read.append({"uri": source.uri, "bytes": nbytes, "sha256": sha256,
                                **({"etag": source.etag} if source.etag else {})})


def _float32_column(column: "pa.Array") -> np.ndarray:
    """A numeric column as float32; a missing value becomes NaN."""
    import pyarrow as pa
    import pyarrow.compute as pc

    # safe=False: an int64 or float64 beyond float32's precision is rounded, as the records need.
    return pc.cast(column, pa.float32(), safe=False).to_numpy(zero_copy_only=False)


def _float32_columns(batch: "pa.Table", columns: list[str]) -> np.ndarray:
    """``columns`` of ``batch`` as float32 ``[n, len(columns)]``; a missing value becomes NaN."""
    X = np.empty((batch.num_rows, len(columns)), dtype=np.float32)
    for j, name in enumerate(columns):
        X[:, j] = _float32_column(batch.column(name).combine_chunks())
    return X


def _numeric_type(t: "pa.DataType") -> bool:
    import pyarrow as pa

    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
                or pa.types.is_decimal(t) or pa.types.is_null(t))


def _text_type(t: "pa.DataType") -> bool:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t))


def _codes(column: Any, codes: dict[str, int]) -> np.ndarray:
    """A text column's values as their codes in ``codes`` (new values are added), NaN if missing."""
    import pyarrow as pa
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(pc.cast(column, pa.string()))
    table = np.array([codes.setdefault(v, len(codes)) for v in encoded.dictionary.to_pylist()] + [np.nan],
                     dtype=np.float32)
    indices = encoded.indices.fill_null(len(table) - 1).to_numpy(zero_copy_only=False)
    return table[indices]


def _first_non_numeric(column: Any) -> Any:
    for value in column.to_pylist():
        if value is None:
            continue
        try:
            float(value)
        except (TypeError, ValueError):
            return value
    return column[0].as_py() if len(column) else None


def _csv_head(source: sources.SourceFile, gz: bool) -> bytes:
    """The header and the first rows (whole lines), to learn the columns and their types."""
    raw = sources.read_head(source, _HEAD_BYTES)
    if gz:
        try:
            raw = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(raw, 4 * _HEAD_BYTES)
        except zlib.error as exc:
            raise DataError(f"{source.uri} is not a valid gzip file: {exc}") from None
        if not raw:
            raise DataError(f"source dataset is empty (no header, no rows): {source.uri}")
    complete = len(raw) >= source.bytes and not gz
    if not complete:
        cut = raw.rfind(b"\n")
        if cut < 0:
            raise DataError(f"the first line of {source.uri} is over {_HEAD_BYTES} bytes: not a CSV header")
        raw = raw[:cut + 1]
    return raw


_COLUMN_NO = re.compile(r"In CSV column #(\d+)")


def _csv_error(exc: BaseException, uri: str, names: list[str], gz: bool = False) -> DataError:
    """A pyarrow/zlib error as a diagnosis: which file, which column, what to do."""
    text = str(exc)
    where = ""
    match = _COLUMN_NO.search(text)
    if match and int(match.group(1)) < len(names):
        where = f" column {names[int(match.group(1))]!r}:"
    if "UTF8" in text or "UTF-8" in text or isinstance(exc, UnicodeDecodeError):
        return DataError(f"{uri} is not UTF-8 text:{where} {text}; re-encode the file as UTF-8")
    if "conversion error" in text:
        return DataError(f"non-numeric value in {uri}:{where} {text}; every feature column must be numeric")
    if gz and isinstance(exc, OSError):
        return DataError(f"{uri} is a truncated or corrupt gzip file: {text}")
    return DataError(f"cannot parse {uri} as CSV:{where} {text}")
