"""Sources through fsspec: file:// and http:// URLs, local globs, and the errors that name the problem.

The HTTP source is a real ``http.server`` on 127.0.0.1 in a thread of the test process (it
serves a temp folder and refuses ``/private/`` with 403), stopped at teardown.
"""
from __future__ import annotations

import http.server
import importlib.util
import shutil
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

# Before anything imports mxnet (see test_shard.py).
from sklearn.datasets import load_digits  # noqa: F401

import numpy as np
import pandas as pd
import pytest

from common import storage
from common.config import DataConfig, TrainConfig
from data_checks import DataError
from data_checks.shard import shard_dataset
from testkit.digits import digits_frame

pytestmark = pytest.mark.integration  # a real HTTP server on loopback


def config(source: str) -> TrainConfig:
    return TrainConfig(data=DataConfig(source_uri=source, label_column="label"))


def shas(manifest: dict) -> dict:
    return {s["name"]: s["files"]["rec"]["sha256"] for s in manifest["shards"]}


class _Handler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/private/"):
            self.send_error(403, "Forbidden")
            return
        super().do_GET()

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """``(folder, base_url)``: digits as CSV and Parquet, served over HTTP on loopback."""
    root = tmp_path_factory.mktemp("served")
    frame = digits_frame()
    frame.to_csv(root / "digits.csv", index=False)
    frame.to_parquet(root / "digits.parquet", row_group_size=256)
    (root / "private").mkdir()
    shutil.copy(root / "digits.csv", root / "private" / "digits.csv")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the test HTTP server did not stop"


@pytest.fixture(scope="module")
def reference(served: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root, _ = served
    return shard_dataset(config(str(root / "digits.csv")), str(tmp_path_factory.mktemp("ref")))


@pytest.mark.parametrize("name", ["digits.csv", "digits.parquet"])
def test_file_and_http_urls_shard_like_the_local_path(served, reference, name, tmp_path):
    root, base = served
    sha = storage.sha256_file(str(root / name))
    for uri in (f"file://{root / name}", f"{base}/{name}"):
        manifest = shard_dataset(config(uri), str(tmp_path / str(abs(hash(uri)))))
        assert shas(manifest) == shas(reference), uri
        assert manifest["source_uri"] == uri
        assert manifest["source"]["files"] == [{"uri": uri, "bytes": (root / name).stat().st_size, "sha256": sha}]


def test_a_glob_over_a_local_folder_keeps_the_uris_as_given(served, reference, tmp_path):
    root, _ = served
    frame = pd.read_csv(root / "digits.csv")
    (tmp_path / "parts" / "old").mkdir(parents=True)
    for i, part in enumerate(np.array_split(np.arange(len(frame)), 3)):
        frame.iloc[part].to_csv(tmp_path / "parts" / f"part-{i}.csv", index=False)
    (tmp_path / "parts" / ".part-9.csv").write_text("hidden,label\n")  # e.g. a writer's temp file
    shutil.copy(tmp_path / "parts" / "part-0.csv", tmp_path / "parts" / "old" / "part-0.csv")  # not in "*"
    for spec in (str(tmp_path / "parts" / "part-*.csv"), f"file://{tmp_path}/parts/part-?.csv"):
        manifest = shard_dataset(config(spec), str(tmp_path / "out" / str(abs(hash(spec)))))
        assert shas(manifest) == shas(reference), spec
        prefix = spec.rsplit("/", 1)[0]
        assert [f["uri"] for f in manifest["source"]["files"]] == [f"{prefix}/part-{i}.csv" for i in range(3)]


def test_errors_name_the_problem(served, tmp_path):
    root, base = served
    cases = [
        (str(tmp_path / "nope.csv"), r"source dataset not found: .*/nope\.csv$"),
        (f"file://{tmp_path}/nope.csv", r"source dataset not found: file://.*/nope\.csv$"),
        (f"{base}/nope.csv", r"source dataset not found: http://127\.0\.0\.1:\d+/nope\.csv$"),
        (str(tmp_path / "none-*.csv"), r"no source files match .*/none-\*\.csv$"),
        (f"{base}/private/digits.csv", r"permission denied reading http://.*/private/digits\.csv: 403"),
        (f"{base}/*.csv", r"cannot list http://.*/\*\.csv: HTTP has no folder listing"),
        (f"{base}/", r"cannot list http://.*/: HTTP has no folder listing"),
        ("foo://bucket/x.csv", r"unsupported protocol foo:// in foo://bucket/x\.csv"),
    ]
    if importlib.util.find_spec("gcsfs") is None:
        cases.append(("gs://bucket/x.csv", r"^install gcsfs to read gs:// sources"))
    for uri, match in cases:
        with pytest.raises(DataError, match=match):
            shard_dataset(config(uri), str(tmp_path / "out"))
