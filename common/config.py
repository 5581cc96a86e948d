"""One typed config that flows end to end: DAG params → shard → train → register.

``TrainConfig`` is a tree of frozen pydantic models in strict mode: a value of the wrong type
(``"3"`` or ``3.7`` for an integer, ``"false"`` or ``0`` for a boolean) is refused, never
converted, and an unknown key is refused by name. Every problem raises ``ConfigError`` when the
config is built, one line per problem naming the field and what it must be (``optim.epochs must
be an integer, got '3' (a string)``), never minutes later on a cluster. Bounds and choices are
declared on the fields, so ``TrainConfig.model_json_schema()`` carries them too (the DAG form
validates with it); combinations are checked by each model's ``model_validator``. Recipes are
plain functions returning a config.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, JsonValue, ValidationError,
                      ValidatorFunctionWrapHandler, WrapValidator, model_validator)

from common.errors import DeterministicError
from common.task_metrics import TASK_METRICS
from pydantic.fields import FieldInfo

MODELS = ("mlp", "lenet", "resnet18", "resnet50")
# Or a network of the user's own: ``package.module:factory`` (training.loop.custom_model).
IMPORT_PATH_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
MODEL_NAME_PATTERN = rf"^({'|'.join(MODELS)}|{IMPORT_PATH_PATTERN})$"
# Where a custom network's code is: an absolute local path or an s3:// URI, of a folder (put on
# sys.path as it is) or of one .py file (a top-level module).
CODE_URI_PATTERN = r"^(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]/[^\s]+|/[^\s]*)$"
# Models that see the features as an image: they need data.input_shape = (C, H, W).
IMAGE_MODELS = ("lenet", "resnet18", "resnet50")
# MXNet 1.9 optimizer registry names (mx.optimizer.Optimizer.opt_registry).
OPTIMIZERS = ("sgd", "nag", "adam", "adagrad", "adadelta", "rmsprop", "lamb")
# "constant", or one of mx.lr_scheduler's MultiFactor ("step"), Cosine, Poly; each with linear warmup.
LR_SCHEDULES = ("constant", "step", "cosine", "poly")
# "linear": learning_rate x global_batch / base_batch (Goyal et al.); "none": as written.
LR_SCALINGS = ("none", "linear")
# Every mode here has a reference test (tests/integration/test_kvstore_reference.py), with
# several CPU contexts per worker for the device variants and local/device.
KVSTORES = ("local", "device", "dist_sync", "dist_device_sync", "dist_async")
# Gradient compression on the kvstore's pushes (MXNet's 2-bit quantisation with error feedback).
GRADIENT_COMPRESSIONS = ("none", "2bit")
# Kvstores whose compressed pushes have a reference test; MXNet itself refuses "local"
# ("Gradient compression is not supported for this type of kvstore").
COMPRESSION_KVSTORES = ("dist_sync",)
DEVICE_TYPES = ("cpu", "gpu")
PRECISIONS = ("fp32", "fp16")
# "replicated": every context of a worker holds the whole model and a slice of the batch;
# "split": the model's blocks are split over the contexts (model parallelism, training.loop.placement).
PLACEMENTS = ("replicated", "split")
# Where the optimizer runs: on the parameter servers (gluon update_on_kvstore=True) or on every
# worker after the gradients are summed through the servers (update_on_kvstore=False).
OPTIMIZER_PLACEMENTS = ("servers", "workers")
# Where a job's roles run (infra.cluster's registry holds one class per name and checks at import
# that its names are exactly these): local processes, a static host list over SSH, EC2 instances.
BACKENDS = ("local", "hosts", "ec2")
DRIFT_ACTIONS = ("off", "warn", "fail")
# What the network predicts: class indices (softmax cross-entropy, accuracy) or float targets.
TASKS = ("classification", "regression")
# The loss of each task; "auto" is the task's first ("softmax_cross_entropy" or "l2").
TASK_LOSSES = {"classification": ("softmax_cross_entropy",), "regression": ("l2", "l1", "huber")}
LOSSES = ("auto", *(loss for losses in TASK_LOSSES.values() for loss in losses))
# Fields added after checkpoints embedded the config's digest: left out of ``digest_dict`` while
# they hold their default, so a config that does not use them keeps its digest (and its
# checkpoints still resume).
_DIGEST_OMITTED_AT_DEFAULT = {"data": ("target_columns", "target_range", "standardize", "missing_values",
                                       "rare_label_action", "rare_label_rows", "rare_label_ratio", "evaluation_rows"),
                              "model": ("task", "loss", "huber_rho", "options", "code_uri"),
                              "optim": ("early_stopping_patience", "early_stopping_metric", "early_stopping_min_delta"),
                              "checkpoint": ("export_epoch", "mtbf_s"),
                              "cluster": ("max_restarts_without_progress", "on_spot_interruption")}
# Of those, the fields whose default changed since: omitted at their former default (what the
# checkpoints written before embed), so the digest follows the value, not the default.
_DIGEST_OMITTED_AT = {("optim", "early_stopping_patience"): 0}
# What a missing table value does: fail validation (as non-finite), or take the train split's
# median (numeric) / most frequent value (categorical) at shard time and in the served model.
MISSING_VALUES = ("fail", "impute")
# What a label value that looks accidental (no data.classes declared) does in validation.
RARE_LABEL_ACTIONS = ("warn", "fail", "off")
# S3 server-side encryption of checkpoint objects: none, S3-managed keys, KMS.
SSE_MODES = ("", "AES256", "aws:kms")
# Which epoch's parameters a job exports (and registers): "best" = the best validation epoch's,
# "last" = the last trained epoch's, "auto" = "best" exactly when early stopping is on.
EXPORT_EPOCHS = ("auto", "best", "last")
# The defaults a table trains with (optim.epochs, optim.early_stopping_patience): an epoch budget
# that early stopping ends when the validation metric has not improved for DEFAULT_PATIENCE
# epochs (benchmarks/table_defaults.py measures them against scikit-learn's MLP).
DEFAULT_EPOCHS, DEFAULT_PATIENCE = 100, 10


class ConfigError(DeterministicError, ValueError):
    """An invalid configuration value; deterministic, so never worth a retry."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _keep_int(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    checked = handler(value)
    return value if type(value) is int else checked


# A JSON number. An integer stays an integer (30, not 30.0): to_dict() and therefore digest()
# of a config written with whole numbers (every_n_seconds: 30, feature_range: [0, 16]) are
# what they were before the models were strict, so its checkpoints still resume.
Number = Annotated[float, WrapValidator(_keep_int)]
# A JSON array, held as a tuple. Only the container is lax (a list is accepted); every item is
# checked strictly.
Positive = Annotated[int, Field(gt=0)]
PositiveInts = Annotated[tuple[Positive, ...], Field(strict=False)]
Ints = Annotated[tuple[int, ...], Field(strict=False)]
Strings = Annotated[tuple[str, ...], Field(strict=False)]
Numbers = Annotated[tuple[Number, ...], Field(strict=False)]
Labels = Annotated[tuple[int | str, ...], Field(strict=False)]


