"""One typed config that flows end to end: DAG params → shard → train → register.

``TrainConfig`` is frozen and validates itself on construction, so a bad value fails at once
with a message naming the field, never minutes later on a cluster. Recipes are plain functions
returning a config.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

MODELS = ("mlp", "lenet", "resnet18", "resnet50")
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


class ConfigError(ValueError):
    """An invalid configuration value; deterministic, so never worth a retry."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class DataConfig:
    """Where the source table is and how it is split and sharded."""

    # A file (CSV, CSV.gz, Parquet), a glob of them (``s3://b/data/part-*.parquet``), or a folder
    # ending in "/": its table files, or an image folder when it holds ``labels.csv``.
    source_uri: str = ""
    label_column: str = "label"
    # Train shards; 0 means num_workers * shards_per_worker. Worker r of W reads shards i with
    # i % W == r, so any shard count gives every record to exactly one worker per epoch (also
    # after a resume with another W); a multiple of W keeps the workers' shares equal.
    num_shards: int = 0
    shards_per_worker: int = 1
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    # Shape of one example for convolutional models, e.g. (1, 8, 8); empty = flat features.
    # Image sources record their (C, H, W) here when it is left empty.
    input_shape: tuple[int, ...] = ()
    # A shard may hold at most this many times the mean number of train records.
    max_shard_imbalance: float = 1.5
    # Largest total variation distance between a train shard's label distribution and the
    # whole train split's (checked on shards with at least 10 rows per class).
    max_label_skew: float = 0.25
    # Optional id column: not a feature; its values must be unique (checked by validation).
    id_column: str = ""
    # Optional declared label set, in class-index order; a label outside it fails validation.
    classes: tuple[Any, ...] = ()
    # Optional declared feature columns (in this order); empty = every other column.
    feature_columns: tuple[str, ...] = ()
    # Optional (min, max) every feature must lie in; image pixels are always checked in [0, 1].
    feature_range: tuple[float, ...] = ()
    # Rows per chunk while sharding: memory follows this, not the dataset (output is the same).
    chunk_rows: int = 50_000
    # Label distribution drift against the last validated manifest of the same dataset:
    # total variation distance above drift_threshold is reported ("warn") or fails ("fail").
    drift_action: str = "warn"
    drift_threshold: float = 0.1
    # Train batches a background thread prepares ahead of the step (training.feed.prefetch); bounds the
    # memory of prepared batches. 0 = none: each batch is built inline when the step needs it.
    prefetch_batches: int = 2

    def __post_init__(self) -> None:
        _check(bool(self.label_column), "data.label_column must not be empty")
        _check(self.num_shards >= 0, f"data.num_shards must be >= 0, got {self.num_shards}")
        _check(0 < self.val_fraction < 0.5, f"data.val_fraction must be in (0, 0.5), got {self.val_fraction}")
        _check(0 < self.test_fraction < 0.5, f"data.test_fraction must be in (0, 0.5), got {self.test_fraction}")
        _check(self.val_fraction + self.test_fraction < 0.8, "data.val_fraction + data.test_fraction must be < 0.8")
        _check(all(d > 0 for d in self.input_shape), f"data.input_shape must be positive, got {self.input_shape}")
        _check(self.max_shard_imbalance >= 1.0, "data.max_shard_imbalance must be >= 1.0")
        _check(self.shards_per_worker >= 1, f"data.shards_per_worker must be >= 1, got {self.shards_per_worker}")
        _check(0 < self.max_label_skew <= 1, f"data.max_label_skew must be in (0, 1], got {self.max_label_skew}")
        _check(self.id_column != self.label_column, "data.id_column must differ from data.label_column")
        _check(len(set(map(str, self.classes))) == len(self.classes), f"data.classes has duplicates: {self.classes}")
        _check(not self.classes or len(self.classes) >= 2, "data.classes must declare at least 2 classes")
        _check(all(isinstance(c, (int, str)) and not isinstance(c, bool) for c in self.classes),
               "data.classes must hold ints or strings")
        overlap = {self.label_column, self.id_column} & set(self.feature_columns)
        _check(not overlap, f"data.feature_columns must not include the label or id column: {sorted(overlap)}")
        _check(len(set(self.feature_columns)) == len(self.feature_columns), "data.feature_columns has duplicates")
        _check(len(self.feature_range) in (0, 2) and (not self.feature_range or
                                                      self.feature_range[0] < self.feature_range[1]),
               f"data.feature_range must be empty or (min, max) with min < max, got {self.feature_range}")
        _check(1 <= self.chunk_rows <= 10_000_000, f"data.chunk_rows must be in [1, 10000000], got {self.chunk_rows}")
        _check(self.drift_action in DRIFT_ACTIONS,
               f"data.drift_action must be one of {DRIFT_ACTIONS}, got {self.drift_action!r}")
        _check(0 < self.drift_threshold <= 1, f"data.drift_threshold must be in (0, 1], got {self.drift_threshold}")
        _check(type(self.prefetch_batches) is int and 0 <= self.prefetch_batches <= 64,
               f"data.prefetch_batches must be an integer in [0, 64] (0 = no prefetch thread), "
               f"got {self.prefetch_batches!r}")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "mlp"
    hidden: tuple[int, ...] = (128, 64)
    dropout: float = 0.0
    # Model parallelism inside a worker: "split" puts contiguous stages of the model's blocks on
    # the worker's cluster.devices_per_worker contexts, one stage each (data parallelism across
    # workers stays: hybrid). See training/loop/placement.py for what MXNet 1.9 gluon allows.
    placement: str = "replicated"

    def __post_init__(self) -> None:
        _check(self.name in MODELS, f"model.name must be one of {MODELS}, got {self.name!r}")
        _check(self.placement in PLACEMENTS, f"model.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        _check(all(h > 0 for h in self.hidden), f"model.hidden sizes must be positive, got {self.hidden}")
        _check(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adam"
    learning_rate: float = 0.002
    momentum: float = 0.9
    weight_decay: float = 0.0
    # Per-worker batch of one forward/backward (a micro-batch when accumulate_steps > 1); one
    # optimizer step consumes batch_size * accumulate_steps samples per worker, so the global
    # batch is batch_size * accumulate_steps * num_workers (``TrainConfig.global_batch``).
    batch_size: int = 32
    epochs: int = 20
    # Gradient accumulation: k forward/backward passes add into the gradients (grad_req='add'),
    # then one kvstore push and one optimizer step.
    accumulate_steps: int = 1
    # Learning rate over optimizer steps (not micro-batches). Warmup rises linearly from 0 to
    # the (scaled) learning rate over ``warmup_steps``. "step" multiplies by lr_decay_factor at
    # the start of each epoch in lr_decay_epochs; "cosine" and "poly" (power poly_power) decay
    # to final_lr at the last step. The position is a function of the global step, so a
    # resumed job continues the same curve (training.loop.optim).
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    lr_decay_epochs: tuple[int, ...] = ()
    lr_decay_factor: float = 0.1
    final_lr: float = 0.0
    poly_power: float = 2.0
    lr_scaling: str = "none"
    base_batch: int = 32
    # "fp16" runs forward/backward through mxnet.contrib.amp (dynamic loss scaling) and needs
    # GPU contexts; untested here, where there is no GPU.
    precision: str = "fp32"

    def __post_init__(self) -> None:
        _check(self.optimizer in OPTIMIZERS, f"optim.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        _check(0 < self.learning_rate <= 10, f"optim.learning_rate must be in (0, 10], got {self.learning_rate}")
        _check(0 <= self.momentum < 1, f"optim.momentum must be in [0, 1), got {self.momentum}")
        _check(self.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        _check(1 <= self.batch_size <= 65536, f"optim.batch_size must be in [1, 65536], got {self.batch_size}")
        _check(1 <= self.epochs <= 10000, f"optim.epochs must be in [1, 10000], got {self.epochs}")
        _check(1 <= self.accumulate_steps <= 1024,
               f"optim.accumulate_steps must be in [1, 1024], got {self.accumulate_steps}")
        _check(self.lr_schedule in LR_SCHEDULES,
               f"optim.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        decay = self.lr_decay_epochs
        _check((self.lr_schedule == "step") == bool(decay),
               "optim.lr_decay_epochs must be given exactly when optim.lr_schedule='step'")
        _check(all(0 < e < self.epochs for e in decay) and list(decay) == sorted(set(decay)),
               f"optim.lr_decay_epochs must be increasing epochs in [1, {self.epochs - 1}], got {decay}")
        _check(0 < self.lr_decay_factor < 1, f"optim.lr_decay_factor must be in (0, 1), got {self.lr_decay_factor}")
        _check(0 <= self.final_lr < self.learning_rate,
               f"optim.final_lr must be in [0, learning_rate), got {self.final_lr}")
        _check(self.poly_power > 0, f"optim.poly_power must be > 0, got {self.poly_power}")
        _check(self.lr_scaling in LR_SCALINGS,
               f"optim.lr_scaling must be one of {LR_SCALINGS}, got {self.lr_scaling!r}")
        _check(self.base_batch >= 1, f"optim.base_batch must be >= 1, got {self.base_batch}")
        _check(self.precision in PRECISIONS, f"optim.precision must be one of {PRECISIONS}, got {self.precision!r}")


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


@dataclass(frozen=True)
class ClusterConfig:
    # Where the roles run (BACKENDS); the machines of "hosts" and "ec2" are described outside the
    # config, in the settings files infra.cluster_settings reads.
    backend: str = "local"
    kvstore: str = "dist_sync"
    num_workers: int = 2
    num_servers: int = 1
    # Bounds of the distributed job (seconds). A worker that logs nothing for stall_timeout_s
    # is considered hung: ps-lite never recovers from a lost peer by itself.
    start_timeout_s: float = 120.0
    stall_timeout_s: float = 120.0
    job_timeout_s: float = 3600.0
    # Threads per role process; on a small machine several roles share the cores.
    threads_per_role: int = 1
    # "workers" keeps the optimizer state on every worker (Trainer.save_states works: exact
    # resume); "servers" keeps it on the servers. Both match single-process training in the
    # reference tests (docs/kvstore-correctness.md). "auto" (kept as written, so that changing
    # only the kvstore of a config stays valid) means "servers" for dist_async, the only
    # placement it has, and "workers" otherwise; ``optimizer_placement`` resolves it.
    optimizer_on: str = "auto"
    # Contexts per worker: the batch is split evenly over [cpu(0) .. cpu(n-1)] (or gpu(i)) and
    # their gradients are summed by the kvstore before the push.
    device: str = "cpu"
    devices_per_worker: int = 1
    # 2-bit compression of every push (values become -t, 0, +t; the rest is carried to the next
    # push). Only where the reference test covers it (COMPRESSION_KVSTORES). t is compared with
    # each worker's unscaled gradient (the sum over its batch_size rows), so it must be chosen
    # for the job: 0.5 (MXNet's default, kept so existing runs keep their resume digest) does
    # not train the digits MLP at batch 32, 8-128 do (docs/kvstore-correctness.md).
    gradient_compression: str = "none"
    compression_threshold: float = 0.5
    # Every role process flushes denormal floats to zero (x86 FTZ/DAZ, common.fpmode): Adam's
    # moments of dead units decay into the denormal range, where each operation on them is
    # many times slower (the LeNet benchmark's steps: 1.5x). Changes only values below 1.2e-38.
    flush_denormals: bool = True

    def __post_init__(self) -> None:
        _check(self.backend in BACKENDS, f"cluster.backend must be one of {BACKENDS}, got {self.backend!r}")
        _check(self.kvstore in KVSTORES, f"cluster.kvstore must be one of {KVSTORES}, got {self.kvstore!r}")
        _check(1 <= self.num_workers <= 256, f"cluster.num_workers must be in [1, 256], got {self.num_workers}")
        _check(1 <= self.num_servers <= 64, f"cluster.num_servers must be in [1, 64], got {self.num_servers}")
        for name in ("start_timeout_s", "stall_timeout_s", "job_timeout_s"):
            _check(getattr(self, name) > 0, f"cluster.{name} must be > 0")
        _check(self.threads_per_role >= 1, "cluster.threads_per_role must be >= 1")
        _check(self.optimizer_on == "auto" or self.optimizer_on in OPTIMIZER_PLACEMENTS,
               f"cluster.optimizer_on must be 'auto' or one of {OPTIMIZER_PLACEMENTS}, "
               f"got {self.optimizer_on!r}")
        _check(self.device in DEVICE_TYPES, f"cluster.device must be one of {DEVICE_TYPES}, got {self.device!r}")
        _check(1 <= self.devices_per_worker <= 16,
               f"cluster.devices_per_worker must be in [1, 16], got {self.devices_per_worker}")
        _check(self.kvstore not in ("local", "device") or self.num_workers == 1,
               f"cluster.kvstore={self.kvstore!r} runs a single process: set cluster.num_workers=1")
        _check(self.kvstore != "dist_async" or self.devices_per_worker == 1,
               "cluster.kvstore='dist_async' is tested with one context per worker only: "
               "set cluster.devices_per_worker=1")
        _check(self.gradient_compression in GRADIENT_COMPRESSIONS,
               f"cluster.gradient_compression must be one of {GRADIENT_COMPRESSIONS}, "
               f"got {self.gradient_compression!r}")
        _check(self.gradient_compression == "none" or self.kvstore in COMPRESSION_KVSTORES,
               f"cluster.gradient_compression='2bit' needs cluster.kvstore in {COMPRESSION_KVSTORES}, got "
               f"{self.kvstore!r}: MXNet compresses only the pushes of a distributed kvstore (it refuses "
               "'local'), and only dist_sync has a reference test here")
        _check(isinstance(self.flush_denormals, bool),
               f"cluster.flush_denormals must be true or false, got {self.flush_denormals!r}")
        _check(self.compression_threshold > 0,
               f"cluster.compression_threshold must be > 0, got {self.compression_threshold}")
        reason = unsafe_combination(self.kvstore, self.optimizer_placement)
        _check(reason is None, f"cluster.kvstore={self.kvstore!r} with cluster.optimizer_on="
                               f"{self.optimizer_on!r} is refused: {reason}")

    @property
    def distributed(self) -> bool:
        return self.kvstore.startswith("dist_")

    @property
    def optimizer_placement(self) -> str:
        """``optimizer_on`` with "auto" resolved: "servers" or "workers"."""
        if self.optimizer_on != "auto":
            return self.optimizer_on
        return "servers" if self.kvstore == "dist_async" else "workers"


@dataclass(frozen=True)
class CheckpointConfig:
    """When rank 0 checkpoints, what is kept, how it is protected (training/checkpoint/).

    None of these fields changes what is trained: a resume may change them (they are left out
    of the digest a checkpoint is matched against).
    """

    # Cadence: every N global steps and/or every T seconds (0 = off), and always at epoch end.
    every_n_steps: int = 50
    every_n_seconds: float = 0.0
    # Retention: the newest ``keep`` committed, plus (if > 0) the oldest committed checkpoint of
    # every window of ``keep_every_n_steps`` steps, forever.
    keep: int = 3
    keep_every_n_steps: int = 0
    # Serialise and upload in a background thread (the loop blocks only for the host copy).
    # A periodic checkpoint due while the previous is still uploading is skipped (counted);
    # epoch-end, final and emergency checkpoints wait for it.
    async_upload: bool = True
    # One checkpoint's upload is retried with exponential backoff for at most this long.
    upload_timeout_s: float = 300.0
    # SIGTERM: rank 0 writes an emergency checkpoint within this many seconds, then exits 75.
    preempt_grace_s: float = 30.0
    # S3 server-side encryption of every checkpoint object: "", "AES256" or "aws:kms".
    sse: str = ""
    sse_kms_key_id: str = ""
    # Client-side AES-256-GCM envelope encryption: the NAME of the environment variable that
    # holds the 32-byte key (hex or base64); "" = off. The key itself is never in the config.
    encryption_key_env: str = ""
    # Allow resuming with another number of workers (data assignment recomputed; see worker).
    elastic: bool = False
    # Per-step metrics (train loss, learning rate; logged to MLflow as ``*_step`` at the global
    # step): every N-th step, at most ``max_step_metrics`` records (over the cap the stride
    # doubles and every other record is dropped: training.loop.metrics.StepRecorder). Here, not in
    # ``optim``: they change nothing that is trained (left out of the resume digest), and the
    # records up to a checkpoint live in its train state.
    step_metrics_every_n: int = 1
    max_step_metrics: int = 2000

    def __post_init__(self) -> None:
        _check(self.every_n_steps >= 1, f"checkpoint.every_n_steps must be >= 1, got {self.every_n_steps}")
        _check(self.every_n_seconds >= 0, f"checkpoint.every_n_seconds must be >= 0, got {self.every_n_seconds}")
        _check(self.keep >= 2, f"checkpoint.keep must be >= 2 (a torn newest one needs a fallback), got {self.keep}")
        _check(self.keep_every_n_steps >= 0, "checkpoint.keep_every_n_steps must be >= 0")
        _check(self.upload_timeout_s > 0, "checkpoint.upload_timeout_s must be > 0")
        _check(self.preempt_grace_s > 0, "checkpoint.preempt_grace_s must be > 0")
        _check(self.sse in ("", "AES256", "aws:kms"),
               f"checkpoint.sse must be '', 'AES256' or 'aws:kms', got {self.sse!r}")
        _check(not self.sse_kms_key_id or self.sse == "aws:kms", "checkpoint.sse_kms_key_id needs sse='aws:kms'")
        env = self.encryption_key_env
        looks_like_key = len(env) >= 32 and all(c in "0123456789abcdefABCDEF" for c in env)
        _check(env == "" or (env.replace("_", "").isalnum() and not env[0].isdigit() and not looks_like_key),
               "checkpoint.encryption_key_env must be the NAME of an environment variable, not a key")
        _check(self.step_metrics_every_n >= 1,
               f"checkpoint.step_metrics_every_n must be >= 1, got {self.step_metrics_every_n}")
        _check(2 <= self.max_step_metrics <= 100_000,
               f"checkpoint.max_step_metrics must be in [2, 100000], got {self.max_step_metrics}")


@dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 42

    def __post_init__(self) -> None:
        _check(0 <= self.seed < 2**31, f"seed must be in [0, 2**31), got {self.seed}")
        _check(self.model.name not in IMAGE_MODELS or len(self.data.input_shape) == 3,
               f"model.name={self.model.name!r} needs data.input_shape=(channels, height, width)")
        devices, batch = self.cluster.devices_per_worker, self.optim.batch_size
        _check(batch % devices == 0 or self.model.placement == "split", f"optim.batch_size={batch} must be divisible by cluster.devices_per_worker="
                                     f"{devices}: every context gets an equal slice of each batch")
        _check(self.optim.precision != "fp16" or self.cluster.device == "gpu",
               "optim.precision='fp16' needs cluster.device='gpu': mxnet.contrib.amp runs float16 on GPU "
               "contexts only; on CPU use precision='fp32'")
        if self.model.placement == "split":
            _check(self.cluster.devices_per_worker >= 2,
                   "model.placement='split' needs cluster.devices_per_worker >= 2 (one stage per context)")
            _check(self.cluster.optimizer_placement == "workers",
                   "model.placement='split' needs the optimizer on the workers (cluster.optimizer_on='workers' "
                   "or 'auto' with a sync kvstore): every stage's Trainer would send its own optimizer to the servers")
            _check(self.optim.precision == "fp32", "model.placement='split' is fp32 only (AMP with split is untested)")
        workers = self.cluster.num_workers
        _check(self.num_train_shards >= workers,
               f"data.num_shards={self.num_train_shards} cannot be spread over cluster.num_workers={workers}: "
               "every worker needs at least one train shard")
        lr = self.effective_learning_rate(workers)
        _check(lr <= 10, f"the scaled learning rate {lr:g} (optim.lr_scaling='linear', global batch "
                         f"{self.global_batch(workers)}, base_batch {self.optim.base_batch}) must be <= 10")

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
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    def digest(self) -> str:
        """A stable hash of the resolved config (embedded in checkpoints)."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TrainConfig":
        """Build from a nested dict, rejecting unknown keys by name."""
        sections = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig,
                    "cluster": ClusterConfig, "checkpoint": CheckpointConfig}
        _check(isinstance(raw, dict), f"a config is a JSON object of sections, got {type(raw).__name__}")
        unknown = set(raw) - set(sections) - {"seed"}
        _check(not unknown, f"unknown config keys: {sorted(unknown)}")
        kwargs: dict[str, Any] = {}
        for name, section_cls in sections.items():
            section = raw.get(name) or {}
            _check(isinstance(section, dict), f"config section {name!r} must be a JSON object, got "
                                              f"{type(section).__name__}")
            values = dict(section)
            known = {f.name: f for f in dataclasses.fields(section_cls)}
            bad = set(values) - set(known)
            _check(not bad, f"unknown keys in config section {name!r}: {sorted(bad)}")
            for key, val in list(values.items()):
                if isinstance(val, list):
                    values[key] = tuple(val)
            try:
                kwargs[name] = section_cls(**values)
            except TypeError as exc:
                raise ConfigError(f"config section {name!r}: {exc}") from exc
        if "seed" in raw:
            kwargs["seed"] = raw["seed"]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_file(cls, path: str) -> "TrainConfig":
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

    def replace(self, **sections: dict[str, Any]) -> "TrainConfig":
        """Copy with some fields of some sections changed: ``cfg.replace(optim={"epochs": 3})``."""
        raw = self.to_dict()
        for name, values in sections.items():
            if name == "seed":
                raw["seed"] = values
            else:
                raw[name] = {**raw[name], **values}
        return TrainConfig.from_dict(raw)


def recipe(name: str, source_uri: str = "") -> TrainConfig:
    """Named, versioned starting points. ``debug`` trains on CPU in well under a minute."""
    if name == "digits":
        return TrainConfig(data=DataConfig(source_uri=source_uri, label_column="label"),
                           model=ModelConfig(name="mlp", hidden=(128, 64)),
                           optim=OptimConfig(optimizer="adam", learning_rate=0.002, batch_size=32, epochs=20))
    if name == "debug":
        return TrainConfig(data=DataConfig(source_uri=source_uri, label_column="label"),
                           model=ModelConfig(name="mlp", hidden=(32,)),
                           optim=OptimConfig(optimizer="adam", learning_rate=0.005, batch_size=32, epochs=3),
                           checkpoint=CheckpointConfig(every_n_steps=10, keep=3))
    raise ConfigError(f"unknown recipe {name!r}; expected 'digits' or 'debug'")
