"""A network of the user's own: ``model.name = "package.module:factory"``.

The factory is called with keywords only::

    factory(num_outputs: int, input_shape: tuple[int, ...], options: dict) -> gluon.HybridBlock

``num_outputs`` is the number of classes, ``input_shape`` the shape of one example as the block
receives it (``data.input_shape`` when set, e.g. ``(1, 8, 8)``, else ``(num_features,)``),
``options`` the config's ``model.options`` (a JSON object, ``{}`` by default). The block maps a
batch ``[batch, *input_shape]`` to logits ``[batch, num_outputs]``; the pipeline puts the reshape
from the flat record in front of it. It must be hybridizable out of MXNet's own operators: the
registered MLflow model is its exported symbol and parameters, loaded with ``SymbolBlock`` in a
process that has neither the project nor the user's code (a Python ``CustomOp`` would need that
code there, so it is refused).

Every way this can go wrong (no such module, an import that raises, no such factory, a factory
that raises or returns something else, a block that cannot be traced or gives the wrong output
size) is a ``ModelBuildError`` naming the factory: a ``ConfigError``, so the first task fails
without a retry and a worker exits with ``EXIT_BAD_INPUT``.
"""
from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from common.config import ConfigError, ModelConfig
from common.mx import import_mxnet

# Operators whose computation lives in Python (mx.operator.CustomOp): an exported symbol holding
# them loads only where their code is registered.
PYTHON_OPS = frozenset({"Custom"})


class ModelBuildError(ConfigError):
    """The custom network's factory cannot be loaded or does not give a usable block."""


def load_factory(import_path: str) -> Callable[..., Any]:
    """The callable ``package.module:factory`` names, imported from ``sys.path``."""
    module_name, _, attr = import_path.partition(":")
    import_mxnet()  # first, through the project's import (no scikit-learn), before the user's module imports it
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise ModelBuildError(f"model.name={import_path!r}: no module named {exc.name!r} (is model.code_uri the "
                              f"folder that holds it?)") from None
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything while importing
        raise ModelBuildError(f"model.name={import_path!r}: importing {module_name} failed: "
                              f"{type(exc).__name__}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelBuildError(f"model.name={import_path!r}: module {module_name} ({module.__file__}) has no "
                              f"callable {attr!r}")
    return factory


def build_block(model: ModelConfig, num_outputs: int, input_shape: Sequence[int]) -> Any:
    """The factory's block for ``[batch, *input_shape]`` → ``[batch, num_outputs]`` (unchecked)."""
    mx = import_mxnet()
    factory = load_factory(model.name)
    try:
        block = factory(num_outputs=num_outputs, input_shape=tuple(input_shape), options=dict(model.options))
    except Exception as exc:  # noqa: BLE001 - whatever the user's factory raises, said with its name
        raise ModelBuildError(f"model.name={model.name!r}: the factory raised {type(exc).__name__}: {exc}") from None
    if not isinstance(block, mx.gluon.HybridBlock):
        raise ModelBuildError(f"model.name={model.name!r}: the factory returned {type(block).__name__}, not a "
                              "mxnet.gluon.HybridBlock")
    return block


def check_outputs(net: Any, name: str, num_features: int, num_outputs: int) -> None:
    """Trace ``net`` symbolically on ``[2, num_features]``: it must give ``[2, num_outputs]`` and
    use no Python operator. Nothing is allocated."""
    mx = import_mxnet()
    try:
        out = net(mx.sym.var("data"))
        _, shapes, _ = out.infer_shape(data=(2, num_features))
    except Exception as exc:  # noqa: BLE001 - a block that cannot be traced, said with its name
        raise ModelBuildError(f"model.name={name!r}: the block cannot be traced as a symbol on an input "
                              f"[batch, {num_features}] (is it hybridizable, and is its input shape right?): "
                              f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}") from None
    if len(shapes) != 1 or tuple(shapes[0]) != (2, num_outputs):
        got = ", ".join(str(list(s)) for s in shapes)
        raise ModelBuildError(f"model.name={name!r}: the block's output for a batch of 2 is {got}, expected "
                              f"[2, {num_outputs}] (one logit per class)")
    python_ops = sorted({n["op"] for n in json.loads(out.tojson())["nodes"]} & PYTHON_OPS)
    if python_ops:
        raise ModelBuildError(f"model.name={name!r}: the block uses the Python operator(s) {python_ops}; the "
                              "registered model is the exported symbol, which needs MXNet's own operators")
