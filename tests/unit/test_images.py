"""Image folders (images + labels.csv) as a source: decoding, layout, bad images (local; no servers)."""
from __future__ import annotations

import os

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits  # noqa: F401

import numpy as np
import pytest
from PIL import Image

from common import record_codec
from data_checks import DataError, DataValidationError
from common.manifest import download_shard
from data_checks.shard import shard_dataset
from data_checks.validate import validate_shards
from common.config import ClusterConfig, DataConfig, TrainConfig

pytestmark = pytest.mark.unit

LABELS = ("cat", "dog", "eel")


def make_folder(root, n: int = 45, mode: str = "L", size: tuple[int, int] = (5, 6)) -> dict[str, np.ndarray]:
    """``n`` random images (width 5, height 6) in sub-folders, and labels.csv; returns pixels by file."""
    rng = np.random.default_rng(0)
    pixels, lines = {}, []
    for i in range(n):
        shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
        arr = rng.integers(0, 256, shape, dtype=np.uint8)
        name = f"{LABELS[i % 3]}/img-{i:03d}.png"
        os.makedirs(root / LABELS[i % 3], exist_ok=True)
        Image.fromarray(arr, mode).save(root / name)
        pixels[name] = arr
        lines.append(f"{name},{LABELS[i % 3]}")
    (root / "labels.csv").write_text("file,label\n" + "\n".join(lines) + "\n")
    return pixels


def config(root, workers: int = 2, **data: object) -> TrainConfig:
    # One shard feeds one worker only (the config refuses fewer train shards than workers).
    return TrainConfig(cluster=ClusterConfig(num_workers=workers),
                       data=DataConfig(source_uri=str(root) + "/", label_column="label", **data))


def test_grey_images_become_scaled_chw_features_and_validate(tmp_path):
    pixels = make_folder(tmp_path / "imgs")
    cfg = config(tmp_path / "imgs")
    manifest = shard_dataset(cfg, str(tmp_path / "shards"))
    assert manifest["source_kind"] == "images" and manifest["input_shape"] == [1, 6, 5]
    assert manifest["num_features"] == 30 and manifest["classes"] == list(LABELS)
    assert manifest["feature_scaling"] == "pixel / 255" and manifest["id_column"] == "file"
    names = list(pixels)  # row ids are labels.csv rows
    for shard in manifest["shards"]:
        X, y, ids = record_codec.read_all(*download_shard(manifest, str(tmp_path / "shards"), shard["name"],
                                                     str(tmp_path)), 30)
        for row, features, label in zip(ids, X, y):
            name = names[row]
            np.testing.assert_allclose(features, pixels[name].reshape(-1) / 255.0, rtol=1e-6)
            assert manifest["classes"][label] == name.split("/")[0]
    summary = validate_shards(str(tmp_path / "shards"), cfg)
    assert summary["success"]


def test_rgb_images_keep_channels_first(tmp_path):
    pixels = make_folder(tmp_path / "imgs", n=9, mode="RGB")
    manifest = shard_dataset(config(tmp_path / "imgs", input_shape=(3, 6, 5)), str(tmp_path / "shards"))
    shard = manifest["shards"][0]
    X, _, ids = record_codec.read_all(*download_shard(manifest, str(tmp_path / "shards"), shard["name"],
                                                 str(tmp_path)), 90)
    name = list(pixels)[int(ids[0])]
    np.testing.assert_allclose(X[0].reshape(3, 6, 5), pixels[name].transpose(2, 0, 1) / 255.0, rtol=1e-6)


@pytest.mark.parametrize("damage, match", [
    (lambda p: p.write_bytes(b"not an image at all"), r"1 image files .* cannot be used .*img-004\.png: does not decode"),
    (lambda p: p.write_bytes(p.read_bytes()[:40]), r"img-004\.png: does not decode"),
    (lambda p: Image.fromarray(np.zeros((7, 5), np.uint8), "L").save(p, format="PNG"),
     r"img-004\.png: is \(1, 7, 5\) \(C, H, W\), expected \(1, 6, 5\)"),
    (lambda p: p.unlink(), r"1 files listed in .*labels\.csv are not in .*: \['dog/img-004\.png'\]"),
])
def test_a_bad_image_fails_sharding_naming_the_file(tmp_path, damage, match):
    make_folder(tmp_path / "imgs", n=12)
    damage(tmp_path / "imgs" / "dog" / "img-004.png")
    with pytest.raises(DataError, match=match):
        shard_dataset(config(tmp_path / "imgs"), str(tmp_path / "shards"))
    assert not (tmp_path / "shards" / "manifest.json").exists()


def test_a_file_listed_twice_is_a_duplicate_id(tmp_path):
    make_folder(tmp_path / "imgs", n=30)
    labels = tmp_path / "imgs" / "labels.csv"
    labels.write_text(labels.read_text() + "cat/img-000.png,cat\n")
    cfg = config(tmp_path / "imgs", num_shards=1, workers=1)
    shard_dataset(cfg, str(tmp_path / "shards"))
    with pytest.raises(DataValidationError, match=r"ids_unique_across_shards: 1 ids of column 'file' appear more "
                                                  r"than once .*source rows \[0, 30\]"):
        validate_shards(str(tmp_path / "shards"), cfg)


def test_an_image_folder_is_one_part_of_mapped_sharding(tmp_path):
    """Mapped sharding plans no parts for an image folder (the merge shards it in one pass),
    whatever number of parts is asked for, and the shards are the one-pass sharder's."""
    from data_checks.parts import plan, shard_in_parts
    from data_checks.shard import shard_content_addressed

    make_folder(tmp_path / "imgs")
    cfg = config(tmp_path / "imgs")
    planned = plan(cfg, str(tmp_path / "mapped"), 3)
    assert planned["parts"] == [] and not planned["reused"]
    _, mapped, _ = shard_in_parts(cfg, str(tmp_path / "mapped"), 3)
    _, one_pass, _ = shard_content_addressed(cfg, str(tmp_path / "one-pass"))
    assert [s["files"] for s in mapped["shards"]] == [s["files"] for s in one_pass["shards"]]