class StrictModel(BaseModel):
    """The base of every config section and of the deployment settings (infra.strict_settings): strict, closed and frozen; a construction that fails raises ``ConfigError``."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    def __init__(self, **values: Any) -> None:
        # pydantic routes validation through a custom __init__, nested sections too: a section's
        # ConfigError reaches TrainConfig as a value error carrying its own message.
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(_message(type(self), exc)) from None


class DataConfig(StrictModel):
    """Where the source table is and how it is split and sharded."""

    # A file (CSV, CSV.gz, Parquet), a glob of them (``s3://b/data/part-*.parquet``), or a folder
    # ending in "/": its table files, or an image folder when it holds ``labels.csv``.
    source_uri: str = Field("",
                            description="The source: a table file (CSV, CSV.gz, Parquet), a glob of them, or a "
                                        "folder ending in `/` (its table files, or an image folder with a "
                                        "`labels.csv`); a local path or a URI fsspec reads.")
    label_column: str = Field("label", min_length=1,
                              description="The column that holds the label (the default target of a regression).")
    # Train shards; 0 means num_workers * shards_per_worker. Worker r of W reads shards i with
    # i % W == r, so any shard count gives every record to exactly one worker per epoch (also
    # after a resume with another W); a multiple of W keeps the workers' shares equal.
    num_shards: int = Field(0, ge=0,
                            description="Train shards to write; 0 = `cluster.num_workers` × "
                                        "`data.shards_per_worker`. Worker r of W reads the shards i with i % W == "
                                        "r.")
    shards_per_worker: int = Field(1, ge=1, description="Train shards per worker when `data.num_shards` is 0.")
    val_fraction: Number = Field(0.1, gt=0, lt=0.5,
                                 description="Share of the rows held out for validation (seeded; stratified by "
                                             "label for classification).")
    test_fraction: Number = Field(0.2, gt=0, lt=0.5,
                                  description="Share of the rows held out for the test split that `register` and "
                                              "the review score.")
    # Shape of one example for convolutional models, e.g. (1, 8, 8); empty = flat features.
    # Image sources record their (C, H, W) here when it is left empty.
    input_shape: PositiveInts = Field((),
                                      description="Shape of one example for the image models, e.g. [1, 8, 8]; empty "
                                                  "= flat features. An image source records its (C, H, W) here when "
                                                  "left empty.")
    # A shard may hold at most this many times the mean number of train records.
    max_shard_imbalance: Number = Field(1.5, ge=1.0,
                                        description="Largest number of train records a shard may hold, as a "
                                                    "multiple of the mean (validation).")
    # Largest total variation distance between a train shard's label distribution and the
    # whole train split's (checked on shards with at least 10 rows per class).
    max_label_skew: Number = Field(0.25, gt=0, le=1,
                                   description="Largest total variation distance between a train shard's label "
                                               "distribution and the whole train split's (validation; shards with "
                                               "at least 10 rows per class).")
    # Optional id column: not a feature; its values must be unique (checked by validation).
    id_column: str = Field("",
                           description="Optional id column: not a feature, and its values must be unique "
                                       "(validation).")
    # Optional declared label set, in class-index order; a label outside it fails validation.
    classes: Labels = Field((),
                            description="Optional declared label set, in class-index order; a label outside it "
                                        "fails validation.")
    # Optional declared feature columns (in this order); empty = every other column.
    feature_columns: Strings = Field((),
                                     description="Optional feature columns, in this order; empty = every column but "
                                                 "the label and id.")
    # Optional (min, max) every feature must lie in; image pixels are always checked in [0, 1].
    feature_range: Numbers = Field((),
                                   description="Optional [min, max] every feature must lie in (validation); image "
                                               "pixels are always checked in [0, 1].")
    # The evaluator (mlflow.models.evaluate) takes one in-memory frame: a seeded sample of at most
    # this many test rows keeps register's and a review's memory bounded; the project's own test
    # metrics cover the whole split (training.tracking.evaluation). The module's default, kept equal.
    evaluation_rows: int = Field(100_000, ge=0,
                                 description="Test rows `register` scores with `mlflow.models.evaluate` (its "
                                             "per-class table, confusion matrix): a seeded sample when the split "
                                             "is larger, so memory stays bounded; 0 = the whole split. "
                                             "`test_accuracy` (a regressor's `test_rmse`, `test_mae`, `test_r2`) "
                                             "covers the whole split either way, in chunks.")
    # Rows per chunk while sharding: memory follows this, not the dataset (output is the same).
    chunk_rows: int = Field(50_000, ge=1, le=10_000_000,
                            description="Rows read per chunk while sharding: the sharder's memory follows this, not "
                                        "the dataset's size; the output does not depend on it.")
    # Label distribution drift against the last validated manifest of the same dataset:
    # total variation distance above drift_threshold is reported ("warn") or fails ("fail").
    drift_action: Literal[DRIFT_ACTIONS] = Field("warn",
                                                 description="What label drift against the dataset's last validated "
                                                             "manifest does: nothing, a warning, or a failed "
                                                             "validation.")
    drift_threshold: Number = Field(0.1, gt=0, le=1,
                                    description="Total variation distance of the label distribution above which "
                                                "drift is reported.")
    # Train batches a background thread prepares ahead of the step (training.feed.prefetch); bounds the
    # memory of prepared batches. 0 = none: each batch is built inline when the step needs it.
    # (The bounds are checked below, in the message that says what 0 means.)
    prefetch_batches: int = Field(2, json_schema_extra={"minimum": 0, "maximum": 64},
                                  description="Train batches a background thread prepares ahead of the step; 0 = "
                                              "built inline when the step needs them.")
    # Regression (model.task='regression') only: the float target columns, in output order;
    # empty = the one column data.label_column. Optional (min, max) every target must lie in
    # (checked by validation, like feature_range).
    target_columns: Strings = Field((),
                                    description="Regression only: the float target columns, in output order; empty "
                                                "= `data.label_column`.")
    target_range: Numbers = Field((),
                                  description="Regression only: optional [min, max] every target must lie in "
                                              "(validation).")
    # Table preprocessing, fitted on the train split at shard time, recorded in the manifest and
    # baked into the registered model (data_checks.preprocess): numeric features standardised
    # with the train mean and std; string columns are categorical (train vocabulary + an unknown
    # bucket, one-hot); missing values per ``missing_values``.
    standardize: bool = Field(True,
                              description="Standardise numeric features with the train split's mean and std (fitted "
                                          "at shard time, part of the registered model).")
    missing_values: Literal[MISSING_VALUES] = Field("fail",
                                                    description="What a missing table value does: fail validation, "
                                                                "or take the train split's median (numeric) or most "
                                                                "frequent value (text).")
    # Without data.classes, a class with at most rare_label_rows rows, or fewer than
    # rare_label_ratio x the median class's rows, looks accidental (a typo, a stray value).
    rare_label_action: Literal[RARE_LABEL_ACTIONS] = Field("warn",
                                                           description="Without `data.classes`: what a label that "
                                                                       "looks accidental (see `rare_label_rows`, "
                                                                       "`rare_label_ratio`) does in validation.")
    rare_label_rows: int = Field(5, ge=0, description="A class with at most this many rows looks accidental.")
    rare_label_ratio: Number = Field(0.01, ge=0, lt=1,
                                     description="A class with fewer rows than this times the median class's looks "
                                                 "accidental.")

    @model_validator(mode="after")
    def _combinations(self) -> DataConfig:
        _check(self.val_fraction + self.test_fraction < 0.8, "data.val_fraction + data.test_fraction must be < 0.8")
        _check(self.id_column != self.label_column, "data.id_column must differ from data.label_column")
        _check(len(set(map(str, self.classes))) == len(self.classes), f"data.classes has duplicates: {self.classes}")
        _check(not self.classes or len(self.classes) >= 2, "data.classes must declare at least 2 classes")
        overlap = {self.label_column, self.id_column} & set(self.feature_columns)
        _check(not overlap, f"data.feature_columns must not include the label or id column: {sorted(overlap)}")
        _check(len(set(self.feature_columns)) == len(self.feature_columns), "data.feature_columns has duplicates")
        _check(len(self.feature_range) in (0, 2) and (not self.feature_range or
                                                      self.feature_range[0] < self.feature_range[1]),
               f"data.feature_range must be empty or (min, max) with min < max, got {self.feature_range}")
        overlap = {self.id_column} & set(self.target_columns) | set(self.feature_columns) & set(self.target_columns)
        _check(not overlap, f"data.target_columns must not include the id or a feature column: {sorted(overlap)}")
        _check(len(set(self.target_columns)) == len(self.target_columns), "data.target_columns has duplicates")
        _check(len(self.target_range) in (0, 2) and (not self.target_range or
                                                     self.target_range[0] < self.target_range[1]),
               f"data.target_range must be empty or (min, max) with min < max, got {self.target_range}")
        _check(0 <= self.prefetch_batches <= 64,
               f"data.prefetch_batches must be an integer in [0, 64] (0 = no prefetch thread), "
               f"got {self.prefetch_batches!r}")
        return self


def is_custom_model(name: str) -> bool:
    """Whether ``model.name`` names a factory (``package.module:factory``) rather than the zoo."""
    return ":" in name


def _model_name(name: str) -> str:
    _check(re.fullmatch(MODEL_NAME_PATTERN, name) is not None,
           f"model.name must be one of {MODELS} or an import path 'package.module:factory', got {name!r}")
    return name


def _code_uri(uri: str) -> str:
    _check(uri == "" or re.fullmatch(CODE_URI_PATTERN, uri) is not None,
           f"model.code_uri must be an absolute path or an s3://bucket/key URI (a folder or a .py file), "
           f"got {uri!r}")
    return uri


class ModelConfig(StrictModel):
    """The network: a zoo model or a factory of your own, and the task it is trained for."""

    # A network of the zoo (MODELS) or an import path "package.module:factory": the factory is
    # called as factory(num_outputs=..., input_shape=..., options=...) and returns a HybridBlock
    # (training.loop.custom_model). The schema's pattern admits both.
    name: Annotated[str, AfterValidator(_model_name),
                    Field(json_schema_extra={"pattern": MODEL_NAME_PATTERN},
                          description="A network of the zoo (`mlp`, `lenet`, `resnet18`, `resnet50`) or a factory "
                                      "of your own, `package.module:factory`, returning a HybridBlock.")] = "mlp"
    # The factory's own settings, any JSON object; a zoo network takes none.
    options: Annotated[dict[str, JsonValue], Field(strict=False)] = Field(
        default_factory=dict,
        description="Keyword settings passed to a custom network's factory as `options`; a zoo network takes none.")
    # The custom network's code, packed and staged with the run (common.model_code); empty: the
    # module is importable on every role already (installed in the image).
    code_uri: Annotated[str, AfterValidator(_code_uri),
                        Field(json_schema_extra={"pattern": CODE_URI_PATTERN.replace("^(", "^$|^(")},
                              description="A custom network's code (a folder or one .py file; an absolute path or "
                                          "s3:// URI), staged with the run; empty = importable on every role "
                                          "already.")] = ""
    hidden: PositiveInts = Field((128, 64), description="Hidden layer widths of the `mlp`.")
    # A little dropout by default: with early stopping it lets a table's network train longer
    # before it overfits (benchmarks/table_defaults.py).
    dropout: Number = Field(0.1, ge=0, lt=1, description="Dropout rate.")
    # Model parallelism inside a worker: "split" puts contiguous stages of the model's blocks on
    # the worker's cluster.devices_per_worker contexts, one stage each (data parallelism across
    # workers stays: hybrid). See training/loop/placement.py for what MXNet 1.9 gluon allows.
    placement: Literal[PLACEMENTS] = Field("replicated",
                                           description="`replicated`: every context of a worker holds the whole "
                                                       "model; `split`: the model's blocks are split over the "
                                                       "worker's contexts (zoo networks only).")
    # "classification": labels are classes (softmax cross-entropy, accuracy); "regression": float
    # targets (data.target_columns), one output each (RMSE, MAE, R²). See training/loop/metrics.py.
    task: Literal[TASKS] = Field("classification",
                                 description="`classification` (labels are classes) or `regression` (float targets, "
                                             "one output each).")
    # The task's loss (TASK_LOSSES); "auto" = its first. huber_rho: where Huber turns from
    # quadratic to linear (gluon HuberLoss's rho).
    loss: Literal[LOSSES] = Field("auto",
                                  description="The task's loss; `auto` = `softmax_cross_entropy` for "
                                              "classification, `l2` for regression.")
    huber_rho: Number = Field(1.0, gt=0, description="Where the Huber loss turns from quadratic to linear.")

    @model_validator(mode="after")
    def _combinations(self) -> ModelConfig:
        allowed = TASK_LOSSES[self.task]
        _check(self.loss == "auto" or self.loss in allowed,
               f"model.loss={self.loss!r} does not fit model.task={self.task!r}: expected 'auto' or one of {allowed}")
        if not is_custom_model(self.name):
            _check(not self.options and not self.code_uri,
                   f"model.options and model.code_uri are for a custom network (model.name "
                   f"'package.module:factory'), not for model.name={self.name!r}")
        return self

    @property
    def loss_name(self) -> str:
        """``loss`` with "auto" resolved to the task's default."""
        return TASK_LOSSES[self.task][0] if self.loss == "auto" else self.loss


