"""The training DAG's trigger form: ``Param``s with JSON-schema types, bounds, enums, descriptions.

The whole config can be given as a JSON object (``config``, validated at trigger time by the
JSON schema of ``common.config.TrainConfig``) or as a JSON/YAML file (``config_uri``, read by the
first task); the simple fields are shortcuts to single config fields (``SHORTCUTS``). Nothing
here restates the config: a shortcut's type, bounds and enum are its field's in that schema
(narrowed only where the form caps a manual run), its default is the ``digits`` recipe's, and
left at that default it sets nothing, so the chosen recipe's value stands. These modules are
light (stdlib and pydantic), so a DAG file importing this stays light at parse time.
The form rejects a wrong type, an unknown key or an out-of-range value when the run is
triggered; what only the config itself can judge (combinations, a warm-start run's checkpoints)
fails in the first task. How the layers combine: ``plugins.run_config``.
"""
from __future__ import annotations

import functools
from typing import Any

from airflow.sdk import Param

from common.config import KVSTORES, MODELS, TrainConfig, recipe
from common.settings import DEFAULT_MODEL_NAME, settings
from plugins.connections import AWS_CONN_PARAM, MLFLOW_CONN_PARAM
from training.tracking.warm_start import MODEL_URI_PATTERN

# An s3:// bucket (3–63 chars of [a-z0-9.-]) and the start of its key, or an absolute path.
LOCATION_PATTERN = r"(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/|/)"
# Sources are read through fsspec (data_checks/filesystems.py): besides S3 and absolute paths,
# file:///, gs://, az:// (abfs) and http(s):// URLs.
SOURCE_LOCATION_PATTERN = (r"(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/|(gs|gcs|az|abfs|abfss|http|https)://[^\s/]+/"
                           r"|file:///|/)")
# A table file, a glob of them, or a folder ending in "/".
DATASET_URI_PATTERN = rf"^{SOURCE_LOCATION_PATTERN}[^\s]*(\.(csv|csv\.gz|parquet|pq)|/)$"
# Empty (none), or a JSON or YAML file.
CONFIG_URI_PATTERN = rf"^$|^{LOCATION_PATTERN}[^\s]*\.(json|yaml|yml)$"
# Empty (train from scratch), an Airflow run id of this DAG, or a registered model version:
# models:/<name>/<version> or models:/<name>@<alias>.
WARM_START_PATTERN = r"^$|^[A-Za-z0-9_.:+~-]{1,250}$|" + MODEL_URI_PATTERN
# Empty, or an Airflow connection id (letters, digits, '_', '.', '-').
CONN_ID_PATTERN = r"^[A-Za-z0-9_.-]{0,250}$"
RECIPES = ("digits", "debug")
# Form-level caps: tighter than TrainConfig's hard limits, they keep a manual run on a sane scale
# (the config Params reach the full range).
MAX_WORKERS, MAX_SERVERS = 16, 8

# Form field → the config field it sets (section, name). Changed from its default, a shortcut wins
# over the recipe, config_uri and config; left at its default it sets nothing (the form always
# sends every field, so "left at its default" is the only way to tell "not set", and the default
# shown is the digits recipe's, which is not the chosen recipe's when that is another one).
SHORTCUTS: dict[str, tuple[str, str]] = {
    "dataset_uri": ("data", "source_uri"),
    "label_column": ("data", "label_column"),
    "model": ("model", "name"),
    "dropout": ("model", "dropout"),
    "epochs": ("optim", "epochs"),
    "batch_size": ("optim", "batch_size"),
    "learning_rate": ("optim", "learning_rate"),
    "optimizer": ("optim", "optimizer"),
    "lr_schedule": ("optim", "lr_schedule"),
    "weight_decay": ("optim", "weight_decay"),
    "num_workers": ("cluster", "num_workers"),
    "num_servers": ("cluster", "num_servers"),
    "kvstore": ("cluster", "kvstore"),
    "backend": ("cluster", "backend"),
    "device": ("cluster", "device"),
    "devices_per_worker": ("cluster", "devices_per_worker"),
    "job_timeout_s": ("cluster", "job_timeout_s"),
    "checkpoint_every_n_steps": ("checkpoint", "every_n_steps"),
}
SHORTCUT_NOTE = ("Changed from its default, wins over recipe, config_uri and config; left at its default, "
                 "sets nothing (the chosen recipe's value stands).")


@functools.cache
def config_schema() -> dict[str, Any]:
    """The JSON schema of a config object: every field optional (all have defaults), no unknown
    key, integers, numbers and booleans apart (``TrainConfig.model_json_schema()``)."""
    return _as_param_schema(TrainConfig.model_json_schema())


def section_schema(section: str) -> dict[str, Any]:
    """The JSON schema of one section of a config object."""
    schema = config_schema()
    return _as_param_schema(schema["$defs"][schema["properties"][section]["$ref"].rsplit("/", 1)[1]])


