"""A scanner for known secrets in everything a pipeline run leaves behind (files, S3 objects,
MLflow runs, free text), used by test_security.py.

A secret is searched for as its plain text, its base64 and its hex encodings (a key stored as
bytes shows up as those), and, for binary keys, its raw bytes. Every hit names where it was found,
so a failing test says which log line, object or MLflow field leaked.
"""
from __future__ import annotations

import base64
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Hit:
    secret: str  # the secret's label, never its value (the test output must not leak it either)
    where: str


def needles(value: str | bytes) -> list[bytes]:
    raw = value.encode() if isinstance(value, str) else value
    return [raw, base64.b64encode(raw), base64.urlsafe_b64encode(raw), raw.hex().encode()]


class Scanner:
    def __init__(self, secrets: Mapping[str, str | bytes]) -> None:
        self.secrets = {label: needles(value) for label, value in secrets.items()}
        self.hits: list[Hit] = []
        self.scanned: dict[str, int] = {}  # kind of source -> how many were read (proof of coverage)
        self.kinds: dict[str, str] = {}  # where -> kind of source

    def bytes(self, data: bytes, where: str, kind: str) -> None:
        self.scanned[kind] = self.scanned.get(kind, 0) + 1
        self.kinds[where] = kind
        for label, forms in self.secrets.items():
            if any(form in data for form in forms):
                self.hits.append(Hit(label, where))

    def text(self, text: str, where: str, kind: str) -> None:
        self.bytes(text.encode(errors="surrogateescape"), where, kind)

    def tree(self, root: str, kind: str, skip: Iterable[str] = ()) -> None:
        """Every regular file under ``root``; ``skip``: folder paths not to enter."""
        skipped = {os.path.abspath(s) for s in skip}
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.abspath(os.path.join(folder, d)) not in skipped]
            for name in files:
                path = os.path.join(folder, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    with open(path, "rb") as fh:
                        self.bytes(fh.read(), path, kind)

    def s3(self, client: Any, bucket: str, prefix: str = "") -> None:
        """Every object in ``bucket`` under ``prefix``, whole (text and binary alike)."""
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
                self.bytes(body, f"s3://{bucket}/{obj['Key']}", "s3")

    def mlflow(self, tracking_uri: str) -> None:
        """Params, tags, metric keys and every artifact of every run of every experiment, and the
        registered models' versions (their tags and descriptions)."""
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        for exp in client.search_experiments():
            for run in client.search_runs([exp.experiment_id], max_results=1000):
                rid = run.info.run_id
                for key, value in {**run.data.params, **run.data.tags}.items():
                    self.text(f"{key}={value}", f"mlflow run {rid} param/tag {key}", "mlflow-field")
                self._artifacts(client, rid, "")
        for model in client.search_registered_models():
            for mv in client.search_model_versions(f"name='{model.name}'"):
                self.text(f"{mv.description} {mv.tags} {mv.source}", f"mlflow model {model.name} v{mv.version}",
                          "mlflow-field")

    def _artifacts(self, client: Any, run_id: str, path: str) -> None:
        import tempfile

        for info in client.list_artifacts(run_id, path or None):
            if info.is_dir:
                self._artifacts(client, run_id, info.path)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                local = client.download_artifacts(run_id, info.path, tmp)
                with open(local, "rb") as fh:
                    self.bytes(fh.read(), f"mlflow run {run_id} artifact {info.path}", "mlflow-artifact")
