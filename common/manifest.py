"""The shard manifest: the one file that says which shard files exist and what their bytes are.

It is written last, after every shard file is uploaded, so a manifest never points at a missing
file; a shard whose bytes do not match the manifest's sha256 is rejected before anyone reads it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from common import storage
from common.errors import DataError

log = logging.getLogger(__name__)

# 2: blocked stratified assignment, id hashes in IRHeader.id2, schema/source/stats sections.
# Version 1 manifests stay readable: the fields readers use did not change.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"


# The task's view of a manifest. A regression manifest adds "task": "regression",
# "target_columns" and "num_targets"; a record then holds the features followed by the targets
# (float32), its header label is 0. Classification manifests are unchanged (no such keys).


def is_regression(manifest: dict[str, Any]) -> bool:
    return manifest.get("task") == "regression"


def record_width(manifest: dict[str, Any]) -> int:
    """Float32 values a record holds after its header: the features, then the regression targets."""
    return int(manifest["num_features"]) + int(manifest.get("num_targets", 0))


def num_outputs(manifest: dict[str, Any]) -> int:
    """The network's outputs: one per regression target, else one per class."""
    return int(manifest["num_targets"]) if is_regression(manifest) else int(manifest["num_classes"])


def shards_prefix(prefix_or_uri: str) -> str:
    """The folder of a manifest, given either the folder or the manifest's own URI."""
    if prefix_or_uri.rstrip("/").endswith("/" + MANIFEST_NAME):
        return prefix_or_uri.rstrip("/")[: -len(MANIFEST_NAME) - 1]
    return prefix_or_uri.rstrip("/")


def manifest_uri(prefix_or_uri: str) -> str:
    return storage.join(shards_prefix(prefix_or_uri), MANIFEST_NAME)


def to_json_bytes(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, indent=2).encode()


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace): what XCom carries downstream."""
    canon = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def load_manifest(prefix_or_uri: str) -> dict[str, Any]:
    uri = manifest_uri(prefix_or_uri)
    try:
        raw = storage.get_bytes(uri)
    except FileNotFoundError as exc:
        raise DataError(f"no shard manifest at {uri}: sharding did not finish (or wrote elsewhere)") from exc
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise DataError(f"shard manifest {uri} is not valid JSON: {exc}") from exc
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in READABLE_VERSIONS:
        raise DataError(f"shard manifest {uri} has format_version {version!r}, expected one of {READABLE_VERSIONS}")
    return manifest


def write_pointer(uri: str, manifest_uri_: str, manifest: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Point ``uri`` at a manifest (e.g. the dataset's last validated one); small, overwritten."""
    pointer = {"manifest_uri": manifest_uri_, "manifest_digest": manifest_digest(manifest),
               "source_fingerprint": manifest.get("source_fingerprint"), **extra}
    storage.put_bytes(uri, json.dumps(pointer, sort_keys=True, indent=2).encode())
    return pointer


def read_pointer(uri: str) -> dict[str, Any] | None:
    """The pointer at ``uri``, or None when there is none (or it is unreadable: logged)."""
    try:
        pointer = json.loads(storage.get_bytes(uri))
    except FileNotFoundError:
        return None
    except ValueError as exc:
        log.warning("ignoring unreadable manifest pointer %s: %s", uri, exc)
        return None
    return pointer if isinstance(pointer, dict) and pointer.get("manifest_uri") else None


def shard_entry(manifest: dict[str, Any], shard_name: str) -> dict[str, Any]:
    for shard in manifest["shards"]:
        if shard["name"] == shard_name:
            return shard
    names = [s["name"] for s in manifest["shards"]]
    raise DataError(f"shard {shard_name!r} is not in the manifest; it lists {names}")


def download_shard(manifest: dict[str, Any], prefix: str, shard_name: str, local_dir: str) -> tuple[str, str]:
    """Download one shard's ``.idx``/``.rec`` pair into ``local_dir`` and verify it.

    Returns ``(idx_path, rec_path)`` for ``common.record_codec.read_all``. A missing file, or one whose
    size or sha256 differs from the manifest, is a ``DataError`` naming the URI.
    """
    entry = shard_entry(manifest, shard_name)
    base = shards_prefix(prefix)
    paths: dict[str, str] = {}
    for kind in ("idx", "rec"):
        meta = entry["files"][kind]
        uri = storage.join(base, meta["name"])
        local = os.path.join(local_dir, meta["name"])
        try:
            storage.download_file(uri, local)
        except FileNotFoundError as exc:
            raise DataError(f"shard file listed in the manifest is missing: {uri}") from exc
        size = os.path.getsize(local)
        digest = storage.sha256_file(local)
        if digest != meta["sha256"] or size != meta["bytes"]:
            raise DataError(f"sha256 mismatch for {uri}: manifest says {meta['sha256']} ({meta['bytes']} bytes), "
                            f"file has {digest} ({size} bytes)")
        paths[kind] = local
    log.debug("downloaded and verified shard %s from %s", shard_name, base)
    return paths["idx"], paths["rec"]