def sweep_schema() -> dict[str, Any]:
    """The JSON schema of the ``sweep`` Param: the config's sweep section, every field optional
    (an empty object: the sweep of config / config_uri as it is)."""
    schema = _as_param_schema(TrainConfig.model_json_schema()["$defs"]["SweepConfig"])
    schema.pop("required", None)
    return schema


def sweep_params() -> dict[str, Param]:
    """The form of the sweep DAG: the training DAG's, plus the sweep section."""
    return {**training_params(),
            "sweep": Param({}, schema=sweep_schema(),
                           description="The sweep (docs/sweeps.md), e.g. {\"method\": \"grid\", \"space\": "
                                       "{\"optim.learning_rate\": [0.01, 0.001]}, \"min_epochs\": 1}; over config's "
                                       "sweep section. Every trial's config is checked before anything is "
                                       "sharded.")}


def _as_param_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A generated schema without the keys a Param's schema must not have at its top: the form
    would show "title" as the field's label, and Airflow's serialized DAG passes the schema as
    keyword arguments beside a Param's own description (a model's docstring is one)."""
    return {k: v for k, v in schema.items() if k not in ("title", "description", "default", "source")}


def _shortcut(base: TrainConfig, name: str, description: str, **narrower: Any) -> Param:
    """The Param of a shortcut field: its config field's schema (narrowed by ``narrower``) and
    its value in ``base`` as the default."""
    section, field = SHORTCUTS[name]
    schema = _as_param_schema(section_schema(section)["properties"][field])
    return Param(getattr(getattr(base, section), field), description=f"{description} {SHORTCUT_NOTE}",
                 **{**schema, **narrower})


def form_base(name: str) -> TrainConfig:
    """The config the form starts from: the recipe ``name`` with the configured dataset."""
    return recipe(name, settings().dataset_uri)


def training_params() -> dict[str, Param]:
    """The form of the training DAG, built from the config's schema; the defaults are the
    ``digits`` recipe's, with the configured dataset (``form_base("digits")``)."""
    base = form_base("digits")
    return {
        "dataset_uri": _shortcut(base, "dataset_uri", pattern=DATASET_URI_PATTERN,
                                 description="Source (data.source_uri): a CSV/Parquet file, a glob of them, or a "
                                             "folder ending in '/' (its table files, or images + labels.csv); "
                                             "s3://bucket/key, an absolute path, file:///…, "
                                             "gs://, az:// or an http(s):// URL of one file."),
        "recipe": Param("digits", type="string", enum=list(RECIPES),
                        description="Named starting configuration: every field not set below comes from it. The "
                                    "fields below show digits' values; left at them they set nothing, so "
                                    "with 'debug' its own values stand (to ask for the value shown, set "
                                    "it in config)."),
        "config_uri": Param("", type="string", pattern=CONFIG_URI_PATTERN,
                            description="A config file (.json, .yaml or .yml; s3://bucket/key or an absolute "
                                        "path): an object of config sections, any field of any section, e.g. "
                                        "{\"optim\": {\"lr_schedule\": \"cosine\"}}. Read by the first task, "
                                        "strictly typed; over the recipe, under config and the form fields "
                                        "changed from their defaults."),
        "config": Param({}, schema=config_schema(),
                        description="Config fields as a JSON object of sections, any field of any section, "
                                    "e.g. {\"optim\": {\"warmup_steps\": 100}, \"checkpoint\": {\"keep\": 5}}. "
                                    "Checked when the run is triggered: no unknown key, integers, numbers and "
                                    "booleans as such. Over the recipe and config_uri, under the form fields "
                                    "changed from their defaults."),
        "data_options": Param({}, schema=section_schema("data"),
                              description="Further data.* fields as a JSON object, e.g. {\"id_column\": \"uid\", "
                                          "\"classes\": [0, 1], \"drift_action\": \"fail\"}; over config's "
                                          "data section."),
        "label_column": _shortcut(base, "label_column", maxLength=200,
                                  description="Name of the label column (data.label_column)."),
        # The zoo only: a custom network ("package.module:factory") comes with its code, through
        # config / config_uri (model.name, model.code_uri, model.options).
        "model": _shortcut(base, "model", enum=list(MODELS),
                           description="Network architecture of the zoo (model.name); for a network of your "
                                       "own set model.name, model.code_uri and model.options in config."),
        "dropout": _shortcut(base, "dropout", description="Dropout rate (model.dropout), in [0, 1)."),
        "epochs": _shortcut(base, "epochs", maximum=1000, description="Training epochs (optim.epochs)."),
        "batch_size": _shortcut(base, "batch_size", maximum=4096,
                                description="Batch size per worker (optim.batch_size; global batch = this × "
                                            "workers)."),
        "learning_rate": _shortcut(base, "learning_rate",
                                   description="Learning rate (optim.learning_rate), in (0, 10]."),
        "optimizer": _shortcut(base, "optimizer", description="Optimizer (optim.optimizer)."),
        "lr_schedule": _shortcut(base, "lr_schedule",
                                 description="Learning-rate schedule (optim.lr_schedule); 'step' needs "
                                             "optim.lr_decay_epochs, given in config."),
        "weight_decay": _shortcut(base, "weight_decay", description="Weight decay (optim.weight_decay)."),
        "num_workers": _shortcut(base, "num_workers", maximum=MAX_WORKERS,
                                 description="MXNet workers (cluster.num_workers)."),
        "num_servers": _shortcut(base, "num_servers", maximum=MAX_SERVERS,
                                 description="Parameter servers (cluster.num_servers)."),
        # 'local' is one process: a distributed DAG run always uses a dist_* mode.
        "kvstore": _shortcut(base, "kvstore", enum=[k for k in KVSTORES if k.startswith("dist_")],
                             description="Parameter-server mode (cluster.kvstore)."),
        "backend": _shortcut(base, "backend",
                             description="Where the roles run (cluster.backend): local processes, the hosts of "
                                         "the mxpipe_hosts Variable or MXPIPE_HOSTS_FILE (SSH), or EC2 "
                                         "instances (mxpipe_ec2 or MXPIPE_EC2_FILE)."),
        "device": _shortcut(base, "device", description="Device type of each worker's contexts (cluster.device)."),
        "devices_per_worker": _shortcut(base, "devices_per_worker",
                                        description="Contexts per worker (cluster.devices_per_worker); the batch "
                                                    "is split evenly over them."),
        "job_timeout_s": _shortcut(base, "job_timeout_s",
                                   description="The training job's time limit in seconds, 0 for none (cluster.job_timeout_s); "
                                               "stall detection guards a hung job either way."),
        # An integer here; "auto" (Young/Daly) is set through config or config_uri.
        "checkpoint_every_n_steps": _shortcut(base, "checkpoint_every_n_steps", type="integer", minimum=1,
                                              maximum=1_000_000,
                                              description="Checkpoint to S3 every N steps, and at each epoch end "
                                                          "(checkpoint.every_n_steps; \"auto\" through config)."),
        **_run_params(),
    }