class OptimConfig(StrictModel):
    """The optimizer, the batch and epochs, the learning-rate schedule and early stopping."""

    optimizer: Literal[OPTIMIZERS] = Field("adam", description="MXNet optimizer.")
    learning_rate: Number = Field(0.002, gt=0, le=10,
                                  description="Peak learning rate (scaled by the global batch when "
                                              "`optim.lr_scaling` is `linear`).")
    momentum: Number = Field(0.9, ge=0, lt=1, description="Momentum of `sgd` and `nag`.")
    weight_decay: Number = Field(0.0, ge=0, description="Weight decay (L2).")
    # Per-worker batch of one forward/backward (a micro-batch when accumulate_steps > 1); one
    # optimizer step consumes batch_size * accumulate_steps samples per worker, so the global
    # batch is batch_size * accumulate_steps * num_workers (``TrainConfig.global_batch``).
    batch_size: int = Field(32, ge=1, le=65536,
                            description="Rows per worker in one forward/backward pass; global batch = this × "
                                        "`optim.accumulate_steps` × workers.")
    # An epoch budget: with early stopping on (the default patience), a job trains until the
    # validation metric stops improving, at most this many epochs.
    epochs: int = Field(DEFAULT_EPOCHS, ge=1, le=10000,
                        description="The epoch budget; early stopping (on by default) may end a job sooner.")
    # Gradient accumulation: k forward/backward passes add into the gradients (grad_req='add'),
    # then one kvstore push and one optimizer step.
    accumulate_steps: int = Field(1, ge=1, le=1024,
                                  description="Forward/backward passes whose gradients add up before one push and "
                                              "optimizer step.")
    # Learning rate over optimizer steps (not micro-batches). Warmup rises linearly from 0 to
    # the (scaled) learning rate over ``warmup_steps``. "step" multiplies by lr_decay_factor at
    # the start of each epoch in lr_decay_epochs; "cosine" and "poly" (power poly_power) decay
    # to final_lr at the last step. The position is a function of the global step, so a
    # resumed job continues the same curve (training.loop.optim).
    # Cosine by default: over the epoch budget, so a job that stops early stops at a lower rate.
    lr_schedule: Literal[LR_SCHEDULES] = Field("cosine",
                                               description="Learning rate over optimizer steps: constant, `step` (× "
                                                           "`lr_decay_factor` at each epoch of `lr_decay_epochs`), "
                                                           "`cosine` or `poly` (to `final_lr` at the last step).")
    warmup_steps: int = Field(0, ge=0,
                              description="Optimizer steps over which the learning rate rises linearly from 0.")
    lr_decay_epochs: Ints = Field((),
                                  description="Epochs at whose start the `step` schedule decays the rate (given "
                                              "exactly with `step`).")
    lr_decay_factor: Number = Field(0.1, gt=0, lt=1, description="Factor of each `step` decay.")
    final_lr: Number = Field(0.0, ge=0, description="Learning rate the `cosine` and `poly` schedules end at.")
    poly_power: Number = Field(2.0, gt=0, description="Power of the `poly` schedule.")
    lr_scaling: Literal[LR_SCALINGS] = Field("none",
                                             description="`linear`: learning rate × global batch ÷ "
                                                         "`optim.base_batch`; `none`: as written.")
    base_batch: int = Field(32, ge=1,
                            description="The global batch `optim.learning_rate` is written for, with `lr_scaling` "
                                        "`linear`.")
    # "fp16" runs forward/backward through mxnet.contrib.amp (dynamic loss scaling) and needs
    # GPU contexts; untested here, where there is no GPU.
    precision: Literal[PRECISIONS] = Field("fp32",
                                           description="`fp16` runs forward/backward through MXNet AMP and needs "
                                                       "GPU contexts.")
    # Early stopping (training.loop.early_stop): after every epoch, ``early_stopping_metric``
    # (a validation metric of the epoch record, e.g. val_accuracy or val_loss; its direction is
    # training.loop.metrics.higher_is_better) is compared with the best so far; a change of
    # more than ``early_stopping_min_delta`` in the good direction is a new best, and after
    # ``early_stopping_patience`` epochs without one the job stops (0 = off: every epoch runs).
    # On by default, and with it the best epoch is what is exported (checkpoint.export_epoch).
    early_stopping_patience: int = Field(DEFAULT_PATIENCE, ge=0,
                                         description="Stop after this many epochs without an improvement of the "
                                                     "watched metric; 0 = off.")
    # (The pattern is for the form's schema; the check below says what is wrong in words.)
    # "auto": val_loss (classification) or val_rmse (regression): ``TrainConfig.early_stopping_metric``.
    early_stopping_metric: str = Field("auto",
                                       json_schema_extra={"pattern": r"^(auto|val_[A-Za-z_][A-Za-z0-9_]*)$"},
                                       description="The validation metric early stopping watches (e.g. "
                                                   "`val_accuracy`, `val_loss`); `auto` = `val_loss`, or "
                                                   "`val_rmse` for regression.")
    early_stopping_min_delta: Number = Field(0.0, ge=0, description="An improvement must exceed this to count.")

    @model_validator(mode="after")
    def _combinations(self) -> OptimConfig:
        _check(self.early_stopping_metric == "auto" or (self.early_stopping_metric.startswith("val_")
                                                         and self.early_stopping_metric[4:].isidentifier()),
               f"optim.early_stopping_metric must be 'auto' or name a validation metric such as "
               f"'val_accuracy' or 'val_loss', got {self.early_stopping_metric!r}")
        decay = self.lr_decay_epochs
        _check((self.lr_schedule == "step") == bool(decay),
               "optim.lr_decay_epochs must be given exactly when optim.lr_schedule='step'")
        _check(all(0 < e < self.epochs for e in decay) and list(decay) == sorted(set(decay)),
               f"optim.lr_decay_epochs must be increasing epochs in [1, {self.epochs - 1}], got {decay}")
        _check(self.final_lr < self.learning_rate,
               f"optim.final_lr must be in [0, learning_rate), got {self.final_lr}")
        return self


