"""Strict types of the config: a wrong type is refused by name, never converted; and the
serialised form (hence every checkpoint's digest) is exactly what it was."""
import json

import pytest

from common.config import CheckpointConfig, ConfigError, TrainConfig, recipe

pytestmark = pytest.mark.unit

# Every section changed from the defaults, with whole numbers in float fields (they must stay
# integers in to_dict(), or the digest would change) and every array field set.
EVERY_SECTION = {
    "data": {"source_uri": "s3://b/d.parquet", "label_column": "y", "num_shards": 4, "shards_per_worker": 2,
             "val_fraction": 0.15, "test_fraction": 0.25, "input_shape": [1, 8, 8], "max_shard_imbalance": 2,
             "max_label_skew": 0.3, "id_column": "uid", "classes": [3, 1, 2], "feature_columns": ["f0", "f1"],
             "feature_range": [0, 16], "evaluation_rows": 100_000, "chunk_rows": 1000, "drift_action": "fail",
             "drift_threshold": 0.2,
             "prefetch_batches": 4, "target_columns": [], "target_range": [], "standardize": True, "missing_values": "fail",
             "rare_label_action": "warn", "rare_label_rows": 5, "rare_label_ratio": 0.01},
    "model": {"name": "lenet", "hidden": [64, 32], "dropout": 0.25, "placement": "split"},
    "optim": {"optimizer": "sgd", "learning_rate": 0.05, "momentum": 0.8, "weight_decay": 0.0001, "batch_size": 64,
              "epochs": 12, "accumulate_steps": 2, "lr_schedule": "step", "warmup_steps": 10,
              "lr_decay_epochs": [4, 8], "lr_decay_factor": 0.5, "final_lr": 0, "poly_power": 1,
              "lr_scaling": "linear", "base_batch": 128, "precision": "fp32"},
    "cluster": {"backend": "hosts", "kvstore": "dist_sync", "num_workers": 2, "num_servers": 2,
                "start_timeout_s": 60, "stall_timeout_s": 90.5, "job_timeout_s": 7200, "threads_per_role": 2,
                "optimizer_on": "workers", "device": "cpu", "devices_per_worker": 2, "gradient_compression": "2bit",
                "compression_threshold": 8, "flush_denormals": False},
    "checkpoint": {"every_n_steps": 25, "every_n_seconds": 30, "keep": 5, "keep_every_n_steps": 100,
                   "async_upload": False, "upload_timeout_s": 120, "preempt_grace_s": 10.5, "sse": "aws:kms",
                   "sse_kms_key_id": "alias/k", "encryption_key_env": "MXPIPE_KEY", "elastic": True,
                   "step_metrics_every_n": 5, "max_step_metrics": 500},
    "seed": 7,
}

# (config, digest(), resume_digest()) measured with the dataclass implementation of
# common/config.py (before the models were pydantic): checkpoints written then embed these, so
# they must never change for the same config.
def _timed(cfg: TrainConfig, **optim) -> TrainConfig:
    """The config as it was then: cluster.job_timeout_s defaulted to 3600 (now 0, no limit) and
    optim.early_stopping_patience to 0 (now on); ``optim``: more fields as they were."""
    raw = cfg.to_dict()
    raw["cluster"]["job_timeout_s"] = 3600.0
    raw["optim"].update(early_stopping_patience=0, **optim)
    return TrainConfig.from_dict(raw)


def _digits_then(source: str = "") -> TrainConfig:
    """The digits recipe as it was then: 20 epochs at a constant rate, no dropout."""
    return _timed(recipe("digits", source).replace(model={"dropout": 0.0}), epochs=20, lr_schedule="constant")


PINNED = [
    (lambda: _digits_then(), "6e0b0322f610a689", "b1f6055028fc297f"),
    (lambda: _digits_then("s3://b/d.csv"), "7ac610d7782aac46", "35420b11d431abae"),
    (lambda: _timed(recipe("debug")), "470cb94388c46c00", "335b575157570806"),
    (lambda: _timed(TrainConfig.from_dict(EVERY_SECTION)).replace(cluster={"job_timeout_s": 7200}),
     "4e1a488af679820f", "ccb6b4304d97d98e"),
]


@pytest.mark.parametrize("make,digest,resume", PINNED, ids=["digits", "digits-source", "debug", "every-section"])
def test_digests_are_those_of_the_dataclass_config(make, digest, resume):
    from training.loop.resume import resume_digest

    cfg = make()
    assert cfg.digest() == digest
    assert resume_digest(cfg) == resume
    assert TrainConfig.from_json(cfg.to_json()).digest() == digest


def test_to_dict_keeps_field_order_tuples_and_whole_numbers():
    raw = TrainConfig.from_dict(EVERY_SECTION).to_dict()
    assert list(raw) == ["data", "model", "optim", "cluster", "checkpoint", "seed", "sweep"]
    assert list(raw["data"]) == list(EVERY_SECTION["data"])
    assert raw["data"]["feature_range"] == (0, 16) and type(raw["data"]["feature_range"][0]) is int
    assert raw["model"]["hidden"] == (64, 32) and raw["optim"]["lr_decay_epochs"] == (4, 8)
    assert type(raw["checkpoint"]["every_n_seconds"]) is int and type(raw["cluster"]["stall_timeout_s"]) is float
    assert raw["data"]["classes"] == (3, 1, 2)


