"""Checkpoints are committed, never assumed, and a committed one never changes.

Layout: ``{prefix}/step-{NNNNNNNN}/MANIFEST.json`` and the data files (model params, train
state) under a folder unique to the attempt that wrote them, ``step-{NNNNNNNN}/{attempt}/``
(a fresh random id per ``save``). The data files go up first; the manifest (each file's path
relative to the step folder, size and sha256) last, with a conditional write (S3
``If-None-Match: *``, a local ``O_EXCL`` create): of two writers racing on one step (a split
brain, or a retry that reaches a step its dead predecessor committed) exactly one manifest
lands, and it names only its own writer's files, which nobody ever writes again. The loser
deletes its own files (no manifest names them) and keeps the winner's checkpoint. A folder
without a manifest, or whose bytes do not match it, does not exist as far as restore is
concerned; a committed checkpoint that does not verify (damaged at rest) is left as it is and
skipped by restore, never replaced.

Retention keeps the newest ``keep`` committed checkpoints (plus, with ``keep_every_n_steps`` =
M, the oldest committed one of every window of M steps, forever, and the step the newest
commit's state names as ``keep_step``: the best epoch's checkpoint, which the job exports) and
deletes older ones, manifest first, only after a newer one is committed. Files that no manifest
names are garbage: in a committed step they can never become named (its manifest is written), so
they go at once; in a step without a manifest they may be a slower writer's upload in progress,
so they go only once older than ``orphan_grace_s``, and a writer whose upload took longer than
half that gives the commit up (``CommitTooLate``, retried as a new attempt) instead of naming
files that may be gone.

Checkpoints of the earlier layout (data files beside the manifest, no ``path`` in it) still load
and are pruned the same way, so a run started by the previous version resumes.

Options (``CheckpointConfig``): server-side encryption headers on every object (``sse``), and
client-side envelope encryption (``training.checkpoint.crypto``); large files go up in parts.
Asynchronous uploading is ``training.checkpoint.uploader``; what a worker puts in a checkpoint is
``training.checkpoint.state``.
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common import storage
from common.errors import DeterministicError
from common.events import CheckpointCommitted, emit
from training.checkpoint.crypto import CheckpointKeyError, Envelope

__all__ = ["Checkpoint", "CheckpointKeyError", "CheckpointStore", "CommitTooLate", "CorruptCheckpoint", "KEEP_STEP",
           "MANIFEST", "SaveTiming", "StepTaken", "store_for"]

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
# A train state's step that retention must keep (besides the newest ones): the best epoch's.
# Only the newest commit's counts: when a later epoch becomes the best, the former best ages out.
KEEP_STEP = "keep_step"
MULTIPART_THRESHOLD = 32 << 20
# Unnamed files of a step without a manifest are deleted once this much older than the newest
# object under the prefix (both on the storage's clock). An hour is far beyond one upload
# (a request is bounded by botocore at 5 x 120 s) and short enough to bound the garbage.
ORPHAN_GRACE_S = 3600.0
_STEP_DIR = re.compile(r"/step-(\d{8})/")


class CorruptCheckpoint(RuntimeError):
    """A checkpoint's manifest is missing, unreadable, or its bytes do not match."""


class CommitTooLate(RuntimeError):
    """An attempt's upload outlasted half the orphan grace: its files may be collected, so it does
    not commit (the writer retries with a new attempt)."""


class StepTaken(DeterministicError, ValueError):
    """The step is committed by another attempt and that checkpoint does not verify. A committed
    checkpoint never changes, so this step cannot be written (a retry would not help)."""


@dataclass(frozen=True)
class SaveTiming:
    """When the writer's work on one save began (``time.monotonic``), for the durations its
    ``CheckpointCommitted`` event reports (``training.checkpoint.uploader`` makes it).

    ``began``: the upload began (serialising included). The loop's blocked time is either known
    when the upload begins (``blocked_s``: in the background, the loop went on at that moment) or
    still running (``blocked_since``: a synchronous write blocks the loop until it returns)."""

    began: float
    blocked_s: float | None = None
    blocked_since: float | None = None

    def costs(self, now: float) -> dict[str, float | None]:
        blocked = self.blocked_s if self.blocked_since is None else now - self.blocked_since
        return {"upload_s": now - self.began, "blocked_s": blocked}


@dataclass(frozen=True)
class Checkpoint:
    step: int
    uri: str
    files: dict[str, bytes]
    state: dict[str, Any]