def unsafe_combination(kvstore: str, optimizer_on: str) -> str | None:
    """Why a kvstore / optimizer placement pair is refused, or None if it is offered.

    Offered pairs are exactly those the reference tests show equal to single-process training
    (or, for dist_async, converging with every push applied).
    """
    if kvstore == "dist_async" and optimizer_on != "servers":
        return ("dist_async applies each worker's gradient on the servers as it arrives; there is "
                "no summed gradient for a worker-side optimizer (MXNet refuses it too). "
                "Use cluster.optimizer_on='servers', or dist_sync for worker-side optimizer state")
    return None


class ClusterConfig(StrictModel):
    """The distributed job: where its roles run, how many, the kvstore, and its time bounds."""

    # Where the roles run (BACKENDS); the machines of "hosts" and "ec2" are described outside the
    # config, in the settings files infra.cluster_settings reads.
    backend: Literal[BACKENDS] = Field("local",
                                       description="Where the roles run: local processes, a host list over SSH "
                                                   "(`hosts`), or EC2 instances; the machines are described outside "
                                                   "the config.")
    kvstore: Literal[KVSTORES] = Field("dist_sync",
                                       description="MXNet kvstore mode; `local` and `device` run a single worker.")
    num_workers: int = Field(2, ge=1, le=256, description="Worker processes.")
    num_servers: int = Field(1, ge=1, le=64, description="Parameter-server processes.")
    # Bounds of the distributed job (seconds). A worker that logs nothing for stall_timeout_s
    # is considered hung: ps-lite never recovers from a lost peer by itself. job_timeout_s 0 is
    # no limit (a multi-day run); stall detection still ends a hung job.
    start_timeout_s: Number = Field(120.0, gt=0,
                                    description="Seconds a worker may take to print its first line (importing MXNet, "
                                                "joining the job).")
    stall_timeout_s: Number = Field(120.0, gt=0,
                                    description="Seconds a worker may print nothing before the job ends as stalled.")
    job_timeout_s: Number = Field(0.0, ge=0, description="Seconds the whole job may run; 0 = no limit.")
    # A lost role (crash, kill, stall) costs a restart of every role in place, on the same
    # cluster, from the newest checkpoint (training.launch.restarts): seconds, where an Airflow
    # retry costs its start as well. The budget counts failures without progress, not failures:
    # a long run may lose any number of roles as long as checkpoints keep being committed
    # between them; a job that fails this many times in a row with no new checkpoint stops.
    # A spot machine's interruption notice (common.procs.spot, on the roles of an ec2 spot
    # cluster) comes about two minutes before it is reclaimed: the supervisor stops every role in
    # order at once (rank 0's emergency checkpoint first, so nothing is lost) and restarts them,
    # on a replacement machine or without the reclaimed one.
    on_spot_interruption: Literal["replace", "shrink"] = Field(
        "replace", description="After a spot interruption notice: `replace` the machine (when capacity is there; "
                               "otherwise as `shrink`) or `shrink`: go on without it, one worker fewer (needs "
                               "`checkpoint.elastic`; without it the attempt ends and the retry provisions the "
                               "whole cluster again).")
    max_restarts_without_progress: int = Field(3, ge=0, le=1000,
                                               description="In-place restarts of every role in a row that commit no "
                                                           "new checkpoint before the job gives up (not retried); "
                                                           "0 = none: a failed role ends the attempt and the Airflow "
                                                           "retry runs the job again.")
    # Threads per role process; on a small machine several roles share the cores.
    threads_per_role: int = Field(1, ge=1, description="Compute threads per role process.")
    # "workers" keeps the optimizer state on every worker (Trainer.save_states works: exact
    # resume); "servers" keeps it on the servers. Both match single-process training in the
    # reference tests (docs/kvstore-correctness.md). "auto" (kept as written, so that changing
    # only the kvstore of a config stays valid) means "servers" for dist_async, the only
    # placement it has, and "workers" otherwise; ``optimizer_placement`` resolves it.
    optimizer_on: Literal[("auto", *OPTIMIZER_PLACEMENTS)] = Field("auto",
                                                                   description="Where the optimizer runs: on the "
                                                                               "servers or on every worker; `auto` "
                                                                               "= `servers` for `dist_async`, else "
                                                                               "`workers`.")
    # Contexts per worker: the batch is split evenly over [cpu(0) .. cpu(n-1)] (or gpu(i)) and
    # their gradients are summed by the kvstore before the push.
    device: Literal[DEVICE_TYPES] = Field("cpu", description="Context type of the workers.")
    devices_per_worker: int = Field(1, ge=1, le=16,
                                    description="Contexts per worker; the batch is split evenly over them.")
    # 2-bit compression of every push (values become -t, 0, +t; the rest is carried to the next
    # push). Only where the reference test covers it (COMPRESSION_KVSTORES). t is compared with
    # each worker's unscaled gradient (the sum over its batch_size rows), so it must be chosen
    # for the job: 0.5 (MXNet's default, kept so existing runs keep their resume digest) does
    # not train the digits MLP at batch 32, 8-128 do (docs/kvstore-correctness.md).
    gradient_compression: Literal[GRADIENT_COMPRESSIONS] = Field("none",
                                                                 description="2-bit compression of every push "
                                                                             "(error feedback); `dist_sync` only.")
    compression_threshold: Number = Field(0.5, gt=0,
                                          description="Threshold of 2-bit compression, compared with each worker's "
                                                      "unscaled gradient: choose it for the job.")
    # Every role process flushes denormal floats to zero (x86 FTZ/DAZ, common.fpmode): Adam's
    # moments of dead units decay into the denormal range, where each operation on them is
    # many times slower (the LeNet benchmark's steps: 1.5x). Changes only values below 1.2e-38.
    flush_denormals: bool = Field(True,
                                  description="Every role flushes denormal floats to zero (x86 FTZ/DAZ); changes "
                                              "only values below 1.2e-38.")

    @model_validator(mode="after")
    def _combinations(self) -> ClusterConfig:
        _check(self.kvstore not in ("local", "device") or self.num_workers == 1,
               f"cluster.kvstore={self.kvstore!r} runs a single process: set cluster.num_workers=1")
        _check(self.kvstore != "dist_async" or self.devices_per_worker == 1,
               "cluster.kvstore='dist_async' is tested with one context per worker only: "
               "set cluster.devices_per_worker=1")
        _check(self.gradient_compression == "none" or self.kvstore in COMPRESSION_KVSTORES,
               f"cluster.gradient_compression='2bit' needs cluster.kvstore in {COMPRESSION_KVSTORES}, got "
               f"{self.kvstore!r}: MXNet compresses only the pushes of a distributed kvstore (it refuses "
               "'local'), and only dist_sync has a reference test here")
        reason = unsafe_combination(self.kvstore, self.optimizer_placement)
        _check(reason is None, f"cluster.kvstore={self.kvstore!r} with cluster.optimizer_on="
                               f"{self.optimizer_on!r} is refused: {reason}")
        return self

    @property
    def distributed(self) -> bool:
        return self.kvstore.startswith("dist_")

    @property
    def optimizer_placement(self) -> str:
        """``optimizer_on`` with "auto" resolved: "servers" or "workers"."""
        if self.optimizer_on != "auto":
            return self.optimizer_on
        return "servers" if self.kvstore == "dist_async" else "workers"


