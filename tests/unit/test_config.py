import pytest

from common.config import ConfigError, TrainConfig, recipe

pytestmark = pytest.mark.unit


def test_round_trip_and_digest_are_stable():
    cfg = recipe("digits", "s3://b/d.csv")
    again = TrainConfig.from_json(cfg.to_json())
    assert again == cfg
    assert again.digest() == cfg.digest()
    assert cfg.replace(optim={"epochs": 3}).digest() != cfg.digest()


@pytest.mark.parametrize("section,values,needle", [
    ("cluster", {"num_workers": 0}, "cluster.num_workers"),
    ("cluster", {"kvstore": "dist_devices_sync"}, "cluster.kvstore"),
    ("cluster", {"kvstore": "device", "num_workers": 2}, "num_workers=1"),
    ("cluster", {"kvstore": "local", "num_workers": 2}, "num_workers=1"),
    ("optim", {"learning_rate": 0}, "optim.learning_rate"),
    ("optim", {"optimizer": "lbfgs"}, "optim.optimizer"),
    ("optim", {"optimizer": "adamw"}, "optim.optimizer"),
    ("optim", {"accumulate_steps": 0}, "optim.accumulate_steps"),
    ("optim", {"lr_schedule": "exponential"}, "optim.lr_schedule"),
    ("optim", {"lr_schedule": "step"}, "optim.lr_decay_epochs"),
    ("optim", {"lr_decay_epochs": (1,)}, "optim.lr_decay_epochs"),
    ("optim", {"lr_schedule": "step", "lr_decay_epochs": (2, 1)}, "optim.lr_decay_epochs"),
    ("optim", {"lr_schedule": "step", "lr_decay_epochs": (3,)}, "optim.lr_decay_epochs"),
    ("optim", {"lr_decay_factor": 1.0}, "optim.lr_decay_factor"),
    ("optim", {"warmup_steps": -1}, "optim.warmup_steps"),
    ("optim", {"final_lr": 1.0}, "optim.final_lr"),
    ("optim", {"poly_power": 0}, "optim.poly_power"),
    ("optim", {"lr_scaling": "sqrt"}, "optim.lr_scaling"),
    ("optim", {"base_batch": 0}, "optim.base_batch"),
    ("optim", {"precision": "bf16"}, "optim.precision"),
    ("optim", {"precision": "fp16"}, "needs cluster.device='gpu'"),
    ("optim", {"learning_rate": 6, "lr_scaling": "linear"}, "scaled learning rate"),
    ("cluster", {"devices_per_worker": 0}, "cluster.devices_per_worker"),
    ("cluster", {"device": "tpu"}, "cluster.device"),
    ("cluster", {"kvstore": "dist_async", "devices_per_worker": 2}, "devices_per_worker=1"),
    ("cluster", {"gradient_compression": "1bit"}, "cluster.gradient_compression"),
    ("cluster", {"gradient_compression": "2bit", "kvstore": "local", "num_workers": 1}, "refuses 'local'"),
    ("cluster", {"gradient_compression": "2bit", "kvstore": "dist_async"}, "cluster.gradient_compression"),
    ("cluster", {"compression_threshold": 0}, "cluster.compression_threshold"),
    ("cluster", {"backend": "k8s"}, "cluster.backend"),
    ("checkpoint", {"keep": 1}, "checkpoint.keep"),
    ("data", {"label_column": ""}, "data.label_column"),
    ("model", {"name": "lenet"}, "input_shape"),
])
def test_invalid_values_name_the_field(section, values, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        recipe("debug", "s3://b/d.csv").replace(**{section: values})


def test_several_contexts_need_a_divisible_batch():
    cfg = recipe("debug").replace(cluster={"devices_per_worker": 2, "kvstore": "dist_device_sync"})
    assert cfg.optim.batch_size % 2 == 0
    with pytest.raises(ConfigError, match=r"optim\.batch_size=30 must be divisible by cluster\.devices_per_worker=4"):
        cfg.replace(optim={"batch_size": 30}, cluster={"devices_per_worker": 4})


def test_fp16_is_a_gpu_option():
    with pytest.raises(ConfigError, match="mxnet.contrib.amp runs float16 on GPU contexts only"):
        recipe("debug").replace(optim={"precision": "fp16"})
    assert recipe("debug").replace(optim={"precision": "fp16"}, cluster={"device": "gpu"}).optim.precision == "fp16"


def test_global_batch_and_linear_lr_scaling():
    cfg = recipe("debug").replace(optim={"batch_size": 16, "accumulate_steps": 4, "learning_rate": 0.01,
                                         "lr_scaling": "linear", "base_batch": 64})
    assert cfg.global_batch(2) == 16 * 4 * 2
    assert cfg.effective_learning_rate(2) == pytest.approx(0.01 * 128 / 64)
    assert cfg.replace(optim={"lr_scaling": "none"}).effective_learning_rate(2) == 0.01


def test_shards_must_cover_every_worker():
    cfg = recipe("debug").replace(cluster={"num_workers": 3}, data={"num_shards": 3})
    assert cfg.num_train_shards == 3
    # An uneven count is fine: every worker has a shard and wraps around its own rows.
    assert cfg.replace(data={"num_shards": 4}).num_train_shards == 4
    with pytest.raises(ConfigError, match=r"data\.num_shards=2 cannot be spread"):
        cfg.replace(data={"num_shards": 2})


def test_every_constant_is_a_valid_value():
    """The DAG derives its Param enums from these tuples: each member must build a config."""
    from common import config as c

    base = recipe("debug")
    for name in c.OPTIMIZERS:
        assert base.replace(optim={"optimizer": name}).optim.optimizer == name
    for kv in c.KVSTORES:
        workers = 1 if kv in ("local", "device") else 2
        assert base.replace(cluster={"kvstore": kv, "num_workers": workers}).cluster.kvstore == kv
    for sched in c.LR_SCHEDULES:
        extra = {"lr_decay_epochs": (1,)} if sched == "step" else {}
        assert base.replace(optim={"lr_schedule": sched, **extra}).optim.lr_schedule == sched
    for kv in c.COMPRESSION_KVSTORES:
        assert base.replace(cluster={"kvstore": kv, "gradient_compression": "2bit"}).cluster.kvstore == kv
    for backend in c.BACKENDS:
        assert base.replace(cluster={"backend": backend}).cluster.backend == backend


def test_unknown_keys_are_rejected_by_name():
    with pytest.raises(ConfigError, match="epochz"):
        TrainConfig.from_dict({"optim": {"epochz": 3}})
    with pytest.raises(ConfigError, match="optimiser"):
        TrainConfig.from_dict({"optimiser": {}})


def test_train_shards_default_to_one_per_worker():
    cfg = recipe("debug").replace(cluster={"num_workers": 3})
    assert cfg.num_train_shards == 3
    assert cfg.replace(data={"num_shards": 6}).num_train_shards == 6


# The "Bad input" list, each through from_dict (what the CLI, the DAG and every role
# read a config with): a ConfigError naming the field, before any process is started.
BAD_INPUT = [
    ({"optim": {"optimizer": "adamax"}}, r"optim\.optimizer must be one of"),
    ({"model": {"name": "vgg16"}}, r"model\.name must be one of"),
    ({"cluster": {"kvstore": "nccl"}}, r"cluster\.kvstore must be one of"),
    ({"cluster": {"num_workers": 0}}, r"cluster\.num_workers must be in \[1, 256\]"),
    ({"cluster": {"num_servers": 0}}, r"cluster\.num_servers must be in \[1, 64\]"),
    ({"optim": {"batch_size": 30}, "cluster": {"devices_per_worker": 4}}, r"must be divisible by cluster\.devices"),
    ({"optim": {"accumulate_steps": 0}}, r"optim\.accumulate_steps must be in \[1, 1024\]"),
    ({"optim": {"precision": "fp16"}}, r"needs cluster\.device='gpu'"),
    ({"cluster": {"num_workers": 3}, "data": {"num_shards": 2}}, r"data\.num_shards=2 cannot be spread"),
    ({"cluster": {"num_workers": 4}, "data": {"shards_per_worker": 0}}, r"data\.shards_per_worker must be >= 1"),
    ({"model": {"placement": "pipeline"}}, r"model\.placement must be one of"),
    ({"model": {"placement": "split"}}, r"needs cluster\.devices_per_worker >= 2"),
    ({"model": {"placement": "split"}, "cluster": {"devices_per_worker": 2, "optimizer_on": "servers"}},
     r"needs the optimizer on the workers"),
]


@pytest.mark.parametrize("raw,needle", BAD_INPUT, ids=[n.split(" ")[0].replace("\\", "") for _, n in BAD_INPUT])
def test_bad_input_fails_at_config_construction(raw, needle):
    base = recipe("debug", "s3://b/d.csv").to_dict()
    for section, values in raw.items():
        base[section] = {**base[section], **values}
    with pytest.raises(ConfigError, match=needle):
        TrainConfig.from_dict(base)


def test_split_placement_is_a_valid_config():
    cfg = recipe("debug").replace(model={"placement": "split"}, cluster={"devices_per_worker": 2},
                                  optim={"batch_size": 31})
    assert cfg.model.placement == "split"  # the batch is not sliced over the contexts: any size
