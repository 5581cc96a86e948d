"""Sharding from s3:// sources on a real SeaweedFS server: prefixes, globs, Parquet, images, ETags."""
import io
import json

import numpy as np
import pandas as pd
import pytest

from common import storage
from data_checks import DataError
from data_checks.shard import shard_content_addressed, shard_dataset
from data_checks.validate import validate_shards
from common.config import DataConfig, TrainConfig

pytestmark = pytest.mark.integration


def config(source: str, **data: object) -> TrainConfig:
    return TrainConfig(data=DataConfig(source_uri=source, label_column="label", **data))


def shas(manifest: dict) -> dict:
    return {s["name"]: s["files"]["rec"]["sha256"] for s in manifest["shards"]}


def test_s3_prefix_glob_and_parquet_sources_shard_alike(s3_prefix, digits_csv):
    frame = pd.read_csv(io.BytesIO(digits_csv))
    storage.put_bytes(f"{s3_prefix}/one/digits.csv", digits_csv)
    for i, part in enumerate(np.array_split(np.arange(len(frame)), 3)):
        storage.put_bytes(f"{s3_prefix}/csv/part-{i}.csv", frame.iloc[part].to_csv(index=False).encode())
        buf = io.BytesIO()
        frame.iloc[part].to_parquet(buf, row_group_size=128)
        storage.put_bytes(f"{s3_prefix}/pq/part-{i}.parquet", buf.getvalue())
    storage.put_bytes(f"{s3_prefix}/csv/_SUCCESS", b"")

    reference = shard_dataset(config(f"{s3_prefix}/one/digits.csv"), f"{s3_prefix}/out/one")
    assert reference["source"]["files"][0]["etag"]  # S3 sources are identified by ETag + size
    for name, source in (("prefix", f"{s3_prefix}/csv/"), ("glob", f"{s3_prefix}/csv/part-*.csv"),
                         ("parquet", f"{s3_prefix}/pq/")):
        manifest = shard_dataset(config(source), f"{s3_prefix}/out/{name}")
        assert shas(manifest) == shas(reference), name
        assert manifest["source"]["num_files"] == 3
    assert validate_shards(f"{s3_prefix}/out/parquet", config(f"{s3_prefix}/pq/"))["success"]


def test_content_addressed_shards_follow_the_etag(s3_prefix, digits_csv):
    source = f"{s3_prefix}/data/digits.csv"
    storage.put_bytes(source, digits_csv)
    cfg = config(source)
    prefix, manifest, reused = shard_content_addressed(cfg, f"{s3_prefix}/shards")
    assert not reused and storage.exists(f"{prefix}/manifest.json")
    assert shard_content_addressed(cfg, f"{s3_prefix}/shards")[2] is True
    storage.put_bytes(source, digits_csv.replace(b"\n0.0,", b"\n1.0,", 1))  # one value changed
    changed, _, reused = shard_content_addressed(cfg, f"{s3_prefix}/shards")
    assert not reused and changed != prefix


def test_s3_image_folder_and_readable_errors(s3_prefix):
    from PIL import Image

    rng = np.random.default_rng(0)
    lines = []
    for i in range(24):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (4, 4), dtype=np.uint8), "L").save(buf, format="PNG")
        storage.put_bytes(f"{s3_prefix}/imgs/{i}.png", buf.getvalue())
        lines.append(f"{i}.png,{i % 2}")
    storage.put_bytes(f"{s3_prefix}/imgs/labels.csv", ("file,label\n" + "\n".join(lines) + "\n").encode())
    manifest = shard_dataset(config(f"{s3_prefix}/imgs/"), f"{s3_prefix}/out")
    assert manifest["source_kind"] == "images" and manifest["input_shape"] == [1, 4, 4]
    assert json.loads(storage.get_bytes(f"{s3_prefix}/out/manifest.json")) == manifest

    with pytest.raises(DataError, match=r"source dataset not found: .*/imgs \(.*/imgs/ is a folder: end the URI"):
        shard_dataset(config(f"{s3_prefix}/imgs"), f"{s3_prefix}/out2")
    storage.put_bytes(f"{s3_prefix}/imgs/5.png", b"\x89PNG broken")
    with pytest.raises(DataError, match=r"5\.png: does not decode"):
        shard_dataset(config(f"{s3_prefix}/imgs/"), f"{s3_prefix}/out3")
