"""The training DAG's trigger form: ``Param``s with JSON-schema types, bounds, enums, descriptions.

Enums come from the authoritative tuples in ``common.config``, so a model, optimizer or cluster
backend added there appears in the form without touching this file; defaults come from the
``digits`` recipe and ``common.settings``. These modules are light (stdlib and pydantic), so a
DAG file importing this stays light at parse time. The form rejects a bad value when the run is
triggered; what only the config itself can judge (combinations, a warm-start run's checkpoints)
fails in the first task.
"""
from __future__ import annotations

from airflow.sdk import Param

from common.config import BACKENDS, KVSTORES, MODELS, OPTIMIZERS, TrainConfig, recipe
from common.settings import DEFAULT_MODEL_NAME, settings
from plugins.connections import AWS_CONN_PARAM, MLFLOW_CONN_PARAM
from training.tracking.warm_start import MODEL_URI_PATTERN

# s3:// URI (bucket 3–63 chars of [a-z0-9.-], then a key) or an absolute path; a table file, a
# glob of them, or a folder ending in "/".
DATASET_URI_PATTERN = r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/|/)[^\s]*(\.(csv|csv\.gz|parquet|pq)|/)$"
# Empty (train from scratch), an Airflow run id of this DAG, or a registered model version:
# models:/<name>/<version> or models:/<name>@<alias>.
WARM_START_PATTERN = r"^$|^[A-Za-z0-9_.:+~-]{1,250}$|" + MODEL_URI_PATTERN
# Empty, or an Airflow connection id (letters, digits, '_', '.', '-').
CONN_ID_PATTERN = r"^[A-Za-z0-9_.-]{0,250}$"
RECIPES = ("digits", "debug")
# Form-level caps: tighter than TrainConfig's hard limits, they keep a manual run on a sane scale.
MAX_WORKERS, MAX_SERVERS = 16, 8


def _defaults() -> TrainConfig:
    return recipe("digits", "")


def training_params() -> dict[str, Param]:
    """The form of the training DAG, built from the config's own tuples and the recipe."""
    base = _defaults()
    return {
        "dataset_uri": Param(settings().dataset_uri,
                             type="string", pattern=DATASET_URI_PATTERN,
                             description="Source: a CSV/Parquet file, a glob of them, or a folder ending in '/' "
                                         "(its table files, or images + labels.csv); s3://bucket/key or an "
                                         "absolute path."),
        "data_options": Param({}, type="object",
                              description="Further data.* settings as JSON, e.g. {\"id_column\": \"uid\", "
                                          "\"classes\": [0, 1], \"drift_action\": \"fail\"}."),
        "label_column": Param(base.data.label_column, type="string", minLength=1, maxLength=200,
                              description="Name of the label column."),
        "recipe": Param("digits", type="string", enum=list(RECIPES), description="Named starting configuration."),
        "model": Param(base.model.name, type="string", enum=list(MODELS), description="Network architecture."),
        "epochs": Param(base.optim.epochs, type="integer", minimum=1, maximum=1000, description="Training epochs."),
        "batch_size": Param(base.optim.batch_size, type="integer", minimum=1, maximum=4096,
                            description="Batch size per worker (global batch = this × workers)."),
        "learning_rate": Param(base.optim.learning_rate, type="number", exclusiveMinimum=0, maximum=10,
                               description="Learning rate, in (0, 10]."),
        "optimizer": Param(base.optim.optimizer, type="string", enum=list(OPTIMIZERS), description="Optimizer."),
        "num_workers": Param(base.cluster.num_workers, type="integer", minimum=1, maximum=MAX_WORKERS,
                             description="MXNet workers."),
        "num_servers": Param(base.cluster.num_servers, type="integer", minimum=1, maximum=MAX_SERVERS,
                             description="Parameter servers."),
        # 'local' is one process: a distributed DAG run always uses a dist_* mode.
        "kvstore": Param(base.cluster.kvstore, type="string", enum=[k for k in KVSTORES if k.startswith("dist_")],
                         description="Parameter-server mode."),
        "checkpoint_every_n_steps": Param(base.checkpoint.every_n_steps, type="integer", minimum=1,
                                          maximum=1_000_000,
                                          description="Checkpoint to S3 every N steps (and at each epoch end)."),
        "registered_model_name": Param(DEFAULT_MODEL_NAME, type="string", pattern=r"^[A-Za-z0-9_.-]{1,100}$",
                                       description="MLflow registered model to add a version to."),
        # Feeds cluster.backend of the config.
        "backend": Param(base.cluster.backend, type="string", enum=list(BACKENDS),
                         description="Where the roles run: local processes, the hosts of the mxpipe_hosts "
                                     "Variable or MXPIPE_HOSTS_FILE (SSH), or EC2 instances (mxpipe_ec2 "
                                     "or MXPIPE_EC2_FILE)."),
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
        "warm_start": Param("", type="string", pattern=WARM_START_PATTERN,
                            description="Initialise the model from the newest valid checkpoint of another run "
                                        "of this DAG (its run id), or from a registered version "
                                        "(models:/<name>/<version> or models:/<name>@<alias>); empty = from "
                                        "scratch. A retry of this run still resumes its own checkpoints first."),
    }
