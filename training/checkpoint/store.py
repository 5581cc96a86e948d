"""Checkpoints are committed, never assumed.

Layout: ``{prefix}/step-{NNNNNNNN}/`` with the data files (model params, train state) written
first and ``MANIFEST.json`` (names, sizes, sha256) written last with a conditional write, so a
duplicate writer cannot overwrite a committed checkpoint. A folder without a manifest, or whose
bytes do not match it, does not exist as far as restore is concerned. Retention keeps the newest
``keep`` committed checkpoints (plus, with ``keep_every_n_steps`` = M, the oldest committed one
of every window of M steps, forever, and the step the newest commit's state names as
``keep_step``: the best epoch's checkpoint, which the job exports) and deletes older ones only
after a newer one is committed.

Options (``CheckpointConfig``): server-side encryption headers on every object (``sse``), and
client-side envelope encryption (``training.checkpoint.crypto``); large files go up in parts.
Asynchronous writing is ``training.checkpoint.writer``; what a worker puts in a checkpoint is
``training.checkpoint.state``.
"""
from __future__ import annotations

import json
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from common import storage
from training.checkpoint.crypto import CheckpointKeyError, Envelope

__all__ = ["Checkpoint", "CheckpointKeyError", "CheckpointStore", "CorruptCheckpoint", "KEEP_STEP", "MANIFEST",
           "store_for"]

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
# A train state's step that retention must keep (besides the newest ones): the best epoch's.
# Only the newest commit's counts: when a later epoch becomes the best, the former best ages out.
KEEP_STEP = "keep_step"
MULTIPART_THRESHOLD = 32 << 20
_STEP_DIR = re.compile(r"/step-(\d{8})/")


class CorruptCheckpoint(RuntimeError):
    """A checkpoint's manifest is missing, unreadable, or its bytes do not match."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    uri: str
    files: dict[str, bytes]
    state: dict[str, Any]


class CheckpointStore:
    def __init__(self, prefix: str, keep: int = 3, *, keep_every_n_steps: int = 0,
                 sse: dict[str, str] | None = None, envelope: Envelope | None = None) -> None:
        if keep < 2:
            raise ValueError("keep must be >= 2 so a torn newest checkpoint has a fallback")
        self.prefix = prefix.rstrip("/")
        self.keep = keep
        self.keep_every_n_steps = keep_every_n_steps
        self.sse = dict(sse or {})
        self.envelope = envelope
        # Test hook (training.loop.faults): called after the data files, before the manifest.
        self.before_commit: Any = None

    def step_uri(self, step: int) -> str:
        return storage.join(self.prefix, f"step-{step:08d}")

    def save(self, step: int, files: dict[str, bytes], state: dict[str, Any]) -> str:
        """Write the files, then the state, then commit with the manifest; prune old ones."""
        base = self.step_uri(step)
        payload = dict(files)
        payload["state.json"] = json.dumps(state, sort_keys=True).encode()
        manifest: dict[str, Any] = {"step": step, "created_at": time.time()}
        if self.envelope is not None:
            payload, manifest["encryption"] = self.envelope.seal(payload, _context(step))
        # Hashing runs beside the upload (hashlib releases the GIL on large buffers): the
        # manifest needs the digests only at the end, and hashing 100 MB costs about as much
        # as a fifth of uploading it here.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-sha256") as pool:
            digests = {n: pool.submit(storage.sha256_bytes, d) for n, d in payload.items()}
            for name, data in payload.items():
                storage.put_bytes(storage.join(base, name), data, extra_args=self.sse,
                                  multipart_threshold=MULTIPART_THRESHOLD)
            manifest["files"] = {n: {"bytes": len(d), "sha256": digests[n].result()} for n, d in payload.items()}
        if self.before_commit is not None:
            self.before_commit(step)
        try:
            storage.put_bytes(storage.join(base, MANIFEST), json.dumps(manifest, indent=1).encode(),
                              if_none_match=True, extra_args=self.sse)
        except storage.AlreadyExists:
            # An earlier attempt committed this step before it died (or a retried request
            # whose answer was lost). Keep it if it verifies (a resumed job recomputes the same
            # step); a corrupt one is replaced.
            try:
                self.load(step)
                log.info("checkpoint step %d was already committed by an earlier attempt", step)
                return base
            except CorruptCheckpoint as exc:
                log.warning("replacing corrupt committed checkpoint: %s", exc)
                storage.delete_prefix(base)
                return self.save(step, files, state)
        log.info("checkpoint committed: step %d at %s", step, base)
        self.prune(pinned=state.get(KEEP_STEP))
        return base

    def steps(self) -> list[int]:
        """Steps of every checkpoint folder (committed or not), newest first."""
        found = {int(m.group(1)) for u in storage.list_uris(self.prefix) if (m := _STEP_DIR.search(u))}
        return sorted(found, reverse=True)

    def committed_steps(self) -> list[int]:
        return [s for s in self.steps() if storage.exists(storage.join(self.step_uri(s), MANIFEST))]

    def load(self, step: int) -> Checkpoint:
        """Read and verify one checkpoint; raises CorruptCheckpoint on any mismatch."""
        base = self.step_uri(step)
        try:
            manifest = json.loads(storage.get_bytes(storage.join(base, MANIFEST)))
        except FileNotFoundError as exc:
            raise CorruptCheckpoint(f"{base}: no manifest (never committed)") from exc
        except ValueError as exc:
            raise CorruptCheckpoint(f"{base}: unreadable manifest: {exc}") from exc
        files: dict[str, bytes] = {}
        for name, meta in manifest["files"].items():
            try:
                data = storage.get_bytes(storage.join(base, name))
            except FileNotFoundError as exc:
                raise CorruptCheckpoint(f"{base}/{name}: missing") from exc
            if len(data) != meta["bytes"] or storage.sha256_bytes(data) != meta["sha256"]:
                raise CorruptCheckpoint(f"{base}/{name}: size or sha256 does not match the manifest")
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
        ``pinned``), and torn ones older than them. Runs only after a commit, so a newer one always
        exists."""
        committed = self.committed_steps()
        if len(committed) <= self.keep:
            return []
        oldest_kept = committed[self.keep - 1]
        permanent = self.permanent_steps(committed, pinned)
        doomed = [s for s in self.steps() if s < oldest_kept and s not in permanent]
        for step in doomed:
            storage.delete_prefix(self.step_uri(step))
        return doomed


def _context(step: int) -> str:
    return f"step-{step:08d}"


def store_for(prefix: str, ckpt_cfg: Any) -> CheckpointStore:
    """The store a job's ``CheckpointConfig`` describes (SSE headers, encryption key, retention)."""
    from training.checkpoint.crypto import key_from_env

    envelope = None
    if ckpt_cfg.encryption_key_env:
        envelope = Envelope(key_from_env(ckpt_cfg.encryption_key_env), ckpt_cfg.encryption_key_env)
    return CheckpointStore(prefix, keep=ckpt_cfg.keep, keep_every_n_steps=ckpt_cfg.keep_every_n_steps,
                           sse=storage.sse_args(ckpt_cfg.sse, ckpt_cfg.sse_kms_key_id), envelope=envelope)
