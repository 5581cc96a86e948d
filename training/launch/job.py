"""The description of one distributed training job, handed to every role as a JSON document.

Everything a worker needs is in it (the resolved config and where to read and write), so a role
process needs no arguments beyond the job's URI, and a retry of the job is the same document.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from common import storage
from common.config import TrainConfig


@dataclass(frozen=True)
class JobSpec:
    config: TrainConfig
    shards_prefix: str
    checkpoint_prefix: str
    model_prefix: str
    metrics_uri: str
    run_name: str = "job"
    # Warm start: another run's checkpoint folder; its newest valid checkpoint's parameters
    # initialise the model only when this job's own prefix has no checkpoint yet.
    warm_start_prefix: str = ""
    # A custom network's staged code (common.model_code) and its sha256; empty for the zoo or
    # code already installed on the roles.
    model_code_uri: str = ""
    model_code_sha256: str = ""
    # Where ``python -m training supervise`` keeps the job's status record (training.launch.status).
    status_uri: str = ""
    # The cluster the supervisor starts the roles on: {"factory": "module:callable",
    # "description": {...}}; the factory turns the description into a cluster (see
    # training.launch.supervise for why this is a name and not an import).
    cluster: dict[str, Any] = field(default_factory=dict)
    # The DAG run's MLflow run the supervisor keeps live while the job trains
    # (training.tracking.live.live_run_for); empty: no live tracking.
    tracking: dict[str, Any] = field(default_factory=dict)
    # A sweep trial's pruning (training.loop.pruning.Pruner: where its rungs are, its index,
    # min_epochs, eta, the metric and its direction); empty: not pruned.
    pruning: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        raw = asdict(self)
        raw["config"] = self.config.to_dict()
        return json.dumps(raw, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        raw = json.loads(text)
        raw["config"] = TrainConfig.from_dict(raw["config"])
        return cls(**raw)

    @classmethod
    def load(cls, uri: str) -> "JobSpec":
        return cls.from_json(storage.get_bytes(uri).decode())

    def save(self, uri: str) -> None:
        storage.put_bytes(uri, self.to_json().encode())
