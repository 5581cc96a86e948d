"""Every artifact path is a function of run identity, built here and nowhere else.

Layout: ``{root}/{dag_id}/{run_id}/{stage}/…`` where ``root`` is ``s3://bucket/prefix`` (or a
local folder). A retry of a task writes into its own run's partition, so no run's data can
overwrite another's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from common.storage import join

_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")

STAGES = ("shards", "validation", "checkpoints", "model", "metrics", "config")


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
