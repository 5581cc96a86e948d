import pytest

from training.config import ConfigError, TrainConfig, recipe

pytestmark = pytest.mark.unit


def test_round_trip_and_digest_are_stable():
    cfg = recipe("digits", "s3://b/d.csv")
    again = TrainConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.digest() == cfg.digest()
    assert cfg.replace(optim={"epochs": 3}).digest() != cfg.digest()


@pytest.mark.parametrize("section,values,needle", [
    ("cluster", {"num_workers": 0}, "cluster.num_workers"),
    ("cluster", {"kvstore": "dist_device_sync"}, "cluster.kvstore"),
    ("cluster", {"kvstore": "local", "num_workers": 2}, "num_workers=1"),
    ("optim", {"learning_rate": 0}, "optim.learning_rate"),
    ("optim", {"optimizer": "lbfgs"}, "optim.optimizer"),
    ("checkpoint", {"keep": 1}, "checkpoint.keep"),
    ("data", {"label_column": ""}, "data.label_column"),
    ("model", {"name": "lenet"}, "input_shape"),
])
def test_invalid_values_name_the_field(section, values, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        recipe("debug", "s3://b/d.csv").replace(**{section: values})


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ConfigError, match="epochz"):
        TrainConfig.from_dict({"optim": {"epochz": 3}})
    with pytest.raises(ConfigError, match="optimiser"):
        TrainConfig.from_dict({"optimiser": {}})


def test_train_shards_default_to_one_per_worker():
    cfg = recipe("debug").replace(cluster={"num_workers": 3})
    assert cfg.num_train_shards == 3
    assert cfg.replace(data={"num_shards": 6}).num_train_shards == 6
