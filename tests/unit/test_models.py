"""The model zoo by name: every model builds, hybridizes, runs forward; ResNet-18 goes through
the same export → ``pyfunc_model.load_exported`` path the registry uses."""
import json
import os

import numpy as np
import pytest

from common.mx import import_mxnet
from common.config import MODELS, ConfigError, DataConfig, ModelConfig, TrainConfig
from training.loop.model import build_model

pytestmark = pytest.mark.unit

SHAPE = (3, 32, 32)
FEATURES = int(np.prod(SHAPE))


def _net(name: str, classes: int = 7):
    mx = import_mxnet()
    cfg = TrainConfig(data=DataConfig(input_shape=SHAPE), model=ModelConfig(name=name))
    net = build_model(cfg, classes)
    net.initialize(mx.init.Xavier())
    net.hybridize()
    return net


def _trainable(net) -> int:
    return sum(p.data().size for p in net.collect_params().values() if p.grad_req != "null")


@pytest.mark.parametrize("name", MODELS)
def test_every_model_maps_flat_features_to_logits(name):
    mx = import_mxnet()
    net = _net(name)
    out = net(mx.nd.random.uniform(shape=(2, FEATURES)))
    assert out.shape == (2, 7)
    assert np.isfinite(out.asnumpy()).all()


def test_resnet_sizes_match_the_published_ones():
    # The published trainable counts with 1000 classes (BatchNorm running stats not counted):
    # ResNet-18 11,689,512 and ResNet-50 25,557,032. Here 7 classes: the last Dense has
    # (width + 1) * 7 weights instead of (width + 1) * 1000. Gluon's BottleneckV1 gives its two
    # 1x1 convolutions a bias (the paper's has none): stages of 3, 4, 6, 3 blocks with 64..512
    # and 256..2048 channels add 3*64+4*128+6*256+3*512 + 3*256+4*512+6*1024+3*2048 = 18,880.
    mx = import_mxnet()
    extra50 = 3 * 64 + 4 * 128 + 6 * 256 + 3 * 512 + 3 * 256 + 4 * 512 + 6 * 1024 + 3 * 2048
    for name, imagenet, width in (("resnet18", 11_689_512, 512), ("resnet50", 25_557_032 + extra50, 2048)):
        net = _net(name)
        net(mx.nd.zeros((1, FEATURES)))
        assert _trainable(net) == imagenet - (width + 1) * (1000 - 7)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "lenet"])
def test_image_models_need_an_input_shape(name):
    with pytest.raises(ConfigError, match=rf"model.name='{name}' needs data.input_shape"):
        TrainConfig(model=ModelConfig(name=name))


def test_resnet18_exports_and_loads_through_the_pyfunc_path(tmp_path):
    from training.tracking.pyfunc_model import find_export_files, load_exported

    mx = import_mxnet()
    net = _net("resnet18", classes=4)
    x = np.random.default_rng(0).uniform(size=(3, FEATURES)).astype(np.float32)
    want = mx.nd.softmax(net(mx.nd.array(x)), axis=-1).asnumpy()
    net.export(str(tmp_path / "model"), epoch=0)
    meta = {"feature_columns": [f"p{i}" for i in range(FEATURES)], "classes": ["a", "b", "c", "d"],
            "input_shape": list(SHAPE), "num_features": FEATURES}
    (tmp_path / "model_meta.json").write_text(json.dumps(meta))
    files = find_export_files(str(tmp_path))
    assert os.path.basename(files["params"]) == "model-0000.params"
    loaded = load_exported(files["symbol"], files["params"], files["meta"])
    np.testing.assert_allclose(loaded.predict_proba(x), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_draws_random_only_with_dropout(name):
    """The worker skips the per-step MXNet seed (1.9 ms of engine CPU) for nets that never read
    the RNG; dropout, or any operator outside the known-deterministic set, keeps it."""
    from training.loop.model import draws_random

    mlp_shape = () if name == "mlp" else SHAPE
    plain = TrainConfig(data=DataConfig(input_shape=mlp_shape), model=ModelConfig(name=name, dropout=0.0))
    assert draws_random(build_model(plain, 7)) is False
    if name == "mlp":
        dropout = TrainConfig(data=DataConfig(input_shape=()), model=ModelConfig(name=name, dropout=0.3))
        assert draws_random(build_model(dropout, 7)) is True


def test_reseed_without_mxnet_leaves_its_generator_alone():
    from training.checkpoint.state import reseed

    mx = import_mxnet()
    mx.random.seed(11)
    expected = mx.nd.random.uniform(shape=(4,)).asnumpy()
    mx.random.seed(11)
    reseed(0, 5, 0, mxnet=False)
    np.testing.assert_array_equal(mx.nd.random.uniform(shape=(4,)).asnumpy(), expected)
    reseed(0, 5, 0)
    first = mx.nd.random.uniform(shape=(4,)).asnumpy()
    reseed(0, 5, 0)
    np.testing.assert_array_equal(mx.nd.random.uniform(shape=(4,)).asnumpy(), first)
