"""A hyperparameter sweep's trials and its pruning rule, as pure functions of the config.

``plan`` expands ``TrainConfig.sweep`` (``common.config.SweepConfig``) into the trials' configs:
every combination of a grid, or ``trials`` seeded draws of a random search, each one the base
config with its fields set and checked as a whole by ``TrainConfig`` (so a value of the wrong
type, or a combination the config refuses, fails before anything is sharded, naming the field).
A field that changes the data (``data.*``, ``seed``: the split) is refused: the trials share one
set of shards.

``keeps_training`` is the rule of asynchronous successive halving (ASHA, Li et al. 2020, as in
Optuna's ``SuccessiveHalvingPruner``): at a rung, a trial goes on when it is among the best
``max(1, n // eta)`` of the ``n`` trials that reached that rung so far, itself included; the
rungs are at ``min_epochs * eta**k`` epochs (``rung_of``).

``may_take_cluster`` is the rule that keeps a run's ``sweep.parallel`` trials, at most, holding
a cluster at once: trials are admitted in plan order, trial ``i`` once fewer than ``parallel`` of
the trials before it are still open (not yet released, whatever their end) (``open_before``).
"""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.config import MAX_SWEEP_TRIALS, ConfigError, SearchRange, SweepConfig, TrainConfig, overlay
from common.task_metrics import TASK_METRICS, higher_is_better

# What the trials may not vary: they share the shards, which these decide.
FIXED_SECTIONS = ("data",)
FIXED_FIELDS = ("seed", "sweep")


@dataclass(frozen=True)
class Trial:
    """One trial: its index, the fields it sets (dotted name → value) and its whole config."""

    index: int
    values: dict[str, Any]
    config: TrainConfig

    @property
    def label(self) -> str:
        """``trial 2: optim.learning_rate=0.01, model.dropout=0.1`` (its rendered map index)."""
        return f"trial {self.index}: " + ", ".join(f"{k}={v!r}" for k, v in self.values.items())


def check_field(name: str) -> tuple[str, str]:
    """``("optim", "learning_rate")`` for ``"optim.learning_rate"``; an unknown field, or one
    the trials may not vary, is a ``ConfigError`` naming it."""
    section, _, field = name.partition(".")
    where = f"sweep.space[{name!r}]"
    if section in FIXED_FIELDS or section in FIXED_SECTIONS:
        raise ConfigError(f"{where}: the trials share one set of shards, so {section} cannot vary in a sweep")
    model = TrainConfig.model_fields.get(section)
    if model is None or not field or "." in field:
        raise ConfigError(f"{where}: unknown config field (a section and a field, e.g. 'optim.learning_rate'; "
                          f"sections: {[s for s in TrainConfig.model_fields if s not in FIXED_FIELDS]})")
    if field not in model.annotation.model_fields:
        raise ConfigError(f"{where}: unknown config field {field!r} of section {section!r}")
    return section, field


def metric(cfg: TrainConfig) -> tuple[str, bool]:
    """The metric the sweep ranks trials by and whether higher is better."""
    sweep = _sweep(cfg)
    name = cfg.early_stopping_metric if sweep.metric == "auto" else sweep.metric
    reported = TASK_METRICS[cfg.model.task]
    if name.removeprefix("val_") not in reported:
        raise ConfigError(f"sweep.metric={name!r} is not reported for model.task={cfg.model.task!r}; choose one of "
                          f"{['auto', *(f'val_{m}' for m in reported)]}")
    higher = higher_is_better(name) if sweep.direction == "auto" else sweep.direction == "max"
    return name, higher


def _sweep(cfg: TrainConfig) -> SweepConfig:
    if cfg.sweep is None:
        raise ConfigError("the config has no sweep section: give one (sweep.space at least) in config, "
                          "config_uri or the sweep Param")
    return cfg.sweep


def _draw(rng: random.Random, dim: tuple[Any, ...] | SearchRange, integer: bool) -> Any:
    if isinstance(dim, tuple):
        return dim[rng.randrange(len(dim))]
    low, high = float(dim.low), float(dim.high)
    whole = integer and isinstance(dim.low, int) and isinstance(dim.high, int)
    if dim.log:
        value = math.exp(rng.uniform(math.log(low), math.log(high)))
        return min(max(round(value), int(dim.low)), int(dim.high)) if whole else value
    return rng.randint(int(dim.low), int(dim.high)) if whole else rng.uniform(low, high)


def combinations(sweep: SweepConfig) -> list[dict[str, Any]]:
    """Each trial's field values, in order: the grid's product (the first field varies slowest),
    or the random draws (seeded by ``sweep.seed``)."""
    names = list(sweep.space)
    dims = [sweep.dimension(n) for n in names]
    if sweep.method == "grid":
        return [dict(zip(names, values)) for values in itertools.product(*dims)]  # type: ignore[arg-type]
    rng = random.Random(sweep.seed)
    integer = [_is_int_field(n) for n in names]
    return [{n: _draw(rng, d, i) for n, d, i in zip(names, dims, integer)} for _ in range(sweep.trials)]