class CheckpointConfig(StrictModel):
    """When rank 0 checkpoints, what is kept, how it is protected (training/checkpoint/).

    None of these fields changes what is trained: a resume may change them (they are left out
    of the digest a checkpoint is matched against).
    """

    # Cadence: every N global steps and/or every T seconds (0 = off), and always at epoch end.
    # "auto": N from the measured cost of a checkpoint and ``mtbf_s`` (Young/Daly,
    # training.checkpoint.cadence).
    every_n_steps: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        50, description="Checkpoint every N global steps (and at every epoch end); `auto` = from the measured cost of a "
                        "checkpoint and `checkpoint.mtbf_s`.")
    every_n_seconds: Number = Field(0.0, ge=0, description="Also checkpoint every this many seconds; 0 = off.")
    # Mean time between failures of the whole job, in seconds (used by every_n_steps="auto").
    mtbf_s: Number = Field(86400.0, gt=0,
                           description="The job's mean time between failures, in seconds, for `every_n_steps` "
                                       "`auto`.")
    # Retention: the newest ``keep`` committed (at least 2: a torn newest one needs a fallback),
    # plus (if > 0) the oldest committed checkpoint of every window of ``keep_every_n_steps``
    # steps, forever.
    keep: int = Field(3, ge=2, description="Newest committed checkpoints kept.")
    keep_every_n_steps: int = Field(0, ge=0,
                                    description="Also keep, forever, the oldest committed checkpoint of every "
                                                "window of this many steps; 0 = off.")
    # Serialise and upload in a background thread (the loop blocks only for the host copy).
    # A periodic checkpoint due while the previous is still uploading is skipped (counted);
    # epoch-end, final and emergency checkpoints wait for it.
    async_upload: bool = Field(True,
                               description="Serialise and upload in a background thread; a periodic checkpoint due "
                                           "while one uploads is skipped.")
    # One checkpoint's upload is retried with exponential backoff for at most this long.
    upload_timeout_s: Number = Field(300.0, gt=0,
                                     description="Seconds one checkpoint's upload is retried (with backoff) before "
                                                 "it is given up.")
    # SIGTERM: rank 0 writes an emergency checkpoint within this many seconds, then exits 75.
    preempt_grace_s: Number = Field(30.0, gt=0,
                                    description="Seconds rank 0 has after SIGTERM to commit an emergency "
                                                "checkpoint.")
    # S3 server-side encryption of every checkpoint object (SSE_MODES).
    sse: Literal[SSE_MODES] = Field("", description="S3 server-side encryption of every checkpoint object.")
    sse_kms_key_id: str = Field("", description="KMS key id, with `checkpoint.sse` `aws:kms`.")
    # Client-side AES-256-GCM envelope encryption: the NAME of the environment variable that
    # holds the 32-byte key (hex or base64); "" = off. The key itself is never in the config.
    encryption_key_env: str = Field("",
                                    description="Client-side AES-256-GCM encryption: the NAME of the environment "
                                                "variable that holds the 32-byte key (hex or base64); empty = off.")
    # Allow resuming with another number of workers (data assignment recomputed; see worker).
    elastic: bool = Field(False,
                          description="Accept a checkpoint written with another number of workers (a continuation, "
                                      "not an exact replay).")
    # Per-step metrics (train loss, learning rate; logged to MLflow as ``*_step`` at the global
    # step): every N-th step, at most ``max_step_metrics`` records (over the cap the stride
    # doubles and every other record is dropped: training.loop.metrics.StepRecorder). Here, not in
    # ``optim``: they change nothing that is trained (left out of the resume digest), and the
    # records up to a checkpoint live in its train state.
    step_metrics_every_n: int = Field(1, ge=1, description="Record the train loss and learning rate every N-th step.")
    max_step_metrics: int = Field(2000, ge=2, le=100_000,
                                  description="Most per-step records kept; over it the stride doubles and every "
                                              "other record is dropped.")
    # Which parameters the job exports and register registers (EXPORT_EPOCHS): with "best" (or
    # "auto" and early stopping on) the best validation epoch's, from its epoch-end checkpoint,
    # which retention then never deletes while it is the best.
    export_epoch: Literal[EXPORT_EPOCHS] = Field("auto",
                                                 description="Which epoch's parameters are exported and registered: "
                                                             "`best` validation epoch, `last`, or `auto` (`best` "
                                                             "when early stopping is on).")

    @model_validator(mode="after")
    def _combinations(self) -> CheckpointConfig:
        _check(not self.sse_kms_key_id or self.sse == "aws:kms", "checkpoint.sse_kms_key_id needs sse='aws:kms'")
        env = self.encryption_key_env
        looks_like_key = len(env) >= 32 and all(c in "0123456789abcdefABCDEF" for c in env)
        _check(env == "" or (env.replace("_", "").isalnum() and not env[0].isdigit() and not looks_like_key),
               "checkpoint.encryption_key_env must be the NAME of an environment variable, not a key")
        return self


