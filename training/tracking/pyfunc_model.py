"""The MLflow pyfunc wrapper around an exported Gluon network (MLflow has no MXNet flavor).

The trainer exports with ``net.export(prefix, epoch=0)`` into one folder:
``<prefix>-symbol.json``, ``<prefix>-NNNN.params`` and ``model_meta.json``
(``feature_columns``, ``classes``, ``input_shape``, ``num_features``). The network takes float32
``[batch, num_features]`` (reshaped to ``[batch] + input_shape`` when that is non-empty) and
returns logits ``[batch, num_classes]``. A custom network (``model.name`` an import path) is
exported the same way: its symbol holds only MXNet operators, so loading it needs neither the
project nor the user's code (``tests/unit/test_custom_model.py``), and no ``code_paths`` are logged.

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
from dataclasses import dataclass
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
    return {ARTIFACT_SYMBOL: symbols[0], ARTIFACT_PARAMS: params[-1], ARTIFACT_META: meta}


def read_meta(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        meta = json.load(f)
    missing = [k for k in ("feature_columns", "classes") if k not in meta]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    meta.setdefault("input_shape", [])
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

    def predict_proba(self, features: np.ndarray, batch_size: int = PREDICT_BATCH) -> np.ndarray:
        """Softmax probabilities ``[n, num_classes]`` for float features ``[n, num_features]``."""
        mx = _import_mxnet()
        x = np.ascontiguousarray(features, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != len(self.feature_columns):
            raise ValueError(f"expected features of shape [n, {len(self.feature_columns)}], got {x.shape}")
        out = np.empty((x.shape[0], len(self.classes)), dtype=np.float32)
        for start in range(0, x.shape[0], batch_size):
            chunk = x[start : start + batch_size]
            if self.input_shape:
                chunk = chunk.reshape([chunk.shape[0], *self.input_shape])
            logits = self.net(mx.nd.array(chunk, dtype="float32", ctx=mx.cpu()))
            out[start : start + chunk.shape[0]] = mx.nd.softmax(logits, axis=-1).asnumpy()
        return out


def load_exported(symbol_file: str, params_file: str, meta_file: str) -> LoadedNet:
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
    )


def predictions_frame(loaded: LoadedNet, proba: np.ndarray, index: pd.Index | None = None) -> pd.DataFrame:
    """``label`` (the original class value) and ``probability`` (its softmax) per row."""
    best = proba.argmax(axis=1) if len(proba) else np.zeros(0, dtype=np.int64)
    labels = np.asarray(loaded.classes)[best] if len(loaded.classes) else np.asarray([])
    return pd.DataFrame(
        {"label": labels, "probability": proba[np.arange(len(best)), best].astype(np.float64)},
        index=index,
    )


class MXNetClassifier(PythonModel):
    """pyfunc model: DataFrame of named feature columns → DataFrame ``label``, ``probability``."""

    def __init__(self) -> None:
        self._loaded: LoadedNet | None = None

    def load_context(self, context: Any) -> None:
        a = context.artifacts
        self._loaded = load_exported(a[ARTIFACT_SYMBOL], a[ARTIFACT_PARAMS], a[ARTIFACT_META])

    # MLflow reads this type hint: pd.DataFrame means "no type-hint validation" (the logged
    # signature validates instead); no hint or `Any` makes it warn on every load.
    def predict(self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None) -> pd.DataFrame:
        if self._loaded is None:
            raise RuntimeError("MXNetClassifier.predict called before load_context")
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        if not all(isinstance(c, str) for c in frame.columns):
            frame = frame.rename(columns=str)
        wanted = self._loaded.feature_columns
        missing = [c for c in wanted if c not in frame.columns]
        if missing:
            raise ValueError(
                f"model input lacks {len(missing)} of the {len(wanted)} feature columns: "
                f"{missing[:20]}{' …' if len(missing) > 20 else ''}"
            )
        features = frame[wanted].to_numpy(dtype=np.float32)
        return predictions_frame(self._loaded, self._loaded.predict_proba(features), index=frame.index)


# Models from code: MLflow executes this file at log and load time and takes this instance.
mlflow.models.set_model(MXNetClassifier())