class CheckpointStore:
    def __init__(self, prefix: str, keep: int = 3, *, keep_every_n_steps: int = 0,
                 sse: dict[str, str] | None = None, envelope: Envelope | None = None,
                 orphan_grace_s: float = ORPHAN_GRACE_S,
                 before_commit: Callable[[int], None] | None = None) -> None:
        if keep < 2:
            raise ValueError("keep must be >= 2 so a torn newest checkpoint has a fallback")
        self.prefix = prefix.rstrip("/")
        self.keep = keep
        self.keep_every_n_steps = keep_every_n_steps
        self.sse = dict(sse or {})
        self.envelope = envelope
        self.orphan_grace_s = orphan_grace_s
        # Called with the step after its data files are up, before the manifest: a fault plan's
        # writer death between the two (training.loop.faults), a test's slow upload.
        self.before_commit = before_commit

    def step_uri(self, step: int) -> str:
        return storage.join(self.prefix, f"step-{step:08d}")

    def save(self, step: int, files: dict[str, bytes], state: dict[str, Any], *,
             timing: SaveTiming | None = None) -> str:
        """Write the files and the state under a new attempt folder, then commit them with the
        manifest; prune old ones. If the step is already committed, that checkpoint stays.
        ``timing``: what the commit event reports the save cost (none without it)."""
        base = self.step_uri(step)
        attempt = uuid.uuid4().hex[:16]
        payload = dict(files)
        payload["state.json"] = json.dumps(state, sort_keys=True).encode()
        manifest: dict[str, Any] = {"step": step, "created_at": time.time(), "attempt": attempt}
        if self.envelope is not None:
            payload, manifest["encryption"] = self.envelope.seal(payload, _context(step))
        started = time.monotonic()
        # Hashing runs beside the upload (hashlib releases the GIL on large buffers): the
        # manifest needs the digests only at the end, and hashing 100 MB costs about as much
        # as a fifth of uploading it here.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-sha256") as pool:
            digests = {n: pool.submit(storage.sha256_bytes, d) for n, d in payload.items()}
            for name, data in payload.items():
                storage.put_bytes(storage.join(base, attempt, name), data, extra_args=self.sse,
                                  multipart_threshold=MULTIPART_THRESHOLD)
            manifest["files"] = {n: {"path": f"{attempt}/{n}", "bytes": len(d), "sha256": digests[n].result()}
                                 for n, d in payload.items()}
        if self.before_commit is not None:
            self.before_commit(step)
        if time.monotonic() - started > self.orphan_grace_s / 2:
            self._discard(base, attempt)
            raise CommitTooLate(f"{base}/{attempt}: the upload took over {self.orphan_grace_s / 2:.0f}s; "
                                "not committing files that retention may already have collected")
        try:
            storage.put_bytes(storage.join(base, MANIFEST), json.dumps(manifest, indent=1).encode(),
                              if_none_match=True, extra_args=self.sse)
        except storage.AlreadyExists:
            # Another attempt committed this step: an earlier attempt of this job before it died
            # (a resumed job recomputes the same step), a retried request whose answer was lost,
            # or a second writer on the prefix. Its checkpoint stays as it is.
            self._discard(base, attempt)
            try:
                self.load(step)
            except CorruptCheckpoint as exc:
                raise StepTaken(f"step {step} is committed by another attempt and does not verify ({exc}); "
                                "a committed checkpoint is never replaced") from exc
            log.info("checkpoint step %d was already committed by another attempt; keeping it", step)
            return base
        log.info("checkpoint committed: step %d at %s/%s", step, base, attempt)
        costs = timing.costs(time.monotonic()) if timing is not None else {}
        emit(CheckpointCommitted(step=step, uri=f"{base}/{attempt}", bytes=sum(len(d) for d in payload.values()),
                                 **costs))
        self.prune(pinned=state.get(KEEP_STEP))
        return base

    def _discard(self, base: str, attempt: str) -> None:
        """Delete one attempt's data files (never named by a manifest: its own was not written)."""
        storage.delete_uris(list(storage.list_uris(storage.join(base, attempt))))

    def steps(self) -> list[int]:
        """Steps of every checkpoint folder (committed or not), newest first."""
        found = {int(m.group(1)) for u in storage.list_uris(self.prefix) if (m := _STEP_DIR.search(u))}
        return sorted(found, reverse=True)

    def committed_steps(self) -> list[int]:
        return [s for s in self.steps() if storage.exists(storage.join(self.step_uri(s), MANIFEST))]

    def manifest(self, step: int) -> dict[str, Any]:
        """One step's manifest; raises CorruptCheckpoint if it is missing or unreadable."""
        base = self.step_uri(step)
        try:
            manifest = json.loads(storage.get_bytes(storage.join(base, MANIFEST)))
        except FileNotFoundError as exc:
            raise CorruptCheckpoint(f"{base}: no manifest (never committed)") from exc
        except ValueError as exc:
            raise CorruptCheckpoint(f"{base}: unreadable manifest: {exc}") from exc
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise CorruptCheckpoint(f"{base}: unreadable manifest: no files")
        return manifest

    def file_uri(self, step: int, name: str) -> str:
        """Where a committed checkpoint's file ``name`` is, as its manifest names it."""
        return _file_uri(self.step_uri(step), name, self.manifest(step)["files"][name])

    def load(self, step: int) -> Checkpoint:
        """Read and verify one checkpoint; raises CorruptCheckpoint on any mismatch."""
        base = self.step_uri(step)
        manifest = self.manifest(step)
        files: dict[str, bytes] = {}
        for name, meta in manifest["files"].items():
            uri = _file_uri(base, name, meta)
            try:
                data = storage.get_bytes(uri)
            except FileNotFoundError as exc:
                raise CorruptCheckpoint(f"{uri}: missing") from exc
            if len(data) != meta["bytes"] or storage.sha256_bytes(data) != meta["sha256"]:
                raise CorruptCheckpoint(f"{uri}: size or sha256 does not match the manifest")
            files[name] = data
        if "encryption" in manifest:
            if self.envelope is None:
                raise CheckpointKeyError(f"{base} is encrypted but no key is configured "
                                         "(checkpoint.encryption_key_env)")
            files = self.envelope.open(files, manifest["encryption"], _context(step), base)
        state = json.loads(files.pop("state.json"))
        return Checkpoint(step=step, uri=base, files=files, state=state)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies; torn or corrupt ones are skipped and logged."""
        for step in self.steps():
            try:
                ckpt = self.load(step)
            except CorruptCheckpoint as exc:  # a wrong key (CheckpointKeyError) is not skipped
                log.warning("skipping checkpoint: %s", exc)
                continue
            log.info("restoring checkpoint step %d from %s", step, ckpt.uri)
            return ckpt
        log.info("no valid checkpoint under %s: starting fresh", self.prefix)
        return None

    def permanent_steps(self, committed: list[int], pinned: int | None = None) -> set[int]:
        """With ``keep_every_n_steps`` = M: the oldest committed step of every window of M steps;
        and ``pinned`` (the best epoch's step) if it is committed."""
        kept = {pinned} & set(committed) if pinned is not None else set()
        m = self.keep_every_n_steps
        if not m:
            return kept
        oldest: dict[int, int] = {}
        for step in committed:
            oldest[step // m] = min(step, oldest.get(step // m, step))
        return kept | set(oldest.values())

    def prune(self, pinned: int | None = None) -> list[int]:
        """Delete committed checkpoints beyond the newest ``keep`` (sparing the permanent ones and
        ``pinned``),
        manifest first, and the files no manifest names (see the module docstring). Runs only
        after a commit, so a newer one always exists. Returns the steps deleted whole."""
        objects: dict[int, dict[str, float]] = defaultdict(dict)
        for uri, mtime in storage.list_objects(self.prefix):
            if m := _STEP_DIR.search(uri):
                objects[int(m.group(1))][uri] = mtime
        if not objects:
            return []
        now = max(t for step_objects in objects.values() for t in step_objects.values())
        committed = sorted((s for s in objects if storage.join(self.step_uri(s), MANIFEST) in objects[s]),
                           reverse=True)
        permanent = self.permanent_steps(committed, pinned)
        oldest_kept = committed[self.keep - 1] if len(committed) > self.keep else None
        doomed = [s for s in committed if oldest_kept is not None and s < oldest_kept and s not in permanent]
        for step in doomed:
            # The manifest first: a half-deleted checkpoint is then uncommitted, not corrupt.
            storage.delete_uris([storage.join(self.step_uri(step), MANIFEST)])
            storage.delete_uris(list(objects.pop(step)))
        for step, step_objects in objects.items():
            storage.delete_uris(self._garbage(step, step_objects, now))
        return doomed

    def _garbage(self, step: int, step_objects: dict[str, float], now: float) -> list[str]:
        """The files of one step folder that no manifest names and that may go now."""
        base = self.step_uri(step)
        manifest_uri = storage.join(base, MANIFEST)
        if manifest_uri not in step_objects:
            return [u for u, t in step_objects.items() if now - t > self.orphan_grace_s]
        attempts = {u[len(base) + 1:].rpartition("/")[0] for u in step_objects if u != manifest_uri}
        if len(attempts) <= 1:  # one attempt's files (or the earlier layout's): the committed ones
            return []
        try:
            named = {_file_uri(base, n, meta) for n, meta in self.manifest(step)["files"].items()}
        except CorruptCheckpoint as exc:  # unreadable: nothing here can be told apart, keep it all
            log.warning("not collecting garbage of %s: %s", base, exc)
            return []
        return [u for u in step_objects if u != manifest_uri and u not in named]


def _file_uri(base: str, name: str, meta: dict[str, Any]) -> str:
    # Checkpoints written before attempt folders have no "path": their files sit beside the manifest.
    return storage.join(base, meta.get("path", name))


def _context(step: int) -> str:
    return f"step-{step:08d}"


def store_for(prefix: str, ckpt_cfg: Any, *, before_commit: Callable[[int], None] | None = None) -> CheckpointStore:
    """The store a job's ``CheckpointConfig`` describes (SSE headers, encryption key, retention);
    ``before_commit`` as for ``CheckpointStore``."""
    from training.checkpoint.crypto import key_from_env

    envelope = None
    if ckpt_cfg.encryption_key_env:
        envelope = Envelope(key_from_env(ckpt_cfg.encryption_key_env), ckpt_cfg.encryption_key_env)
    return CheckpointStore(prefix, keep=ckpt_cfg.keep, keep_every_n_steps=ckpt_cfg.keep_every_n_steps,
                           sse=storage.sse_args(ckpt_cfg.sse, ckpt_cfg.sse_kms_key_id), envelope=envelope,
                           before_commit=before_commit)
