"""Chaos R3 (run by ``benchmarks/chaos.py``): the S3 server stopped mid-run and restarted on the
same ports and data folder ``outage_s`` later; the job must carry on and finish, every kept
checkpoint must verify, and a checkpoint upload pending in the outage must commit after it.
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import chaos_jobs as cj
from benchmarks.chaos import OUTAGE_WAIT_S, Trial, _echo, _shard
from training.config import TrainConfig


def r3(stack: cj.ChaosStack, root: Path, cfg: TrainConfig, outage_s: float, copies: int = 20) -> Trial:
    """S3 down for ``outage_s`` mid-run, then back on the same ports and data folder.

    The dataset is ``copies`` jittered copies of digits (about 400 steps an epoch), so that the
    job is still training when the outage starts and ends. The outage starts once the first
    checkpoint is committed; it is counted from the moment the server's process group is gone
    (a graceful stop takes seconds, while it still answers) to the moment its restart begins.
    """
    shards = _shard(stack, cfg, f"r3-digits-x{copies}", copies)
    job = cj.job_for(cfg.replace(optim={"epochs": 2}, cluster={"stall_timeout_s": 300.0}), shards,
                     f"s3://{stack.bucket}/chaos/r3")
    work = root / "r3"
    outage: dict[str, float] = {}
    errors: list[BaseException] = []

    def cut() -> None:
        try:
            events = work / "attempt-0" / "events.jsonl"
            deadline = time.monotonic() + OUTAGE_WAIT_S
            while time.monotonic() < deadline:
                if events.exists() and "checkpoint committed: step" in events.read_text():
                    break
                time.sleep(0.2)
            else:
                raise TimeoutError("R3: no checkpoint committed before the outage was due")
            outage["stop"] = time.time()
            stack.stop()
            outage["down"] = time.time()
            time.sleep(outage_s)
            outage["restart"] = time.time()
            stack.start()
            outage["back"] = time.time()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    cutter = threading.Thread(target=cut, name="s3-outage", daemon=True)
    cutter.start()
    run = cj.run_attempt(job, work)
    cutter.join(timeout=OUTAGE_WAIT_S + outage_s + 300)
    return _r3_trial(job, run, outage, errors, outage_s)


_STEP = re.compile(r"(?:global_step=|at step |committed: step )(\d+)")


def _r3_trial(job: Any, run: cj.Attempt, outage: dict[str, float], errors: list[BaseException],
              outage_s: float) -> Trial:
    down, restart, back = outage.get("down", 0.0), outage.get("restart", 0.0), outage.get("back", float("inf"))
    failed_uploads = {int(e["text"].split("upload at step ")[1].split()[0]) for e in run.lines("upload at step ")}
    committed = {int(e["text"].split("committed: step ")[1].split()[0]): e["t"]
                 for e in run.lines("checkpoint committed: step ")}
    steps = [(e["t"], int(m.group(1))) for e in run.events if e["event"] == "line" and (m := _STEP.search(e["text"]))]
    before = max((s for t, s in steps if t <= down), default=None)
    during = [s for t, s in steps if down < t < restart]
    facts = cj.store_facts(job) if not errors else {"committed": [], "torn": [], "latest_valid": None}
    verified = all(_verifies(job, s) for s in facts["committed"])
    stats = next((e["text"] for e in reversed(run.lines("checkpoint stats: "))), "")
    after = [t for t in committed.values() if t >= back]
    # From the restart, not from start() returning: S3 answers (and the pending upload commits)
    # a second or two before the bucket check inside start() is done.
    first_after = min((s for s, t in committed.items() if t >= restart), default=None)
    trial = Trial("R3", f"S3 stopped {outage_s:.0f}s mid-run", {
        "outage happened mid-run": not errors and "back" in outage and before is not None and bool(after),
        "training went on while S3 was down": before is not None and max(during, default=-1) > before,
        "nothing committed while S3 was down": not [t for t in committed.values() if down < t < restart],
        "job finished": run.failed is None,
        # The outage is absorbed either by botocore's own retries (the upload blocks until S3 is
        # back: a short outage, --quick's 10 s) or by the uploader's backoff (a failed upload is
        # logged and retried: a longer one). Either way the checkpoint pending while S3 was down must
        # be committed after it is back; requiring an uploader retry made every short outage fail.
        # (Async: one upload in flight, so the pending one may have been taken just before it.)
        "an upload pending in the outage committed after it": first_after is not None
        and max(during, default=-1) >= first_after,
        "every retried upload committed": failed_uploads <= set(committed),
        "no checkpoint given up": "'failed': 0" in stats,
        "final checkpoint committed": bool(facts["committed"]) and facts["latest_valid"] == facts["committed"][0]
        and cj.final_step(job) == facts["committed"][0],
        "every kept checkpoint verifies": verified and not facts["torn"],
        "no orphan process": not run.orphans,
    }, recovery_s=(min(after) - back) if after else None)
    trial.details.update({"outage": outage, "outage_s": restart - down if restart else None,
                          "step_at_outage": before, "last_step_during_outage": max(during, default=None),
                          "failed_uploads": sorted(failed_uploads), "first_commit_after": first_after,
                          "absorbed_by": "uploader retries" if failed_uploads else "S3 client retries",
                          "stats": stats,
                          "retry_lines": [e["text"][-120:] for e in run.lines("retrying in")],
                          "store": facts, "errors": [repr(e) for e in errors],
                          "error": (run.failed or "")[-2000:] or None, "attempt_s": round(run.seconds, 2)})
    _echo(trial)
    return trial


def _verifies(job: Any, step: int) -> bool:
    from training.checkpoint import store_for

    try:
        store_for(job.checkpoint_prefix, job.config.checkpoint).load(step)
        return True
    except Exception:  # noqa: BLE001 - a checkpoint that does not load does not verify
        return False
