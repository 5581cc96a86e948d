"""The model zoo: networks chosen by name from the config."""
from __future__ import annotations

from typing import Any

from common.mx import import_mxnet
from training.config import TrainConfig

# gluon.model_zoo.vision ResNets by config name → depth. Version 1 (post-activation, He et al.
# 2015), the same network the checkpoint benchmark trains.
RESNETS = {"resnet18": 18, "resnet50": 50}
RESNET_VERSION = 1


def build_model(cfg: TrainConfig, num_classes: int) -> Any:
    """A HybridBlock mapping float32 ``[batch, num_features]`` to logits ``[batch, num_classes]``.

    Convolutional models reshape the flat features to ``data.input_shape`` inside the network, so
    the record format and the exported model's input stay the same for every model.
    """
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


def _Reshape(shape: tuple[int, ...]) -> Any:
    mx = import_mxnet()

    class Reshape(mx.gluon.HybridBlock):
        def hybrid_forward(self, F: Any, x: Any) -> Any:
            return F.reshape(x, shape=(-1, *shape))

    return Reshape()