def _is_int_field(name: str) -> bool:
    section, field = name.split(".", 1)
    return TrainConfig.model_fields[section].annotation.model_fields[field].annotation is int


def plan(cfg: TrainConfig, *, max_parallel: int | None = None) -> list[Trial]:
    """The trials of ``cfg.sweep`` over ``cfg`` (without its sweep section). Every problem is a
    ``ConfigError`` naming the field: an unknown or fixed field, an empty list or range, too
    many trials, a trial's config the config refuses (its message prefixed by the trial), a
    ``parallel`` above ``max_parallel`` (the DAG's cap)."""
    sweep = _sweep(cfg)
    for name in sweep.space:
        check_field(name)
    metric(cfg)
    if max_parallel is not None and sweep.parallel > max_parallel:
        raise ConfigError(f"sweep.parallel={sweep.parallel} is above this DAG's cap of {max_parallel} trials at once "
                          "(MXPIPE_SWEEP_PARALLEL)")
    values = combinations(sweep)
    if len(values) > MAX_SWEEP_TRIALS:
        raise ConfigError(f"sweep.space: the grid has {len(values)} combinations, more than {MAX_SWEEP_TRIALS} trials")
    base = cfg.to_dict()
    base["sweep"] = None
    trials = []
    for index, chosen in enumerate(values):
        layer: dict[str, dict[str, Any]] = {}
        for name, value in chosen.items():
            section, field = name.split(".", 1)
            layer.setdefault(section, {})[field] = value
        try:
            config = TrainConfig.from_dict(overlay(base, layer))
        except ConfigError as exc:
            raise ConfigError(f"sweep trial {index} ({', '.join(f'{k}={v!r}' for k, v in chosen.items())}): "
                              f"{exc}") from None
        if config.cluster.num_workers > cfg.num_train_shards:
            raise ConfigError(f"sweep trial {index}: cluster.num_workers={config.cluster.num_workers} is more than "
                              f"the {cfg.num_train_shards} train shards the trials share")
        trials.append(Trial(index=index, values=chosen, config=config))
    return trials


def rung_of(epochs_done: int, min_epochs: int, eta: int) -> int | None:
    """The rung ``k`` when ``epochs_done == min_epochs * eta**k``, else None (also without pruning)."""
    if min_epochs <= 0 or epochs_done < min_epochs:
        return None
    k, at = 0, min_epochs
    while at < epochs_done:
        k, at = k + 1, at * eta
    return k if at == epochs_done else None


def keeps_training(value: float, others: Sequence[float], eta: int, higher: bool) -> bool:
    """ASHA's rule at one rung: whether a trial with ``value`` is among the best
    ``max(1, n // eta)`` of the ``n`` values there (``others`` plus its own). A NaN is worst."""
    def key(v: float) -> float:
        if math.isnan(v):
            return math.inf
        return -v if higher else v

    ranked = sorted([*others, value], key=key)
    keep = max(1, len(ranked) // eta)
    # Ties go to the trial deciding: it is ranked before an equal value.
    position = sum(1 for v in others if key(v) < key(value))
    return position < keep


def rung_epochs(epochs: int, min_epochs: int, eta: int) -> list[int]:
    """The rung epochs below ``epochs`` (a trial that reaches ``epochs`` has finished, not paused)."""
    out, at = [], min_epochs
    while 0 < at < epochs:
        out.append(at)
        at *= eta
    return out


def trial_value(history: Sequence[Mapping[str, Any]], name: str, best_epoch: int | None) -> float | None:
    """A finished trial's metric: the exported epoch's (the best one when it was exported, else
    the last one), or None when the history does not have it."""
    if not history:
        return None
    record = next((r for r in history if r.get("epoch") == best_epoch), history[-1])
    value = record.get(name)
    return float(value) if value is not None else None


def open_before(index: int, ended: Collection[int]) -> list[int]:
    """The trials planned before trial ``index`` that may still hold a cluster: every one whose
    release has not ended (``ended``: the trials whose release ended, in any final state)."""
    return [j for j in range(index) if j not in ended]


def may_take_cluster(index: int, parallel: int, ended: Collection[int]) -> bool:
    """Whether trial ``index`` may provision: fewer than ``parallel`` of the trials before it are
    still open (``open_before``).

    Why it bounds the clusters held at once by ``parallel``: take the highest-numbered trial
    holding one; when it was admitted at most ``parallel - 1`` earlier trials were open, and a
    trial once ended stays ended, so every other holder is among those few. A trial waits only
    for trials planned before it, and trials ``0 .. parallel-1`` never wait, so every trial is
    admitted once the ones before it end (no deadlock). Unlike fixed lanes (trial ``i`` after
    trial ``i - parallel``) a slot freed by any earlier trial is used at once, so a slow trial
    holds up only itself, never the trials queued behind it in its lane."""
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    return len(open_before(index, ended)) < parallel
