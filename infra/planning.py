"""Hardware planning: how much memory a model needs per device, and which cluster to ask for.

    python -m infra.planning --params 10e9 --optimizer adam --batch-size 32   # a count, no model
    python scripts/plan.py --model resnet50 --input-shape 3,224,224 --classes 1000 \\
        --batch-size 256 --optimizer sgd --momentum 0.9 --precision fp32      # a model of the zoo
    python scripts/plan.py --model mynet.arch:build --model-code /src/nets --model-options '{"width": 256}' \\
        --input-shape 3,32,32 --classes 10                                    # a network of your own

The estimate (per device of a data-parallel worker; every device holds a full replica):

- parameters: P trainable values (fp32; with fp16, MXNet's AMP keeps fp32 weights and casts a
  2-byte copy for the fp16 operators, so 4 + 2 bytes), plus BatchNorm running statistics;
- gradients: P fp32 values (AMP's gradients are those of the fp32 weights);
- optimizer state: k fp32 values per parameter, k from ``STATE_PER_PARAM``, on every device when
  the optimizer runs on the workers (``cluster.optimizer_on="workers"``), none with it on the
  servers (it then lives in the servers' host memory);
- activations: the output of every operator of the forward graph for one sample (from MXNet's
  shape inference on the real network, batch 1), times ``ACTIVATION_FACTOR``, times the
  per-device batch, at 4 bytes (2 with fp16). The forward outputs are kept for the backward
  pass, which frees each once its gradient is done, so their sum is about the peak; MXNet's
  memory planner also shares buffers and runs some operators in place, so this errs high.
  cuDNN workspaces and allocator fragmentation are not counted, which is why only
  ``USABLE_FRACTION`` of a device is planned.

Sizing: the largest per-device batch that fits gives the devices the global batch needs; one
worker per instance with its GPUs as devices (as the EC2 backend places roles); servers from
the bytes each step moves through them (every worker pushes P gradients and pulls P weights,
fp32): enough servers that their share moves in ``COMM_BUDGET_S`` on the instance's network,
at most one per worker instance (servers run beside the workers; beyond W servers the workers'
own links are the limit). The instance type is the fitting one with the lowest price per peak
TFLOP of the devices the plan uses (unused GPUs are still paid for). Times (communication per
step, start, checkpoints, the data step) are ``infra.perf_model``'s: ``servers_for``'s bytes are
its serial bound, what its pipelined model gives for a model of one array.

No Airflow and no mxnet here: a model comes in as its counts (``ModelShape``). Counting a model of
the zoo by name needs the trainer (``training.loop.model.count_model``, mxnet shape inference) and
infra does not import training, so ``main`` takes the counting function from its caller:
``scripts/plan.py`` (which may import both) passes it for ``--model``. A custom network
(``--model package.module:factory``) is counted the same way, its code (``--model-code``, what
``model.code_uri`` would name) packed and put on the path as a run's roles get it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import logging
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from common.cli import parser as cli_parser
from common.cli import usage_errors
from common import model_code
from common.config import IMPORT_PATH_PATTERN, MODELS
from infra.catalogue import CATALOGUE, InstanceType

log = logging.getLogger(__name__)

GIB = 2**30
USABLE_FRACTION = 0.9
ACTIVATION_FACTOR = 1.0
COMM_BUDGET_S = 0.01
WIRE_BYTES = 4  # kvstore pushes and pulls the fp32 arrays
PRECISIONS = ("fp32", "fp16")
# fp32 values of optimizer state per parameter (MXNet 1.9's optimizers).
STATE_PER_PARAM = {"sgd": 0, "sgd_momentum": 1, "nag": 1, "adam": 2, "lamb": 2, "adagrad": 1,
                   "rmsprop": 1, "rmsprop_centered": 2, "adadelta": 2}
OPTIMIZERS = ("sgd", "nag", "adam", "lamb", "adagrad", "rmsprop", "adadelta")


def state_per_param(optimizer: str, *, momentum: float = 0.0, centered: bool = False) -> int:
    """SGD keeps a momentum buffer only when momentum > 0; centered RMSProp keeps a mean too."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
    if optimizer == "sgd":
        return STATE_PER_PARAM["sgd_momentum" if momentum > 0 else "sgd"]
    if optimizer == "rmsprop":
        return STATE_PER_PARAM["rmsprop_centered" if centered else "rmsprop"]
    return STATE_PER_PARAM[optimizer]


