"""Stream an image folder (images + ``labels.csv``) as bounded chunks of float32 features.

``labels.csv`` maps a file (column ``file``, ``filename``, ``path`` or ``image``: a path
relative to the folder) to its label (``data.label_column``), optionally with an id column.
Each image is decoded with Pillow, converted to the channel count of ``data.input_shape``
(1 → grey "L", 3 → "RGB", 4 → "RGBA"; when the shape is not declared, the first image's mode
and size decide it and are recorded), scaled to [0, 1] (pixel / 255) and flattened in
(C, H, W) order. An image that does not decode, is missing, or has another size fails the
sharding with every such file listed (up to a few examples), before anything is committed.
Without a declared id column the file path is the id, so a file listed twice is reported.
"""
from __future__ import annotations

import io
import logging
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from common import storage
from data_checks import sources
from data_checks.errors import DataError
from data_checks.readers import Chunk, Layout, canonical_label, hash_ids

if TYPE_CHECKING:
    from common.config import DataConfig

log = logging.getLogger(__name__)

FILE_COLUMNS = ("file", "filename", "path", "image")
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
_FETCH_THREADS = 8
_CHUNK_BYTES = 64 << 20
_EXAMPLES = 5


class ImageReader:
    """Iterate :class:`Chunk` s over the images listed in ``labels.csv``, in its row order."""

    def __init__(self, plan: sources.SourcePlan, data: "DataConfig", work_dir: str,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.plan = plan
        self.data = data
        self.on_bytes = on_bytes
        self.layout: Layout | None = None
        self.shape: tuple[int, ...] = tuple(data.input_shape)
        self.files_read: list[dict[str, Any]] = []
        self.rows = 0
        self.id_column = data.id_column
        self._files = {f.uri: f for f in plan.files}

    def chunks(self) -> Iterator[Chunk]:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        labels_uri = storage.join(self.plan.root, sources.LABELS_FILE)
        listed = self._files[labels_uri]
        try:
            table = pcsv.read_csv(io.BytesIO(sources.read_bytes(listed)),
                                  convert_options=pcsv.ConvertOptions(strings_can_be_null=True),
                                  read_options=pcsv.ReadOptions(use_threads=False))
        except (pa.ArrowInvalid, UnicodeDecodeError) as exc:
            raise DataError(f"cannot parse {labels_uri} as CSV: {exc}") from None
        names = table.column_names
        file_col = next((c for c in FILE_COLUMNS if c in names), None)
        if file_col is None:
            raise DataError(f"{labels_uri} has no file column (one of {list(FILE_COLUMNS)}); columns: {names}")
        if self.data.label_column not in names:
            raise DataError(f"label column {self.data.label_column!r} not found in {labels_uri}; "
                            f"available columns: {names}")
        id_col = self.id_column = self.data.id_column or file_col
        if id_col not in names:
            raise DataError(f"id column {id_col!r} (data.id_column) not found in {labels_uri}; columns: {names}")
        if table.num_rows == 0:
            raise DataError(f"source dataset has no rows (header only): {labels_uri}")
        self.files_read.append({"uri": labels_uri, "bytes": listed.bytes,
                                **({"sha256": listed.sha256} if listed.sha256 else {"etag": listed.etag})})
        files = [str(v) if v is not None else "" for v in table.column(file_col).to_pylist()]
        labels = table.column(self.data.label_column).to_pylist()
        ids = [str(v) for v in table.column(id_col).to_pylist()]
        self._check_listed(files, labels_uri)
        with ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="image-fetch") as pool:
            start = 0
            while start < len(files):
                # Images are wide: a chunk holds at most _CHUNK_BYTES of float32 (and chunk_rows).
                per_image = 4 * math.prod(self.shape) if self.shape else _CHUNK_BYTES // 256
                stop = min(start + max(1, min(self.data.chunk_rows, _CHUNK_BYTES // per_image)), len(files))
                yield self._chunk(pool, files[start:stop], labels[start:stop], ids[start:stop], labels_uri)
                start = stop

    def _check_listed(self, files: list[str], labels_uri: str) -> None:
        missing = [f for f in files if storage.join(self.plan.root, f) not in self._files]
        if missing:
            raise DataError(f"{len(missing)} files listed in {labels_uri} are not in {self.plan.root}: "
                            f"{missing[:_EXAMPLES]}{' …' if len(missing) > _EXAMPLES else ''}")
        unlisted = len(self._files) - 1 - len(set(files))
        if unlisted > 0:
            log.warning("%d files under %s are not listed in %s: ignored", unlisted, self.plan.root, labels_uri)

    def _chunk(self, pool: ThreadPoolExecutor, files: list[str], labels: list[Any], ids: list[str],
               labels_uri: str) -> Chunk:
        if any(v is None for v in labels):
            first = [self.rows + i for i, v in enumerate(labels) if v is None][:_EXAMPLES]
            raise DataError(f"label column {self.data.label_column!r} in {labels_uri} has missing values "
                            f"(first at rows {first})")
        decoded = list(pool.map(self._decode, files))
        if not self.shape:
            first_ok = next((d for d in decoded if isinstance(d, np.ndarray)), None)
            if first_ok is not None:
                self.shape = tuple(first_ok.shape)
                log.info("images are %s (C, H, W), taken from the first image", self.shape)
        bad = [(f, d) for f, d in zip(files, decoded) if not isinstance(d, np.ndarray)]
        bad += [(f, f"is {d.shape} (C, H, W), expected {self.shape}") for f, d in zip(files, decoded)
                if isinstance(d, np.ndarray) and d.shape != self.shape]
        if bad:
            shown = "; ".join(f"{f}: {why}" for f, why in bad[:_EXAMPLES])
            raise DataError(f"{len(bad)} image files under {self.plan.root} cannot be used "
                            f"(rows {self.rows}..{self.rows + len(files) - 1} of {labels_uri}): {shown}"
                            f"{' …' if len(bad) > _EXAMPLES else ''}")
        width = math.prod(self.shape)
        if self.layout is None:
            self.layout = Layout(self.data.label_column, self.data.id_column,
                                 [f"pixel_{i}" for i in range(width)],
                                 [{"name": "file", "type": "image"}, {"name": self.data.label_column, "type": "label"}])
        X = np.stack([d.reshape(-1) for d in decoded]).astype(np.float32) / np.float32(255.0)
        raw_values = [canonical_label(v) for v in labels]
        values = list(dict.fromkeys(raw_values))
        index = {v: i for i, v in enumerate(values)}
        codes = np.array([index[v] for v in raw_values], dtype=np.int64)
        chunk = Chunk(X, codes, values, np.arange(self.rows, self.rows + len(files), dtype=np.int64),
                      hash_ids(np.array(ids, dtype=object)))
        self.rows += len(files)
        return chunk

    def _decode(self, name: str) -> np.ndarray | str:
        """The image as a (C, H, W) uint8 array, or why it cannot be used."""
        from PIL import Image, UnidentifiedImageError

        try:
            data = sources.read_bytes(self._files[storage.join(self.plan.root, name)])
        except DataError as exc:
            return str(exc)
        if self.on_bytes is not None:
            self.on_bytes(len(data))
        try:
            with Image.open(io.BytesIO(data)) as img:
                img.load()  # decode now: a truncated file fails here, not later
                channels = self.shape[0] if self.shape else (1 if img.mode in ("L", "1", "P") else 3)
                if channels not in _MODES:
                    return f"{channels} channels are not supported (1, 3 or 4)"
                pixels = np.asarray(img.convert(_MODES[channels]), dtype=np.uint8)
        except UnidentifiedImageError:
            return "does not decode (not an image format Pillow knows)"
        except (OSError, ValueError, SyntaxError) as exc:  # e.g. "image file is truncated"
            return f"does not decode ({exc})"
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))
