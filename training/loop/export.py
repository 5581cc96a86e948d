"""Rank 0's model export at the end of a job: the hybridized network and what serving needs.

``export`` writes the symbol and parameters, ``model_meta.json`` (feature columns, classes or
targets, input shape) and the manifest's preprocessing, if any, under the job's model prefix.
With ``checkpoint.export_epoch`` resolving to "best", ``load_best`` first puts the best epoch's
parameters back into the network, from its epoch-end checkpoint (retention keeps it:
``training.checkpoint.store.KEEP_STEP``).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import Any

from common import storage
from common.config import ConfigError
from common.manifest import is_regression
from common.preprocessing import FILE_NAME as PREPROCESSING_FILE
from training.checkpoint import state as ckpt_state
from training.checkpoint.store import CheckpointStore
from training.loop.resume import TrainState

__all__ = ["export", "load_best"]

log = logging.getLogger(__name__)


def load_best(net: Any, store: CheckpointStore, state: TrainState, ctx: Any) -> None:
    """The best epoch's parameters into ``net`` (from its epoch-end checkpoint, which retention
    keeps), unless the current ones are those."""
    best = state.best
    if best.step is None:
        raise ConfigError("no validated epoch to export: checkpoint.export_epoch='best' needs at least one "
                         "finished epoch")
    if best.step != state.global_step:
        ckpt = store.load(best.step)
        ckpt_state.load_params(net, ckpt.files[ckpt_state.PARAMS], ctx)
    log.info("exporting the best epoch's parameters: epoch %d (%s=%.6g, step %d)", best.epoch, best.metric,
             best.value, best.step)


def export(net: Any, manifest: dict[str, Any], model_prefix: str) -> None:
    """The hybridized model (symbol + params) and what serving needs to feed it, under ``model_prefix``."""
    with tempfile.TemporaryDirectory() as tmp:
        net.export(os.path.join(tmp, "model"), epoch=0)
        meta = {"feature_columns": manifest["feature_columns"], "classes": manifest["classes"],
                "input_shape": manifest.get("input_shape", []), "num_features": manifest["num_features"]}
        if is_regression(manifest):  # the pyfunc model returns one float column per target
            meta.update(task="regression", target_columns=manifest["target_columns"])
        with open(os.path.join(tmp, "model_meta.json"), "w") as fh:
            json.dump(meta, fh, indent=2)
        if manifest.get("preprocessing"):  # the served model applies it to raw rows
            with open(os.path.join(tmp, PREPROCESSING_FILE), "w") as fh:
                json.dump(manifest["preprocessing"], fh, indent=2)
        for fname in sorted(os.listdir(tmp)):
            storage.upload_file(os.path.join(tmp, fname), storage.join(model_prefix, fname))