@dataclass(frozen=True)
class ModelShape:
    params: int  # trainable values
    aux: int = 0  # non-trainable state (BatchNorm running mean/var)
    activations_per_sample: int = 0  # forward operator outputs for one sample (0 = not known)


@dataclass(frozen=True)
class Memory:
    """Bytes per device."""

    params: float
    grads: float
    optimizer_state: float
    activations: float

    @property
    def fixed(self) -> float:
        return self.params + self.grads + self.optimizer_state

    @property
    def total(self) -> float:
        return self.fixed + self.activations


def memory_per_device(shape: ModelShape, state_values: int, per_device_batch: int, precision: str = "fp32",
                      optimizer_on: str = "workers") -> Memory:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    weight_bytes = 4 + (2 if precision == "fp16" else 0)
    act_bytes = 2 if precision == "fp16" else 4
    state = shape.params * state_values * 4 if optimizer_on == "workers" else 0.0
    return Memory(params=shape.params * weight_bytes + shape.aux * 4, grads=shape.params * 4.0,
                  optimizer_state=float(state),
                  activations=shape.activations_per_sample * ACTIVATION_FACTOR * act_bytes * per_device_batch)


def servers_for(params: int, workers: int, network_gbps: float) -> int:
    """Servers so that their share of a step's traffic moves within COMM_BUDGET_S; 0 for 1 worker."""
    if workers <= 1:
        return 0  # a single worker sums its devices' gradients locally (kvstore local/device)
    step_bytes = workers * 2 * params * WIRE_BYTES
    link = network_gbps * 1e9 / 8
    return max(1, min(workers, math.ceil(step_bytes / (link * COMM_BUDGET_S))))


@dataclass
class Option:
    instance: InstanceType
    fits: bool
    memory: Memory  # at the planned per-device batch (or batch 1 when it does not fit)
    max_batch_per_device: int = 0
    workers: int = 0
    devices_per_worker: int = 0
    servers: int = 0
    batch_per_device: int = 0
    price_per_hour: float = 0.0
    precision: str = "fp32"

    @property
    def score(self) -> float:
        """USD per peak TFLOP-hour of the devices used (lower is better)."""
        used = self.workers * self.devices_per_worker
        return self.price_per_hour / (used * self.instance.tflops(self.precision)) if used else math.inf


@dataclass
class Plan:
    shape: ModelShape
    optimizer: str
    precision: str
    global_batch: int
    best: Option | None
    options: list[Option] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        def opt(o: Option) -> dict[str, Any]:
            return {"instance_type": o.instance.name, "gpu": o.instance.gpu, "fits": o.fits,
                    "workers": o.workers, "devices_per_worker": o.devices_per_worker, "servers": o.servers,
                    "batch_per_device": o.batch_per_device, "max_batch_per_device": o.max_batch_per_device,
                    "memory_gib": {k: v / GIB for k, v in {**asdict(o.memory), "total": o.memory.total}.items()},
                    "price_per_hour": o.price_per_hour}
        return {"params": self.shape.params, "aux": self.shape.aux,
                "activations_per_sample": self.shape.activations_per_sample, "optimizer": self.optimizer,
                "precision": self.precision, "global_batch": self.global_batch,
                "best": opt(self.best) if self.best else None, "options": [opt(o) for o in self.options],
                "warnings": self.warnings}


