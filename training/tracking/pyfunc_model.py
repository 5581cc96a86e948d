"""The MLflow pyfunc wrapper around an exported Gluon network (MLflow has no MXNet flavor).

The trainer exports with ``net.export(prefix, epoch=0)`` into one folder:
``<prefix>-symbol.json``, ``<prefix>-NNNN.params`` and ``model_meta.json``
(``feature_columns``, ``classes``, ``input_shape``, ``num_features``; a regression model adds
``task: "regression"`` and ``target_columns``). The network takes float32 ``[batch, num_features]``
(reshaped to ``[batch] + input_shape`` when that is non-empty) and returns logits
``[batch, num_classes]``, or for regression one float per target ``[batch, num_targets]``, which
the model returns as one float64 column per target (named by ``target_columns``). A custom
network (``model.name`` an import path) is exported the same way: its symbol holds only MXNet
operators, so loading it needs neither the project nor the user's code
(``tests/unit/test_custom_model.py``), and no ``code_paths`` are logged.

A table model trained on preprocessed shards also has ``preprocessing.json`` (the manifest's
record, see ``common/preprocessing.py``): the model then takes the *raw* table (its original
columns, text categories, missing values) and applies the same transform the sharder applied
(``raw_features``): train mean/std, the train median or most frequent value for a missing value
when the run imputed, one-hot categories with the unknown bucket for a value the train split
never had. It is a copy of ``data_checks.preprocess.transform`` for a DataFrame (this file cannot
import the project); a test checks that both give the same float32 bits. A regression network
trained on standardised targets (the record's ``targets``: train mean and std) has its outputs
turned back into the targets' units (``restore_targets``), so predictions are in those units.

This file is logged *as code* ("models from code", MLflow's recommended way): MLflow copies it
into the model and executes it at load time, so it must stay self-contained (stdlib, numpy,
pandas, mlflow; never ``training.*`` or ``common.*``) and end with ``set_model``. That also means
loading needs no pickle (``MLFLOW_ALLOW_PICKLE_DESERIALIZATION``) and no importable ``training``
package in the serving environment.

Importing it costs the ``import mlflow`` (the class must subclass ``PythonModel``) but never
mxnet: mxnet is imported inside ``load_exported``.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import mlflow.models
import numpy as np
import pandas as pd
from mlflow.pyfunc import PythonModel

META_FILE = "model_meta.json"
PREDICT_BATCH = 4096
# Keys of the pyfunc ``artifacts`` dict (``context.artifacts``).
ARTIFACT_SYMBOL = "symbol"
ARTIFACT_PARAMS = "params"
ARTIFACT_META = "meta"
ARTIFACT_PREPROCESSING = "preprocessing"
PREPROCESSING_FILE = "preprocessing.json"


def _import_mxnet() -> Any:
    """Import mxnet without its optional sklearn import (seconds when scikit-learn is installed).

    ``mxnet.model`` does ``from sklearn.base import BaseEstimator`` once, at import time, inside
    ``try/except ImportError``. A ``None`` entry in ``sys.modules`` turns that into an instant
    ImportError. The entry is removed again afterwards so that code in the same process that
    really needs sklearn can still import it.
    """
    if "mxnet" in sys.modules:
        return sys.modules["mxnet"]
    blocked = "sklearn" not in sys.modules
    if blocked:
        sys.modules["sklearn"] = None  # type: ignore[assignment]  # same as setdefault here
    try:
        import mxnet
    finally:
        if blocked and sys.modules.get("sklearn", 0) is None:
            del sys.modules["sklearn"]
    return mxnet


def find_export_files(model_dir: str) -> dict[str, str]:
    """Locate ``{symbol, params, meta}`` in an export folder (highest epoch's params wins)."""
    symbols = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*-symbol.json")))
    if len(symbols) != 1:
        raise FileNotFoundError(f"expected exactly one *-symbol.json in {model_dir}, found {symbols}")
    prefix = symbols[0][: -len("-symbol.json")]
    params = sorted(glob.glob(glob.escape(prefix) + "-[0-9][0-9][0-9][0-9].params"))
    if not params:
        raise FileNotFoundError(f"no {os.path.basename(prefix)}-NNNN.params next to {symbols[0]}")
    meta = os.path.join(model_dir, META_FILE)
    if not os.path.isfile(meta):
        raise FileNotFoundError(f"missing {META_FILE} in {model_dir}")
    files = {ARTIFACT_SYMBOL: symbols[0], ARTIFACT_PARAMS: params[-1], ARTIFACT_META: meta}
    preprocessing = os.path.join(model_dir, PREPROCESSING_FILE)
    if os.path.isfile(preprocessing):
        files[ARTIFACT_PREPROCESSING] = preprocessing
    return files


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_meta(path: str) -> dict[str, Any]:
    meta = _read_json(path)
    meta.setdefault("task", "classification")
    needs = ("feature_columns", "target_columns") if meta["task"] == "regression" else ("feature_columns", "classes")
    missing = [k for k in needs if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    meta.setdefault("input_shape", [])
    meta.setdefault("classes", [])
    meta.setdefault("target_columns", [])
    meta.setdefault("num_features", len(meta["feature_columns"]))
    if len(meta["feature_columns"]) != meta["num_features"]:
        raise ValueError(f"{path}: {len(meta['feature_columns'])} feature_columns but num_features={meta['num_features']}")
    shape = [int(d) for d in meta["input_shape"]]
    if shape and int(np.prod(shape)) != meta["num_features"]:
        raise ValueError(f"{path}: input_shape {shape} does not hold {meta['num_features']} features")
    return meta


@dataclass
class LoadedNet:
    """An exported network on CPU plus what is needed to feed it and name its outputs."""

    net: Any
    feature_columns: list[str]
    classes: list[Any]
    input_shape: list[int]
    task: str = "classification"
    target_columns: list[str] = field(default_factory=list)
    preprocessing: dict[str, Any] | None = None

    @property
    def input_columns(self) -> list[str]:
        """The columns a caller passes: the raw table's when the model preprocesses."""
        if self.preprocessing is None:
            return self.feature_columns
        return [c["name"] for c in self.preprocessing["inputs"]]

    def features(self, frame: pd.DataFrame) -> np.ndarray:
        """The network's float32 input for the rows of ``frame`` (named columns)."""
        if self.preprocessing is None:
            return frame[self.feature_columns].to_numpy(dtype=np.float32)
        return raw_features(self.preprocessing, frame)

    def predict_proba(self, features: np.ndarray, batch_size: int = PREDICT_BATCH) -> np.ndarray:
        """Softmax probabilities ``[n, num_classes]`` for float features ``[n, num_features]``."""
        return self._forward(features, len(self.classes), batch_size, softmax=True)

    def predict_values(self, features: np.ndarray, batch_size: int = PREDICT_BATCH) -> np.ndarray:
        """Regression: the predictions ``[n, num_targets]`` (float64, in the targets' units) for
        float features ``[n, num_features]``."""
        outputs = self._forward(features, len(self.target_columns), batch_size, softmax=False)
        return restore_targets(self.preprocessing, outputs)

    def _forward(self, features: np.ndarray, width: int, batch_size: int, softmax: bool) -> np.ndarray:
        mx = _import_mxnet()
        x = np.ascontiguousarray(features, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != len(self.feature_columns):
            raise ValueError(f"expected features of shape [n, {len(self.feature_columns)}], got {x.shape}")
        out = np.empty((x.shape[0], width), dtype=np.float32)
        for start in range(0, x.shape[0], batch_size):
            chunk = x[start : start + batch_size]
            if self.input_shape:
                chunk = chunk.reshape([chunk.shape[0], *self.input_shape])
            outputs = self.net(mx.nd.array(chunk, dtype="float32", ctx=mx.cpu()))
            if softmax:
                outputs = mx.nd.softmax(outputs, axis=-1)
            out[start : start + chunk.shape[0]] = outputs.asnumpy()
        return out


def raw_features(record: dict[str, Any], frame: pd.DataFrame) -> np.ndarray:
    """Raw rows → the features the network was trained on (the manifest's transform)."""
    n = len(frame)
    out = np.empty((n, len(record["output_columns"])), np.float32)
    j = 0
    for col in record["inputs"]:
        name, fill = col["name"], col["fill"]
        values = frame[name]
        missing = values.isna().to_numpy()
        if missing.any() and fill is None:
            raise ValueError(f"column {name!r} has {int(missing.sum())} missing values and this model was trained "
                             "with data.missing_values='fail'")
        if col["kind"] == "numeric":
            try:  # float32 first, as the sharder read the source
                v = values.to_numpy(dtype=np.float32, na_value=np.nan).astype(np.float64)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"column {name!r} must be numeric: {exc}") from None
            if missing.any():
                v[missing] = fill
            out[:, j] = (v - col["mean"]) / col["std"] if record["standardize"] else v
            j += 1
            continue
        index = {c: i for i, c in enumerate(col["categories"])}
        slot = np.array([index.get(str(v), len(index)) for v in values], dtype=np.int64)
        if missing.any():
            slot[missing] = index[fill]
        block = np.zeros((n, len(index) + 1), np.float32)
        block[np.arange(n), slot] = 1.0
        out[:, j:j + len(index) + 1] = block
        j += len(index) + 1
    return out


def restore_targets(record: dict[str, Any] | None, outputs: np.ndarray) -> np.ndarray:
    """Network outputs → predictions in the targets' units: a network trained on targets
    standardised with the train split's mean and std (the record's ``targets``) predicts
    ``(y - mean) / std``. A copy of ``common.preprocessing.TargetScale.restore`` (float64)."""
    targets = (record or {}).get("targets")
    if not targets:
        return outputs.astype(np.float64)
    mean = np.array([t["mean"] for t in targets], np.float64)
    std = np.array([t["std"] for t in targets], np.float64)
    return outputs.astype(np.float64) * std + mean


def load_exported(symbol_file: str, params_file: str, meta_file: str,
                  preprocessing_file: str | None = None) -> LoadedNet:
    """Load an ``net.export`` pair with ``SymbolBlock.imports`` on CPU."""
    mx = _import_mxnet()
    meta = read_meta(meta_file)
    # The data inputs are the symbol's inputs that the params file does not hold ('data' for
    # a HybridBlock export); the params file stores names as 'arg:NAME' / 'aux:NAME'.
    param_names = {k.split(":", 1)[-1] for k in mx.nd.load(params_file)}
    inputs = [n for n in mx.sym.load(symbol_file).list_inputs() if n not in param_names]
    with warnings.catch_warnings():
        # SymbolBlock cannot infer the input dtype before the first call; float32 is fed.
        warnings.filterwarnings("ignore", message="Cannot decide type", category=UserWarning)
        net = mx.gluon.SymbolBlock.imports(symbol_file, inputs, params_file, ctx=mx.cpu())
    return LoadedNet(
        net=net,
        feature_columns=[str(c) for c in meta["feature_columns"]],
        classes=list(meta["classes"]),
        input_shape=[int(d) for d in meta["input_shape"]],
        task=meta["task"],
        target_columns=[str(c) for c in meta["target_columns"]],
        preprocessing=_read_json(preprocessing_file) if preprocessing_file else None,
    )


def predictions_frame(loaded: LoadedNet, proba: np.ndarray, index: pd.Index | None = None) -> pd.DataFrame:
    """``label`` (the original class value) and ``probability`` (its softmax) per row."""
    best = proba.argmax(axis=1) if len(proba) else np.zeros(0, dtype=np.int64)
    labels = np.asarray(loaded.classes)[best] if len(loaded.classes) else np.asarray([])
    return pd.DataFrame(
        {"label": labels, "probability": proba[np.arange(len(best)), best].astype(np.float64)},
        index=index,
    )


def predict_frame(loaded: LoadedNet, features: np.ndarray, index: pd.Index | None = None) -> pd.DataFrame:
    """The model's output for float features: ``label`` and ``probability`` (classification), or
    one float64 column per target (regression)."""
    if loaded.task == "regression":
        values = loaded.predict_values(features)
        return pd.DataFrame(values, columns=loaded.target_columns, index=index)
    return predictions_frame(loaded, loaded.predict_proba(features), index=index)


class MXNetClassifier(PythonModel):
    """pyfunc model: DataFrame of named feature columns (the raw table's, for a model with
    preprocessing) → DataFrame ``label``, ``probability`` (classification) or one float column per
    target (regression: ``predict_frame``)."""

    def __init__(self) -> None:
        self._loaded: LoadedNet | None = None

    def load_context(self, context: Any) -> None:
        a = context.artifacts
        self._loaded = load_exported(a[ARTIFACT_SYMBOL], a[ARTIFACT_PARAMS], a[ARTIFACT_META],
                                     a.get(ARTIFACT_PREPROCESSING))

    # MLflow reads this type hint: pd.DataFrame means "no type-hint validation" (the logged
    # signature validates instead); no hint or `Any` makes it warn on every load.
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        if self._loaded is None:
            raise RuntimeError("MXNetClassifier.predict called before load_context")
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        if not all(isinstance(c, str) for c in frame.columns):
            frame = frame.rename(columns=str)
        wanted = self._loaded.input_columns
        missing = [c for c in wanted if c not in frame.columns]
        if missing:
            raise ValueError(
                f"model input lacks {len(missing)} of the {len(wanted)} feature columns: "
                f"{missing[:20]}{' …' if len(missing) > 20 else ''}"
            )
        features = self._loaded.features(frame)
        return predict_frame(self._loaded, features, index=frame.index)


# Models from code: MLflow executes this file at log and load time and takes this instance.
mlflow.models.set_model(MXNetClassifier())