# Hyperparameter sweeps (the ``mxnet_sweep`` DAG, common.sweep): how the space is searched.
SWEEP_METHODS = ("grid", "random")
SWEEP_DIRECTIONS = ("auto", "min", "max")
# The most trials one sweep may plan: each is a distributed job on a cluster of its own.
MAX_SWEEP_TRIALS = 64


class SearchRange(StrictModel):
    """A random sweep's range of one numeric field: uniform in [low, high], or log-uniform
    (``log``). Both bounds integers and the field an integer: a whole number in [low, high]."""

    low: Number = Field(description="The smallest value drawn.")
    high: Number = Field(description="The largest value drawn.")
    log: bool = Field(False, description="Draw log-uniformly (both bounds > 0).")

    @model_validator(mode="after")
    def _combinations(self) -> SearchRange:
        _check(self.low < self.high, f"an empty range: low={self.low!r} must be below high={self.high!r}")
        _check(not self.log or self.low > 0, f"a log range needs low > 0, got low={self.low!r}")
        return self


class SweepConfig(StrictModel):
    """A hyperparameter sweep: the trials' config fields, how many run at once, the metric that
    ranks them and the asynchronous successive halving (ASHA) that stops poor ones early."""

    method: Literal[SWEEP_METHODS] = Field("grid",
                                           description="`grid`: every combination of the listed values; `random`: "
                                                       "`sweep.trials` draws.")
    # A dotted config field ("optim.learning_rate", "seed" is refused: it moves the split) to its
    # values (grid, or a random choice) or a range (random only). Checked by common.sweep.
    space: dict[str, JsonValue] = Field(
        description="Dotted config field (e.g. `optim.learning_rate`) → a list of values, or (random) "
                    "`{low, high, log}`; each trial's config is checked like any config.",
        # The shape in the JSON schema too, so the DAG form refuses a bad one when triggered.
        json_schema_extra={"minProperties": 1, "additionalProperties": {"anyOf": [
            {"type": "array", "minItems": 1},
            {"type": "object", "required": ["low", "high"], "additionalProperties": False,
             "properties": {"low": {"type": "number"}, "high": {"type": "number"}, "log": {"type": "boolean"}}}]}})
    trials: int = Field(4, ge=1, le=MAX_SWEEP_TRIALS, description="Trials of a random sweep (a grid has one per "
                                                                  "combination).")
    parallel: int = Field(2, ge=1, le=MAX_SWEEP_TRIALS,
                          description="Trials holding a cluster at once (provisioned, not yet released; the "
                                      "trials' gates admit them in plan order), at most the DAG's cap "
                                      "(`MXPIPE_SWEEP_PARALLEL`).")
    metric: str = Field("auto", pattern=r"^(auto|val_[a-z0-9]+)$",
                        description="The validation metric that ranks the trials (`auto`: the early-stopping "
                                    "metric).")
    direction: Literal[SWEEP_DIRECTIONS] = Field("auto", description="Whether a lower or higher metric is better "
                                                                     "(`auto`: the metric's own).")
    seed: int = Field(0, ge=0, lt=2**31, description="Seed of a random sweep's draws.")
    min_epochs: int = Field(0, ge=0, le=1000,
                            description="The first rung of the pruning (ASHA): at epochs min_epochs × "
                                        "reduction_factor^k a trial outside the top 1/reduction_factor of "
                                        "the trials at that rung stops; 0 = no pruning.")
    reduction_factor: int = Field(3, ge=2, le=16, description="ASHA's eta: the share 1/eta of a rung's trials "
                                                             "that go on.")

    @model_validator(mode="after")
    def _combinations(self) -> SweepConfig:
        _check(bool(self.space), "sweep.space must name at least one config field")
        for name in self.space:
            self.dimension(name)  # each one checked here, so a bad one is refused by name at once
        return self

    def dimension(self, name: str) -> tuple[Any, ...] | SearchRange:
        """The values of ``space[name]`` (a non-empty tuple), or its ``SearchRange``."""
        values = self.space[name]
        where = f"sweep.space[{name!r}]"
        if isinstance(values, list):
            _check(bool(values), f"{where}: an empty list of values")
            return tuple(values)
        _check(isinstance(values, dict), f"{where} must be a list of values or {{low, high, log}}, got "
                                         f"{_kind(values)}")
        _check(self.method == "random", f"{where}: a range {{low, high}} needs sweep.method='random' (a grid takes "
                                        "a list of values)")
        try:
            return SearchRange(**values)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None



