"""Deterministic, streaming assignment of rows to train/val/test and to train shards.

It never needs the whole dataset: rows arrive in source order, chunk by chunk, and the result is
the same for any chunk size (``tests/unit/test_assign.py``). The state is a few counters per
class. The exact guarantees, for a given seed, source row order and settings:

**Split (stratified per class).** The fractions are turned into a block of ``B`` slots holding
``q_test`` test and ``q_val`` val slots (``B`` is the smallest size in which both fractions are
whole: 10 slots = 2 test + 1 val for 0.2 / 0.1; fractions that need more than 1000 slots are
rounded to 1000). The rows of one class, in source order, fill consecutive blocks; inside each
block the slots are placed in a seeded random order that depends on (seed, class, block). So
for a class with ``n`` rows: every complete block holds exactly its quota, and
``floor(n/B)*q <= count <= floor(n/B)*q + q`` for test and val alike. In a class's first block
the first three rows take train, val and test in a random order (the rest of the block takes
the remaining quota): a class with at least 3 rows has at least one row in each split, and a
class with fewer than 3 rows goes to train entirely (its rows are held back until the third
row arrives or the stream ends, so at most 2 rows per class are ever held).

**Train shards (balanced).** Train rows, in the order they are emitted, are dealt to the ``N``
train shards in consecutive blocks of ``N``; inside each block the shards are taken in a seeded
random order. Every shard's size is ``floor(T/N)`` or ``ceil(T/N)`` for ``T`` train rows.

What is *not* promised: the assignment depends on the row order of the source, so reordering
(or inserting rows into) a source moves rows between splits.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TRAIN, VAL, TEST = 0, 1, 2
SPLITS = ("train", "val", "test")
MIN_ROWS_TO_SPLIT = 3
_MAX_BLOCK = 1000
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray | int) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-mixed 64-bit hash of uint64 values."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def value_key(value: Any) -> int:
    """A stable 64-bit key of a class value (the same on every machine and Python run)."""
    digest = hashlib.blake2b(json.dumps(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class SplitBlock:
    size: int
    test: int
    val: int

    @classmethod
    def from_fractions(cls, val_fraction: float, test_fraction: float) -> "SplitBlock":
        for b in range(MIN_ROWS_TO_SPLIT, _MAX_BLOCK + 1):
            t, v = b * test_fraction, b * val_fraction
            if abs(t - round(t)) < 1e-9 and abs(v - round(v)) < 1e-9 and b - round(t) - round(v) >= 1:
                return cls(b, max(1, round(t)), max(1, round(v)))
        return cls(_MAX_BLOCK, max(1, round(_MAX_BLOCK * test_fraction)), max(1, round(_MAX_BLOCK * val_fraction)))

    def template(self) -> np.ndarray:
        return np.array([TEST] * self.test + [VAL] * self.val + [TRAIN] * (self.size - self.test - self.val),
                        dtype=np.int8)


def _permutations(base: np.ndarray, blocks: np.ndarray, width: int) -> np.ndarray:
    """One seeded permutation of ``range(width)`` per (base key, block) pair: ``[len(blocks), width]``."""
    row_keys = mix64(base ^ mix64(blocks.astype(np.uint64) + np.uint64(1)))
    with np.errstate(over="ignore"):
        keys = mix64(row_keys[:, None] + np.arange(1, width + 1, dtype=np.uint64)[None, :] * _GOLDEN)
    return np.argsort(keys, axis=1, kind="stable")


@dataclass
class Assigner:
    """Feed it chunks in source order with :meth:`assign`; finish with :meth:`finish`."""

    block: SplitBlock
    num_train_shards: int
    seed: int
    _seen: dict[int, int] = field(default_factory=dict)  # class id → rows seen so far
    _keys: dict[int, int] = field(default_factory=dict)  # class id → value key
    _first_block: dict[int, np.ndarray] = field(default_factory=dict)
    _held: dict[int, list[int]] = field(default_factory=dict)  # class id → held handles
    _trained: int = 0  # train rows dealt so far

    def add_class(self, class_id: int, value: Any) -> None:
        self._keys[class_id] = value_key(value)

    def assign(self, classes: np.ndarray, handles: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """Assign one chunk.

        ``classes``: class id per row (source order); ``handles``: the rows' global row numbers.
        Returns ``(emitted, split, shard, newly_held)``: the handles emitted now, in emission
        order (this chunk's rows plus any held rows they release), their split codes, their
        train shard (-1 for val/test), and the handles this chunk holds back.
        """
        n = len(classes)
        within = np.empty(n, np.int64)  # index of each row inside its class, over the whole stream
        order = np.argsort(classes, kind="stable")
        sorted_classes = classes[order]
        starts = np.flatnonzero(np.r_[True, sorted_classes[1:] != sorted_classes[:-1]])
        counts = np.diff(np.r_[starts, n])
        for start, count in zip(starts, counts):
            c = int(sorted_classes[start])
            before = self._seen.get(c, 0)
            within[order[start:start + count]] = np.arange(before, before + count)
            self._seen[c] = before + count

        pool_handles, pool_classes, pool_within, emit_at, sub = [], [], [], [], []
        newly_held: list[int] = []
        for i in np.flatnonzero(within < MIN_ROWS_TO_SPLIT):
            c, j, h = int(classes[i]), int(within[i]), int(handles[i])
            if j < MIN_ROWS_TO_SPLIT - 1:
                self._held.setdefault(c, []).append(h)
                newly_held.append(h)
                continue
            for k, held in enumerate(self._held.pop(c, [])):  # the third row releases the first two
                pool_handles.append(held), pool_classes.append(c), pool_within.append(k)
                emit_at.append(h), sub.append(k)
        normal = within >= MIN_ROWS_TO_SPLIT - 1
        all_handles = np.r_[np.asarray(pool_handles, np.int64), handles[normal]]
        all_classes = np.r_[np.asarray(pool_classes, np.int64), classes[normal]]
        all_within = np.r_[np.asarray(pool_within, np.int64), within[normal]]
        all_emit = np.r_[np.asarray(emit_at, np.int64), handles[normal]]
        all_sub = np.r_[np.asarray(sub, np.int64), np.full(int(normal.sum()), MIN_ROWS_TO_SPLIT - 1)]
        still_held = {h for held in self._held.values() for h in held}
        newly_held = [h for h in newly_held if h in still_held]  # the rest were released above
        emission = np.lexsort((all_sub, all_emit))
        emitted, cls, wth = all_handles[emission], all_classes[emission], all_within[emission]
        split = self._split_of(cls, wth)
        return emitted, split, self._deal(split), newly_held

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows of classes that ended with fewer than 3 rows: all train, in row order."""
        rest = np.array(sorted(h for held in self._held.values() for h in held), dtype=np.int64)
        self._held.clear()
        split = np.full(len(rest), TRAIN, np.int8)
        return rest, split, self._deal(split)

    def resume(self, seen: dict[int, int], held: dict[int, list[int]], trained: int) -> None:
        """Continue a stream from its middle (``data_checks.parts``: one part of the source):
        rows seen per class before it, the handles still held per class (in row order), and the
        train rows dealt before it. What follows is assigned as if the earlier rows had passed
        through this assigner."""
        self._seen = dict(seen)
        self._held = {c: list(h) for c, h in held.items() if h}
        self._trained = trained

    def held(self) -> dict[int, list[int]]:
        """The handles held back so far, per class, in row order (a class's first rows)."""
        return {c: list(h) for c, h in self._held.items()}

    @property
    def trained(self) -> int:
        return self._trained

    def split_at(self, class_id: int, within: int) -> int:
        """The split of a class's row number ``within`` (in a class of at least 3 rows)."""
        return int(self._split_of(np.array([class_id], np.int64), np.array([within], np.int64))[0])

    def train_rows(self, class_id: int, start: int, stop: int) -> int:
        """How many of a class's rows numbered ``start..stop-1`` (within the class) go to train, without
        the rows: the first block's slots, whole blocks' fixed quota, and the slots of the partial
        blocks at either end. Mapped sharding counts each part's train rows so (``data_checks.parts``)."""
        size, total = self.block.size, 0
        if start < min(stop, size):
            total += int((self._first_block_of(class_id)[start:min(stop, size)] == TRAIN).sum())
        start = max(start, size)
        if start >= stop:
            return total
        whole_from, whole_to = -(-start // size), stop // size
        ends = [(start, stop)] if whole_from >= whole_to else [(start, whole_from * size), (whole_to * size, stop)]
        for a, b in ends:
            if a < b:
                within = np.arange(a, b, dtype=np.int64)
                total += int((self._split_of(np.full(len(within), class_id, np.int64), within) == TRAIN).sum())
        if whole_from < whole_to:
            total += (whole_to - whole_from) * (size - self.block.test - self.block.val)
        return total

    def _split_of(self, classes: np.ndarray, within: np.ndarray) -> np.ndarray:
        size = self.block.size
        out = np.empty(len(classes), np.int8)
        blocks = within // size
        first = blocks == 0
        for i in np.flatnonzero(first):
            out[i] = self._first_block_of(int(classes[i]))[within[i]]
        rest = np.flatnonzero(~first)
        if len(rest):
            # One permutation per (class, block) pair present; both packed into one int64 key.
            pairs, inverse = np.unique((classes[rest].astype(np.int64) << 40) | blocks[rest], return_inverse=True)
            pair_classes, which = np.unique(pairs >> 40, return_inverse=True)
            base = np.array([self._class_base(int(c)) for c in pair_classes], dtype=np.uint64)[which.ravel()]
            perms = _permutations(base, pairs & ((1 << 40) - 1), size)
            slots = perms[inverse.ravel(), within[rest] % size]
            out[rest] = self.block.template()[slots]
        return out

    def _class_base(self, class_id: int) -> int:
        return int(mix64(np.uint64(self._keys[class_id]) ^ mix64(np.uint64(self.seed))))

    def _first_block_of(self, class_id: int) -> np.ndarray:
        """A class's first block: train/val/test in random order, then the rest of the quota."""
        if class_id not in self._first_block:
            key = self._keys[class_id]
            rng = np.random.default_rng([self.seed, key & 0xFFFFFFFF, key >> 32])
            b = self.block
            head = rng.permutation(np.array([TRAIN, VAL, TEST], np.int8))
            tail = np.array([TEST] * (b.test - 1) + [VAL] * (b.val - 1) + [TRAIN] * (b.size - b.test - b.val - 1),
                            np.int8)
            self._first_block[class_id] = np.r_[head, rng.permutation(tail)].astype(np.int8)
        return self._first_block[class_id]

    def _deal(self, split: np.ndarray) -> np.ndarray:
        shard = np.full(len(split), -1, np.int64)
        train = np.flatnonzero(split == TRAIN)
        if len(train) == 0:
            return shard
        n = self.num_train_shards
        t = self._trained + np.arange(len(train))
        self._trained += len(train)
        blocks, pos = t // n, t % n
        uniq, inverse = np.unique(blocks, return_inverse=True)
        seed_key = np.full(len(uniq), mix64(np.uint64(self.seed) + _GOLDEN), dtype=np.uint64)
        perms = _permutations(seed_key, uniq, n)
        shard[train] = perms[inverse.ravel(), pos]
        return shard


def expected_bounds(n: int, block: SplitBlock) -> dict[str, tuple[int, int]]:
    """The count bounds the docstring promises for one class of ``n >= 3`` rows."""
    full = n // block.size
    return {"test": (max(1, full * block.test), full * block.test + block.test),
            "val": (max(1, full * block.val), full * block.val + block.val)}


def split_summary(block: SplitBlock) -> dict[str, Any]:
    return {"block": block.size, "test_per_block": block.test, "val_per_block": block.val,
            "rule": "per-class seeded blocks; first 3 rows of a class take train/val/test; "
                    "classes under 3 rows go to train; train dealt to shards in seeded blocks",
            "exact_fractions": {"test": block.test / block.size, "val": block.val / block.size},
            "min_rows_to_split": MIN_ROWS_TO_SPLIT}
