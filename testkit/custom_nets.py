"""A user's own network package, written into a folder outside the repository by the tests of
custom networks (``model.name = "mynet.arch:<factory>"``, ``model.code_uri = <folder>``)."""
from __future__ import annotations

import os

PACKAGE = "mynet"

ARCH = '''
"""Factories as a user writes them: keywords num_outputs, input_shape, options."""
from mxnet import gluon
from mxnet.gluon import nn


class Residual(gluon.HybridBlock):
    """A block of its own class: a Dense layer with a skip connection."""

    def __init__(self, width, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.inner = nn.Dense(width, activation="relu")
            self.proj = nn.Dense(width)

    def hybrid_forward(self, F, x):
        return F.relu(self.proj(x) + self.inner(x))


def build(num_outputs, input_shape, options):
    net = nn.HybridSequential(prefix="mynet_")
    with net.name_scope():
        net.add(Residual(int(options.get("width", 32))))
        if options.get("dropout"):
            net.add(nn.Dropout(float(options["dropout"])))
        net.add(nn.Dense(num_outputs))
    return net


def conv(num_outputs, input_shape, options):
    net = nn.HybridSequential(prefix="myconv_")
    with net.name_scope():
        net.add(nn.Conv2D(4, kernel_size=3, padding=1, activation="relu"), nn.Flatten(), nn.Dense(num_outputs))
    assert len(input_shape) == 3, input_shape
    return net


def wrong_size(num_outputs, input_shape, options):
    return nn.Dense(num_outputs + 1)


def raises(num_outputs, input_shape, options):
    raise RuntimeError("no such width: " + str(options.get("width")))


def not_hybrid(num_outputs, input_shape, options):
    return nn.Sequential()


def not_traceable(num_outputs, input_shape, options):
    class Eager(gluon.HybridBlock):
        def hybrid_forward(self, F, x):
            return F.array(x.asnumpy())  # NDArray only: no symbol

    return Eager()


NOT_A_FACTORY = 3
'''


def write_package(folder: str) -> str:
    """``folder/mynet/{__init__,arch,broken}.py``; returns ``folder`` (the ``model.code_uri``)."""
    pkg = os.path.join(folder, PACKAGE)
    os.makedirs(pkg, exist_ok=True)
    for name, text in (("__init__.py", ""), ("arch.py", ARCH), ("broken.py", "raise ImportError('needs torch')\n")):
        with open(os.path.join(pkg, name), "w") as fh:
            fh.write(text)
    return folder