def size_on(it: InstanceType, shape: ModelShape, state_values: int, global_batch: int, precision: str,
            optimizer_on: str) -> Option:
    """The cluster of ``it`` instances that trains ``global_batch`` samples per step."""
    usable = it.gpu_memory_gib * GIB * USABLE_FRACTION
    fixed = memory_per_device(shape, state_values, 0, precision, optimizer_on)
    per_sample = memory_per_device(shape, state_values, 1, precision, optimizer_on).activations
    room = usable - fixed.total
    max_batch = global_batch if per_sample == 0 else int(room // per_sample)
    if room <= 0 or max_batch < 1:
        return Option(it, False, memory_per_device(shape, state_values, 1, precision, optimizer_on), precision=precision)
    devices = math.ceil(global_batch / min(max_batch, global_batch))
    workers = math.ceil(devices / it.gpus)
    per_worker = math.ceil(devices / workers)
    batch = math.ceil(global_batch / (workers * per_worker))
    return Option(it, True, memory_per_device(shape, state_values, batch, precision, optimizer_on), max_batch,
                  workers, per_worker, servers_for(shape.params, workers, it.network_gbps), batch,
                  workers * it.price_per_hour, precision=precision)


def plan(shape: ModelShape, *, optimizer: str = "adam", momentum: float = 0.0, centered: bool = False,
         global_batch: int = 32, precision: str = "fp32", optimizer_on: str = "workers",
         catalogue: Sequence[InstanceType] = CATALOGUE) -> Plan:
    if global_batch < 1 or shape.params < 1:
        raise ValueError("global_batch and params must be >= 1")
    k = state_per_param(optimizer, momentum=momentum, centered=centered)
    options = [size_on(it, shape, k, global_batch, precision, optimizer_on) for it in catalogue]
    fitting = sorted((o for o in options if o.fits), key=lambda o: (o.score, o.workers, o.price_per_hour))
    result = Plan(shape, optimizer, precision, global_batch, fitting[0] if fitting else None, options)
    if shape.activations_per_sample == 0:
        result.warnings.append("activations not estimated (no model given): only parameters, gradients and "
                               "optimizer state are counted")
    if not fitting:
        need = min(o.memory.total for o in options) / GIB
        biggest = max(catalogue, key=lambda it: it.gpu_memory_gib)
        result.warnings.append(
            f"the model does not fit on any device in the catalogue: {need:.1f} GiB per device at batch 1 "
            f"(params + grads + {optimizer} state + activations), the largest device is {biggest.gpu_memory_gib:.0f} "
            f"GiB ({biggest.name}, {biggest.gpu}; {USABLE_FRACTION:.0%} usable). Data parallelism needs a whole "
            "replica per device: split the model across devices, use fp16, or keep the optimizer on the servers")
    for w in result.warnings:
        log.warning("%s", w)
    return result


def format_plan(p: Plan) -> str:
    lines = [f"model: {p.shape.params / 1e6:,.2f} M parameters, {p.shape.aux:,} aux, "
             f"{p.shape.activations_per_sample:,} activations per sample; {p.optimizer}, {p.precision}, "
             f"global batch {p.global_batch}"]
    if p.best:
        b, m = p.best, p.best.memory
        lines += [f"recommended: {b.workers} x {b.instance.name} ({b.instance.gpus} x {b.instance.gpu} "
                  f"{b.instance.gpu_memory_gib:.0f} GiB), {b.devices_per_worker} device(s) per worker, "
                  f"{b.servers} server(s), batch {b.batch_per_device} per device (max {b.max_batch_per_device}), "
                  f"${b.price_per_hour:,.2f}/h",
                  f"memory per device: {m.total / GIB:.2f} GiB = params {m.params / GIB:.2f} + grads "
                  f"{m.grads / GIB:.2f} + optimizer state {m.optimizer_state / GIB:.2f} + activations "
                  f"{m.activations / GIB:.2f}"]
    lines.append(f"{'instance':14s} {'fits':>4s} {'workers':>7s} {'dev/w':>5s} {'servers':>7s} {'batch/dev':>9s} "
                 f"{'GiB/dev':>8s} {'$/h':>9s}")
    for o in p.options:
        lines.append(f"{o.instance.name:14s} {'yes' if o.fits else 'no':>4s} {o.workers:7d} {o.devices_per_worker:5d} "
                     f"{o.servers:7d} {o.batch_per_device:9d} {o.memory.total / GIB:8.2f} {o.price_per_hour:9.2f}")
    lines += [f"WARNING: {w}" for w in p.warnings]
    return "\n".join(lines)


# count_model(name, input_shape, classes, options=...) → {"params", "aux", "activations_per_sample"}
ModelCounter = Callable[..., Mapping[str, int]]

EXAMPLES = """
python -m infra.planning --params 10e9 --optimizer adam --batch-size 32      # a parameter count
scripts/plan.py --model resnet50 --input-shape 3,224,224 --classes 1000 \\
    --batch-size 256 --optimizer sgd --momentum 0.9 --precision fp32           # a model of the zoo
scripts/plan.py --model mynet.arch:build --model-code /src/nets --input-shape 3,32,32 --classes 10
"""


def _check_numbers(args: argparse.Namespace) -> None:
    """A ValueError names the first flag whose number is out of range."""
    if args.params is not None and not (math.isfinite(args.params) and args.params >= 1):
        raise ValueError(f"--params must be a finite count >= 1, got {args.params}")
    if not (math.isfinite(args.activations_per_sample) and args.activations_per_sample >= 0):
        raise ValueError(f"--activations-per-sample must be a finite count >= 0, got {args.activations_per_sample}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.classes < 1:
        raise ValueError(f"--classes must be >= 1, got {args.classes}")
    if not 0 <= args.momentum < 1:
        raise ValueError(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.model is not None and args.model not in MODELS and not re.fullmatch(IMPORT_PATH_PATTERN, args.model):
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {args.model!r} (or a network of your "
                         "own: package.module:factory)")


def _dims(text: str) -> list[int]:
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--input-shape must be positive integers C,H,W (or F), got {text!r}")
    return [int(p) for p in parts]


def main(argv: Sequence[str] | None = None, *, count_model: ModelCounter | None = None,
         prog: str = "python -m infra.planning") -> int:
    """The planning CLI; ``count_model(name, input_shape, classes)`` serves ``--model``."""
    ap = cli_parser(__doc__.split("\n")[0] + " Exit status 1 when no instance type fits.", EXAMPLES, prog=prog)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help=f"a model of the zoo ({', '.join(MODELS)}) or package.module:factory")
    src.add_argument("--params", type=float, help="trainable parameter count instead of a model (e.g. 10e9)")
    ap.add_argument("--model-code", default="", help="with a custom --model: the folder or .py file holding it "
                                                      "(local or s3://; model.code_uri)")
    ap.add_argument("--model-options", default="{}", help="with a custom --model: model.options as a JSON object")
    ap.add_argument("--input-shape", default="3,224,224", help="C,H,W of one example (or F for an MLP)")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--activations-per-sample", type=float, default=0, help="with --params")
    ap.add_argument("--batch-size", type=int, default=32, help="global batch per step")
    ap.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--centered", action="store_true", help="centered RMSProp")
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS)
    ap.add_argument("--optimizer-on", default="workers", choices=("workers", "servers"))
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the warnings are printed with the plan
    with usage_errors(ValueError):  # a ConfigError too: the trainer refusing the model the flags describe
        _check_numbers(args)
        if args.model:
            if count_model is None:
                raise ValueError("--model counts a network of the trainer's model zoo, which infra does not "
                                 "import: run scripts/plan.py with the same flags, or give --params")
            options = json.loads(args.model_options)
            with model_code.on_path(args.model_code) if args.model_code else contextlib.nullcontext():
                shape = ModelShape(**count_model(args.model, _dims(args.input_shape), args.classes, options=options))
        else:
            shape = ModelShape(params=int(args.params), activations_per_sample=int(args.activations_per_sample))
    result = plan(shape, optimizer=args.optimizer, momentum=args.momentum, centered=args.centered,
                  global_batch=args.batch_size, precision=args.precision, optimizer_on=args.optimizer_on)
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_plan(result))
    return 0 if result.best else 1


if __name__ == "__main__":
    sys.exit(main())