def _run_params() -> dict[str, Param]:
    """The form fields that are not config fields: the model name, the EC2 type, the
    connections, the warm start and ``force`` (read by the task that uses them)."""
    return {
        "registered_model_name": Param(DEFAULT_MODEL_NAME, type="string", pattern=r"^[A-Za-z0-9_.-]{1,100}$",
                                       description="MLflow registered model to add a version to."),
        "instance_type": Param("", type="string", pattern=r"^$|^[a-z][a-z0-9-]*\.[a-z0-9]+$",
                               description="EC2 instance type (e.g. c5.xlarge) for the ec2 backend; empty = the "
                                           "launch template's."),
        # Empty: the default connection where it exists, else the environment (plugins.connections).
        AWS_CONN_PARAM: Param("", type="string", pattern=CONN_ID_PATTERN,
                              description="Airflow AWS connection for S3 (credentials, endpoint, region); empty = "
                                          "aws_default where it exists, else the workers' AWS environment."),
        MLFLOW_CONN_PARAM: Param("", type="string", pattern=CONN_ID_PATTERN,
                                 description="Airflow connection of the MLflow tracking server (URI, token or "
                                             "login/password); empty = mlflow_default where it exists, else "
                                             "MLFLOW_TRACKING_URI."),
        # Not a config field: the shards' bytes are the same for any number of parts.
        "shard_parts": Param(0, type="integer", minimum=0, maximum=64,
                             description="Parts the source is sharded in (mapped tasks: files of a multi-file "
                                         "source, byte ranges of one CSV file); the shards are the same for any "
                                         "number. 0 = MXPIPE_SHARD_PARTS, else one per 256 MB (at most 8)."),
        "warm_start": Param("", type="string", pattern=WARM_START_PATTERN,
                            description="Initialise the model from the newest valid checkpoint of another run "
                                        "of this DAG (its run id), or from a registered version "
                                        "(models:/<name>/<version> or models:/<name>@<alias>); empty = from "
                                        "scratch. A retry of this run still resumes its own checkpoints first."),
        # Off: a run whose inputs match an earlier successful run's reuses its version
        # (plugins.pipeline_tasks.check_reuse); on: it trains and registers a new one anyway.
        "force": Param(False, type="boolean",
                       description="Train even when an earlier successful run had the same inputs (data manifest, "
                                   "the config fields that decide the model, the custom network's code, the warm "
                                   "start). Off: such a run provisions and trains nothing and reuses that run's "
                                   "registered version."),
    }


def form_defaults() -> dict[str, Any]:
    """Every field's default, as the form declares it."""
    return {name: param.value for name, param in training_params().items()}
