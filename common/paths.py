"""Every artifact path is a function of run (or dataset) identity, built here and nowhere else.

Layout: ``{root}/{dag_id}/{run_id}/{stage}/…`` where ``root`` is ``s3://bucket/prefix`` (or a
local folder). A retry of a task writes into its own run's partition, so no run's data can
overwrite another's. What outlives a run (content-addressed shards, the dataset's last validated
manifest) sits per source dataset under ``{root}/datasets/`` (``DatasetPaths``).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from common.storage import join

_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")

STAGES = ("shards", "validation", "checkpoints", "model", "metrics", "config", "code")


def safe_component(value: str) -> str:
    """Make an id (e.g. an Airflow run id with ':' and '+') safe as one S3 key component."""
    cleaned = _UNSAFE.sub("_", value).strip("_.")
    if not cleaned:
        raise ValueError(f"identifier {value!r} has no usable characters")
    return cleaned


@dataclass(frozen=True)
class RunPaths:
    root: str
    dag_id: str
    run_id: str

    @property
    def base(self) -> str:
        return join(self.root, safe_component(self.dag_id), safe_component(self.run_id))

    def stage(self, stage: str) -> str:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        return join(self.base, stage)

    @property
    def shards(self) -> str:
        return self.stage("shards")

    @property
    def validation(self) -> str:
        return self.stage("validation")

    @property
    def checkpoints(self) -> str:
        return self.stage("checkpoints")

    @property
    def model(self) -> str:
        return self.stage("model")

    @property
    def metrics(self) -> str:
        return self.stage("metrics")

    @property
    def config(self) -> str:
        return self.stage("config")

    @property
    def code(self) -> str:
        """A custom network's code, staged by the first task (``common.model_code``)."""
        return self.stage("code")

    @property
    def job_status(self) -> str:
        """The training job's status record (``training.launch.status``), beside its job document."""
        return join(self.config, "job_status.json")


DATASETS_DIR = "datasets"
LATEST_VALIDATED = "latest_validated.json"


@dataclass(frozen=True)
class DatasetPaths:
    """``{root}/datasets/{name}-{hash8}``: one folder per source URI (``base``).

    Shards are a function of the data (``shards/{fingerprint[:16]}``), not of the run: a run on
    unchanged data finds the shards a previous run made and reuses them; changed data or
    settings get a new prefix. The pointer to the last validated manifest sits beside them.
    """

    base: str

    @classmethod
    def for_source(cls, root: str, source_uri: str) -> "DatasetPaths":
        tail = [p for p in source_uri.replace("*", "_").split("/") if p]
        name = safe_component(tail[-1] if tail else "dataset")[:60]
        return cls(join(root, DATASETS_DIR, f"{name}-{hashlib.sha256(source_uri.encode()).hexdigest()[:8]}"))

    @property
    def shards(self) -> str:
        return join(self.base, "shards")

    @property
    def latest_validated(self) -> str:
        return join(self.base, LATEST_VALIDATED)