# The wrong values the strict models refuse (the dataclasses accepted the first four, and read
# "false" as true), each with the field and the expected type the message must name.
WRONG_TYPES = [
    ({"cluster": {"num_workers": 2.5}}, "cluster.num_workers must be an integer, got 2.5 (a number)"),
    ({"optim": {"batch_size": True}}, "optim.batch_size must be an integer, got True (a boolean)"),
    ({"optim": {"epochs": 3.7}}, "optim.epochs must be an integer, got 3.7 (a number)"),
    ({"checkpoint": {"elastic": "false"}}, "checkpoint.elastic must be true or false, got 'false' (a string)"),
    ({"optim": {"epochs": "3"}}, "optim.epochs must be an integer, got '3' (a string)"),
    ({"optim": {"epochs": 3.0}}, "optim.epochs must be an integer, got 3.0 (a number)"),
    ({"optim": {"learning_rate": "0.1"}}, "optim.learning_rate must be a number, got '0.1' (a string)"),
    ({"optim": {"learning_rate": True}}, "optim.learning_rate must be a number, got True (a boolean)"),
    ({"cluster": {"flush_denormals": 1}}, "cluster.flush_denormals must be true or false, got 1 (an integer)"),
    ({"model": {"hidden": "128"}}, "model.hidden must be a list, got '128' (a string)"),
    ({"model": {"hidden": [64, "32"]}}, "model.hidden[1] must be an integer, got '32' (a string)"),
    ({"data": {"classes": [0, True]}}, "data.classes[1] must be an integer or a string, got True (a boolean)"),
    ({"data": {"label_column": 7}}, "data.label_column must be a string, got 7 (an integer)"),
    ({"seed": "42"}, "seed must be an integer, got '42' (a string)"),
    ({"optim": 3}, "config section 'optim' must be a JSON object, got an integer"),
]


@pytest.mark.parametrize("raw,message", WRONG_TYPES, ids=[m.split(" ")[0] for _, m in WRONG_TYPES])
def test_a_wrong_type_is_refused_naming_the_field_and_the_type(raw, message):
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict(raw)
    assert str(info.value) == message


def test_the_string_false_is_not_elastic():
    """The dataclasses took any non-empty string as true: elastic resume turned on."""
    with pytest.raises(ConfigError, match=r"checkpoint\.elastic must be true or false"):
        CheckpointConfig(elastic="false")
    assert TrainConfig.from_dict({"checkpoint": {"elastic": False}}).checkpoint.elastic is False


def test_unknown_fields_are_refused_with_the_nearest_name():
    with pytest.raises(ConfigError, match=r"^unknown config key 'optim\.epochz' \(did you mean 'optim\.epochs'\?\)$"):
        TrainConfig.from_dict({"optim": {"epochz": 3}})
    with pytest.raises(ConfigError, match=r"^unknown config key 'optimiser' \(did you mean 'optim'\?\)$"):
        TrainConfig.from_dict({"optimiser": {}})
    with pytest.raises(ConfigError, match=r"^unknown config key 'cluster\.zzz'$"):
        TrainConfig.from_dict({"cluster": {"zzz": 1}})


def test_every_problem_is_one_line():
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({"data": {"val_fraction": 0.6}, "optim": {"batch_size": 0, "epochs": "3"},
                               "cluster": {"kvstore": "nccl"}})
    assert str(info.value).splitlines() == [
        "data.val_fraction must be in (0, 0.5), got 0.6",
        "optim.batch_size must be in [1, 65536], got 0",
        "optim.epochs must be an integer, got '3' (a string)",
        "cluster.kvstore must be one of ('local', 'device', 'dist_sync', 'dist_device_sync', 'dist_async'), "
        "got 'nccl'",
    ]


def test_json_arrays_and_numbers_are_accepted():
    cfg = TrainConfig.from_json(json.dumps({"data": {"input_shape": [1, 8, 8], "feature_range": [0, 1.5]},
                                            "model": {"name": "lenet", "hidden": [16]},
                                            "optim": {"learning_rate": 1, "lr_schedule": "step",
                                                      "lr_decay_epochs": [5]}}))
    assert cfg.data.input_shape == (1, 8, 8) and cfg.model.hidden == (16,) and cfg.optim.lr_decay_epochs == (5,)
    assert cfg.optim.learning_rate == 1 and cfg.data.feature_range == (0, 1.5)


def test_keys_that_are_not_strings_are_refused():
    with pytest.raises(ConfigError, match="config keys must be strings, got 1 in 'optim'"):
        TrainConfig.from_dict({"optim": {1: 2}})


def test_the_json_schema_is_strict():
    schema = TrainConfig.model_json_schema()
    assert schema["additionalProperties"] is False
    sections = {name: schema["$defs"][ref["$ref"].rsplit("/", 1)[1]] for name, ref in schema["properties"].items()
                if "$ref" in ref}
    assert set(sections) == {"data", "model", "optim", "cluster", "checkpoint"}
    assert all(s["additionalProperties"] is False for s in sections.values())
    optim, cluster = sections["optim"]["properties"], sections["cluster"]["properties"]
    epochs = {k: v for k, v in optim["epochs"].items() if k != "description"}  # the text is docs/configuration.md's
    assert epochs == {"default": 100, "maximum": 10000, "minimum": 1, "title": "Epochs", "type": "integer"}
    assert optim["learning_rate"]["type"] == "number" and optim["learning_rate"]["exclusiveMinimum"] == 0
    assert cluster["flush_denormals"]["type"] == "boolean"
    assert cluster["device"]["enum"] == ["cpu", "gpu"]
    assert sections["data"]["properties"]["prefetch_batches"]["maximum"] == 64
    assert sections["model"]["properties"]["hidden"]["items"] == {"exclusiveMinimum": 0, "type": "integer"}