class TrainConfig(StrictModel):
    """A run's whole configuration, section by section."""

    data: DataConfig = Field(default_factory=DataConfig,
                             description="The source and how it is split, sharded, validated and preprocessed.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The network and the task.")
    optim: OptimConfig = Field(default_factory=OptimConfig,
                               description="Optimizer, batch, epochs, schedule, early stopping.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig,
                                   description="The distributed job: backend, kvstore, roles, bounds.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="When rank 0 checkpoints, what is kept, how it is protected.")
    seed: int = Field(42, ge=0, lt=2**31,
                      description="Seed of the split, the data order, initialisation and every random draw.")
    # Read by the mxnet_sweep DAG only; a trial's own config has none. Never part of a digest.
    sweep: SweepConfig | None = Field(None, description="A hyperparameter sweep over this config (the "
                                                        "`mxnet_sweep` DAG; docs/sweeps.md); null: none.")

    @model_validator(mode="after")
    def _combinations(self) -> TrainConfig:
        _check(self.model.name not in IMAGE_MODELS or len(self.data.input_shape) == 3,
               f"model.name={self.model.name!r} needs data.input_shape=(channels, height, width)")
        devices, batch = self.cluster.devices_per_worker, self.optim.batch_size
        _check(batch % devices == 0 or self.model.placement == "split", f"optim.batch_size={batch} must be divisible by cluster.devices_per_worker="
                                     f"{devices}: every context gets an equal slice of each batch")
        _check(self.optim.precision != "fp16" or self.cluster.device == "gpu",
               "optim.precision='fp16' needs cluster.device='gpu': mxnet.contrib.amp runs float16 on GPU "
               "contexts only; on CPU use precision='fp32'")
        if self.model.placement == "split":
            _check(not is_custom_model(self.model.name),
                   "model.placement='split' needs a network of the zoo: a custom block's children are not "
                   "known to run one after another")
            _check(self.cluster.devices_per_worker >= 2,
                   "model.placement='split' needs cluster.devices_per_worker >= 2 (one stage per context)")
            _check(self.cluster.optimizer_placement == "workers",
                   "model.placement='split' needs the optimizer on the workers (cluster.optimizer_on='workers' "
                   "or 'auto' with a sync kvstore): every stage's Trainer would send its own optimizer to the servers")
            _check(self.optim.precision == "fp32", "model.placement='split' is fp32 only (AMP with split is untested)")
        if self.model.task == "regression":
            _check(not self.data.classes, "data.classes declares classes, but model.task='regression' has float "
                                          "targets: remove data.classes or set model.task='classification'")
        else:
            for name in ("target_columns", "target_range"):
                _check(not getattr(self.data, name), f"data.{name} is for model.task='regression', "
                                                     f"but model.task={self.model.task!r}")
        watched, reported = self.early_stopping_metric, TASK_METRICS[self.model.task]
        _check(watched[len("val_"):] in reported,
               f"optim.early_stopping_metric={watched!r} is not reported for model.task={self.model.task!r}; "
               f"choose one of {['auto', *(f'val_{m}' for m in reported)]}")
        workers = self.cluster.num_workers
        _check(self.num_train_shards >= workers,
               f"data.num_shards={self.num_train_shards} cannot be spread over cluster.num_workers={workers}: "
               "every worker needs at least one train shard")
        lr = self.effective_learning_rate(workers)
        _check(lr <= 10, f"the scaled learning rate {lr:g} (optim.lr_scaling='linear', global batch "
                         f"{self.global_batch(workers)}, base_batch {self.optim.base_batch}) must be <= 10")
        return self

    @property
    def target_columns(self) -> tuple[str, ...]:
        """The regression targets in output order (data.target_columns, else the label column)."""
        return self.data.target_columns or (self.data.label_column,)

    @property
    def num_train_shards(self) -> int:
        return self.data.num_shards or self.cluster.num_workers * self.data.shards_per_worker

    def global_batch(self, num_workers: int) -> int:
        """Samples per optimizer step over the whole job."""
        return self.optim.batch_size * self.optim.accumulate_steps * num_workers

    def effective_learning_rate(self, num_workers: int) -> float:
        """The peak learning rate the optimizer gets: scaled by global batch / base batch if asked."""
        o = self.optim
        if o.lr_scaling == "linear":
            return o.learning_rate * self.global_batch(num_workers) / o.base_batch
        return o.learning_rate

    def to_dict(self) -> dict[str, Any]:
        """Sections as dicts in field order, arrays as tuples (``digest_dict`` is what digests hash)."""
        return self.model_dump()

    @property
    def early_stopping_metric(self) -> str:
        """The validation metric early stopping watches (``optim.early_stopping_metric``, "auto"
        resolved by the task)."""
        name = self.optim.early_stopping_metric
        if name != "auto":
            return name
        # Classification watches the validation loss, not its accuracy: on a validation split of a
        # few hundred rows accuracy moves in steps of one row, and stopping and choosing the best
        # epoch on that noise stopped early at a noise peak (benchmarks/README.md, Q5: the defaults
        # reached 0.986 of a scaled scikit-learn MLP's accuracy on val_accuracy, 1.003 on val_loss).
        return "val_rmse" if self.model.task == "regression" else "val_loss"

    @property
    def exports_best(self) -> bool:
        """Whether the job exports the best validation epoch's parameters (``checkpoint.export_epoch``)."""
        choice = self.checkpoint.export_epoch
        return choice == "best" or (choice == "auto" and self.optim.early_stopping_patience > 0)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    def digest_dict(self) -> dict[str, Any]:
        """``to_dict`` without the fields added later that hold their default (what digests hash)."""
        raw = self.to_dict()
        raw.pop("sweep")  # how trials are searched decides no trial's model
        for section, names in _DIGEST_OMITTED_AT_DEFAULT.items():
            fields = type(getattr(self, section)).model_fields
            for name in names:
                omitted = _DIGEST_OMITTED_AT.get((section, name), fields[name].get_default(call_default_factory=True))
                if raw[section][name] == omitted:
                    raw[section].pop(name)
        return raw

    def digest(self) -> str:
        """A stable hash of the resolved config (embedded in checkpoints)."""
        canon = json.dumps(self.digest_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TrainConfig:
        """Build from a nested dict (JSON types: arrays may be lists), refusing unknown keys by name."""
        _check(isinstance(raw, Mapping), f"a config is a JSON object of sections, got {_kind(raw)}")
        # A YAML document may have keys that are not strings (1:, true:); keyword arguments must be.
        for name, section in raw.items():
            for key in (name, *(section if isinstance(section, Mapping) else ())):
                _check(isinstance(key, str), f"config keys must be strings, got {key!r} in {name!r}")
        return cls(**raw)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_file(cls, path: str) -> TrainConfig:
        """The config in the JSON file ``path``; a ConfigError names the file and what is wrong."""
        try:
            with open(path) as fh:
                text = fh.read()
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            return cls.from_json(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno}") from None
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None

    def replace(self, **sections: Any) -> TrainConfig:
        """Copy with some fields of some sections changed: ``cfg.replace(optim={"epochs": 3})``."""
        return TrainConfig.from_dict(overlay(self.to_dict(), sections))


# Fields added after the pinned digests (tests/unit/test_config_types.py), with their defaults.
def overlay(raw: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` (a config as a dict) with ``layer``'s values on top, field by field within a
    section (``seed`` replaced). Nothing is validated but the shape: build the result with
    ``TrainConfig.from_dict`` once every layer is on."""
    _check(isinstance(layer, Mapping), f"a config is a JSON object of sections, got {_kind(layer)}")
    merged = dict(raw)
    for name, values in layer.items():
        if name == "seed":
            merged[name] = values
            continue
        _check(isinstance(values, Mapping), f"config section {name!r} must be a JSON object, got {_kind(values)}")
        merged[name] = {**(merged.get(name) or {}), **values}  # an absent section (sweep: null) is empty
    return merged


def recipe(name: str, source_uri: str = "") -> TrainConfig:
    """Named, versioned starting points. ``digits`` (the DAG's) trains with the defaults: an epoch
    budget with early stopping, a cosine learning rate and dropout 0.1. ``debug`` trains on CPU in
    well under a minute: 3 epochs at a constant rate, every one run (early stopping off)."""
    if name == "digits":
        return TrainConfig(data=DataConfig(source_uri=source_uri, label_column="label"),
                           model=ModelConfig(name="mlp", hidden=(128, 64)),
                           optim=OptimConfig(optimizer="adam", learning_rate=0.002, batch_size=32))
    if name == "debug":
        return TrainConfig(data=DataConfig(source_uri=source_uri, label_column="label"),
                           model=ModelConfig(name="mlp", hidden=(32,), dropout=0.0),
                           optim=OptimConfig(optimizer="adam", learning_rate=0.005, batch_size=32, epochs=3,
                                             lr_schedule="constant", early_stopping_patience=0),
                           checkpoint=CheckpointConfig(every_n_steps=10, keep=3))
    raise ConfigError(f"unknown recipe {name!r}; expected 'digits' or 'debug'")


# --- error messages ------------------------------------------------------------------------------
# pydantic's errors, one line each, in the words of the config: the field's dotted path and what
# it must be ("must be an integer", "must be in [1, 256]", "must be one of (...)").

# What a strict type check expected.
_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "tuple_type": "a list", "dict_type": "a JSON object"}
_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
_OPERATORS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _kind(value: Any) -> str:
    """The JSON type of a value, as a message names it."""
    for types, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                        ((list, tuple), "a list"), (Mapping, "an object"), (type(None), "null")):
        if isinstance(value, types):
            return name
    return type(value).__name__


def _section(model: type[BaseModel]) -> str:
    """The name of the section a model is in TrainConfig ("" for TrainConfig itself)."""
    return next((name for name, f in TrainConfig.model_fields.items()
                 if f.annotation is model or model in get_args(f.annotation)), "")


def _path(prefix: str, loc: tuple[int | str, ...]) -> str:
    """``optim.lr_decay_epochs[1]`` for the location ``("lr_decay_epochs", 1)`` in ``optim``;
    the names of a union's members (``classes[2]`` as ``int`` or ``str``) are left out."""
    path = prefix
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif i == 0:
            path = f"{path}.{part}" if path else part
    return path


def _bounds(field: FieldInfo | None, ctx: Mapping[str, Any]) -> str:
    """``in [1, 256]``, ``in (0, 0.5)``, ``>= 0`` or ``> 0``: the field's declared bounds (an
    item of an array: the bound it broke)."""
    found = {key: getattr(m, key) for m in (field.metadata if field else ()) for key in _OPERATORS
             if getattr(m, key, None) is not None} or dict(ctx)
    low = next(((k, v) for k, v in found.items() if k in ("gt", "ge")), None)
    high = next(((k, v) for k, v in found.items() if k in ("lt", "le")), None)
    if low and high:
        return f"in {'[' if low[0] == 'ge' else '('}{low[1]}, {high[1]}{']' if high[0] == 'le' else ')'}"
    key, value = low or high  # type: ignore[misc]
    return f"{_OPERATORS[key]} {value}"


def _line(model: type[BaseModel], prefix: str, errors: list[dict[str, Any]]) -> str:
    """One line for the errors at one place (several only for a union's members)."""
    err = errors[0]
    kind, value, loc = err["type"], err["input"], err["loc"]
    path = _path(prefix, loc)
    field = model.model_fields.get(str(loc[0])) if len(loc) == 1 else None
    expected = [_EXPECTED[e["type"]] for e in errors if e["type"] in _EXPECTED]
    if len(errors) > 1:  # a union's members: one out of its bounds or a literal expects those too
        expected = ([_bounds(None, e["ctx"]) for e in errors if e["type"] in _BOUND_ERRORS] + expected
                    + [e["ctx"]["expected"] for e in errors if e["type"] == "literal_error"])
    if kind == "value_error":  # a combination check or a section's own errors: they name their fields
        return str(err["ctx"]["error"])
    if expected:
        return f"{path} must be {' or '.join(expected)}, got {value!r} ({_kind(value)})"
    if kind == "extra_forbidden":
        import difflib  # only on this error path

        near = difflib.get_close_matches(str(loc[0]), list(model.model_fields), n=1)
        hint = f" (did you mean {_path(prefix, (near[0],))!r}?)" if near else ""
        return f"unknown config key {path!r}{hint}"
    if kind == "model_type":
        return f"config section {path!r} must be a JSON object, got {_kind(value)}"
    if kind == "literal_error" and field is not None:
        return f"{path} must be one of {get_args(field.annotation)}, got {value!r}"
    if kind in _BOUND_ERRORS:
        return f"{path} must be {_bounds(field, err.get('ctx', {}))}, got {value!r}"
    if kind == "string_too_short":
        return f"{path} must not be empty"
    return f"{path}: {err['msg']}"


def _message(model: type[BaseModel], exc: ValidationError) -> str:
    prefix = _section(model)
    places: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for err in exc.errors(include_url=False):
        # A union's members fail at the same place: (classes, 2, "int") and (classes, 2, "str").
        place = tuple(p for i, p in enumerate(err["loc"]) if i == 0 or isinstance(p, int))
        places.setdefault(place, []).append(err)
    return "\n".join(_line(model, prefix, errors) for errors in places.values())
