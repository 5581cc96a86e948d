"""The model zoo: networks chosen by name from the config, or a custom network's factory
(``custom_model``), and what one of them holds."""
from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from typing import Any

from common import model_code
from common.model_code import StagedCode
from common.mx import import_mxnet
from common.config import DataConfig, ModelConfig, TrainConfig, is_custom_model
from training.loop import custom_model

# gluon.model_zoo.vision ResNets by config name → depth. Version 1 (post-activation, He et al.
# 2015), the same network the checkpoint benchmark trains.
RESNETS = {"resnet18": 18, "resnet50": 50}
RESNET_VERSION = 1

# Operators known to draw no random numbers in training mode. A network with any other
# operator (Dropout, random_*/sample_* ops, anything new) counts as drawing them.
DETERMINISTIC_OPS = frozenset({"null", "Activation", "BatchNorm", "Convolution", "Flatten", "FullyConnected",
                               "Pooling", "Reshape", "elemwise_add"})


def build_model(cfg: TrainConfig, num_classes: int, num_features: int = 0) -> Any:
    """A HybridBlock mapping float32 ``[batch, num_features]`` to logits ``[batch, num_classes]``.

    Convolutional models reshape the flat features to ``data.input_shape`` inside the network, so
    the record format and the exported model's input stay the same for every model. A custom
    network (``training.loop.custom_model``; its module importable, ``num_features`` given) gets
    the same reshape in front of its block and is checked by shape inference before it is used.
    """
    if is_custom_model(cfg.model.name):
        return _custom(cfg, num_classes, num_features)
    mx = import_mxnet()
    nn = mx.gluon.nn
    net = nn.HybridSequential()
    with net.name_scope():
        if cfg.model.name == "mlp":
            for width in cfg.model.hidden:
                net.add(nn.Dense(width, activation="relu"))
                if cfg.model.dropout:
                    net.add(nn.Dropout(cfg.model.dropout))
        elif cfg.model.name == "lenet":
            net.add(_Reshape(cfg.data.input_shape))
            net.add(nn.Conv2D(20, kernel_size=3, padding=1, activation="relu"))
            net.add(nn.MaxPool2D(pool_size=2, strides=2))
            net.add(nn.Conv2D(50, kernel_size=3, padding=1, activation="relu"))
            net.add(nn.Flatten())
            for width in cfg.model.hidden:
                net.add(nn.Dense(width, activation="relu"))
        elif cfg.model.name in RESNETS:
            # From scratch (no pretrained download: training machines need no internet). The
            # zoo's net ends in its own Dense(classes); model.hidden and dropout do not apply.
            net.add(_Reshape(cfg.data.input_shape))
            net.add(mx.gluon.model_zoo.vision.get_resnet(RESNET_VERSION, RESNETS[cfg.model.name],
                                                         classes=num_classes, pretrained=False))
            return net
        net.add(nn.Dense(num_classes))
    return net


def _custom(cfg: TrainConfig, num_classes: int, num_features: int) -> Any:
    shape = cfg.data.input_shape or (num_features,)
    if math.prod(shape) != num_features:
        raise custom_model.ModelBuildError(f"data.input_shape={shape} does not hold the {num_features} features "
                                           f"of a record (model.name={cfg.model.name!r})")
    block = custom_model.build_block(cfg.model, num_classes, shape)
    net = block
    if cfg.data.input_shape:
        net = import_mxnet().gluon.nn.HybridSequential()
        net.add(_Reshape(cfg.data.input_shape), block)
    custom_model.check_outputs(net, cfg.model.name, num_features, num_classes)
    return net


def check_factory(cfg: TrainConfig, code: StagedCode | None) -> None:
    """Import a custom network's factory with its staged code on the path, as a worker will: a
    bad import path or module fails before any data is read (``custom_model.ModelBuildError``)."""
    with _on_path(code):
        custom_model.load_factory(cfg.model.name)


def check_custom_model(cfg: TrainConfig, code: StagedCode | None, num_classes: int, num_features: int) -> None:
    """Build a custom network as a worker will and check its output size by shape inference."""
    with _on_path(code):
        build_model(cfg, num_classes, num_features)


def _on_path(code: StagedCode | None) -> contextlib.AbstractContextManager[Any]:
    return model_code.on_path(code) if code else contextlib.nullcontext()


def count_model(name: str, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (128, 64),
                options: dict[str, Any] | None = None) -> dict[str, int]:
    """Count a model of the zoo by name, or a custom one by import path (its module importable,
    ``options`` its ``model.options``), without allocating it: symbolic shape inference.

    ``params``: trainable values; ``aux``: non-trainable state (BatchNorm running mean/var);
    ``activations_per_sample``: forward operator outputs for one sample. These are the inputs of
    hardware planning (``infra.planning.ModelShape``), which does not import the trainer.
    """
    mx = import_mxnet()
    model = ModelConfig(name=name, hidden=tuple(hidden), options=dict(options or {}))
    cfg = TrainConfig(data=DataConfig(input_shape=tuple(input_shape)), model=model)
    features = math.prod(input_shape)
    internals = build_model(cfg, num_classes, features)(mx.sym.var("data")).get_internals()
    arg_shapes, out_shapes, aux_shapes = internals.infer_shape(data=(1, features))
    params = sum(math.prod(s) for n, s in zip(internals.list_arguments(), arg_shapes) if n != "data")
    # Variables appear among the internals too; operator outputs are the "*_output*" entries.
    acts = sum(math.prod(s) for n, s in zip(internals.list_outputs(), out_shapes) if "_output" in n)
    return {"params": params, "aux": sum(math.prod(s) for s in aux_shapes), "activations_per_sample": acts}


def _Reshape(shape: tuple[int, ...]) -> Any:
    mx = import_mxnet()

    class Reshape(mx.gluon.HybridBlock):
        def hybrid_forward(self, F: Any, x: Any) -> Any:
            return F.reshape(x, shape=(-1, *shape))

    return Reshape()


def draws_random(net: Any) -> bool:
    """Whether a forward/backward of ``net`` (a ``build_model`` block) may read MXNet's RNG.

    Decided from the operators of its symbolic graph against ``DETERMINISTIC_OPS``; a network
    that cannot be traced counts as drawing. The worker re-seeds MXNet every step only when
    this is true (``training.checkpoint.state.reseed``).
    """
    mx = import_mxnet()
    try:
        graph = json.loads(net(mx.sym.var("data")).tojson())
    except Exception:  # noqa: BLE001 - any failure to trace means "assume it draws"
        return True
    return any(node["op"] not in DETERMINISTIC_OPS for node in graph["nodes"])
