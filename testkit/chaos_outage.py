"""Chaos scenario R3: the S3 server dies mid-training and comes back ``outage_s`` later.

The outage starts at an exact training step, not at a clock time: rank 0's fault hook
(``MXPIPE_FAULT_KILL_STEP`` with ``MXPIPE_FAULT_KILL_PID_FILE`` holding ``-PGID``) SIGKILLs the
SeaweedFS process group right after that step, the way a crashed host or a dropped network
looks to a client (connections refused at once, nothing flushed or closed politely). A graceful
stop is not an outage: it took about 12 s here while the server still answered, long enough
for a short job to reach its epoch end first. The harness sees the hook's once-file, reaps the
dead group, and restarts the server on the same ports over the same data folder
``outage_s`` after the kill.

The kill step is a multiple of the checkpoint cadence, so the checkpoint of that very step is
the one in flight when S3 disappears: its upload fails within about a second (the writer's
requests fail fast, ``common.storage.fail_fast``; botocore's own retries would take 12-31 s and
could outlast the outage silently) and the checkpoint writer retries it with backoff until S3
is back. The epoch is long enough that the loop trains through the whole outage,
skipping the periodic checkpoints that fall due while that one is in flight: ``copies``
jittered copies of digits, and every step slowed by ``STEP_DELAY_S`` (``MXPIPE_FAULT_STEP_DELAY_S``,
a sleep that leaves the arithmetic alone; the tiny MLP otherwise runs about 150 steps/s here
and its whole epoch fits in 5 s of the outage). Retention is wide enough that every checkpoint
the job committed is still there at the end, so each can be verified. The reference run, at
full speed, has no outage and no delay.

Checks: the outage started at the chosen step and lasted ``outage_s``; steps were trained
during it, up to its last seconds; nothing was committed while S3 was down; an upload failed
and was retried, and every retried one was committed; no checkpoint was given up; the job
finished; every committed step (from the log) is in the store and verifies, none is torn, the
newest is the final step; optionally the final parameters equal an uninterrupted run's
(``reference``); no role process is left.
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

from testkit import chaos
from testkit import chaos_jobs as cj
from common.config import TrainConfig

OUTAGE_WAIT_S = 300.0  # bound on waiting for the job to reach the kill step
KILL_AT_CHECKPOINT = 5  # the outage starts at the 5th checkpoint step (4 committed before it)
LATE_FRACTION = 0.25  # "up to its last seconds": a step logged in the outage's last quarter
STEP_DELAY_S = 0.15  # 20 copies: about 390 steps, so 50+ s of training after the kill step
# Lines that show the loop at a step: progress lines and skipped periodic checkpoints (not the
# writer's retry warnings, which name the step of the upload in flight).
_STEP = re.compile(r"global_step=(\d+)|checkpoint at step (\d+) skipped")


def r3_config(cfg: TrainConfig) -> TrainConfig:
    """One long epoch, a checkpoint every 10 steps, every checkpoint kept (tiny MLP: kilobytes)."""
    # Stall bound: rank 0 goes quiet only at the epoch end, if the retried upload has not landed.
    return cfg.replace(optim={"epochs": 1}, checkpoint={"every_n_steps": 10, "keep": 200},
                       cluster={"stall_timeout_s": 180.0})


def r3(stack: cj.ChaosStack, root: Path, cfg: TrainConfig, outage_s: float, copies: int = 20,
       reference: bool = False, cluster: Any = None) -> chaos.Trial:
    """The outage on a job of local roles, or of ``cluster``'s (the hosts backend: roles on
    namespace hosts that reach S3 over their links)."""
    cfg = r3_config(cfg)
    shards = chaos.shard_copies(stack, cfg, f"r3-digits-x{copies}", copies)
    job = cj.job_for(cfg, shards, f"s3://{stack.bucket}/chaos/r3")
    work = root / "r3"
    work.mkdir(parents=True, exist_ok=True)
    kill_step = KILL_AT_CHECKPOINT * cfg.checkpoint.every_n_steps
    pgid_file = work / "s3.pgid"
    pgid_file.write_text(f"-{stack.handle.pgid}")  # negative: kill(2) signals the whole group
    outage: dict[str, float] = {}
    errors: list[BaseException] = []

    def outage_then_restart() -> None:
        try:
            fired = work / "fault-fired"
            deadline = time.monotonic() + OUTAGE_WAIT_S
            while not fired.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"R3: the job did not reach step {kill_step}")
                time.sleep(0.05)
            outage["down"] = fired.stat().st_mtime  # created by the hook just before its kill
            stack.stop()  # the group is already dead: reap it, check nothing of it is left
            time.sleep(max(0.0, outage["down"] + outage_s - time.time()))
            outage["restart"] = time.time()
            stack.start()
            outage["back"] = time.time()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    env = {"MXPIPE_FAULT_KILL_STEP": str(kill_step), "MXPIPE_FAULT_KILL_RANK": "0",
           "MXPIPE_FAULT_KILL_PID_FILE": str(pgid_file), "MXPIPE_FAULT_STEP_DELAY_S": str(STEP_DELAY_S)}
    cutter = threading.Thread(target=outage_then_restart, name="s3-outage", daemon=True)
    cutter.start()
    run = cj.run_attempt(job, work, env=env, cluster=cluster)
    cutter.join(timeout=OUTAGE_WAIT_S + outage_s + 300)
    if stack.handle is None and not errors:  # the job ended before the restart: bring S3 back
        stack.start()
    ref_params = None
    if reference and run.failed is None:
        ref_job = cj.job_for(cfg, shards, f"s3://{stack.bucket}/chaos/r3-reference")
        ref = cj.run_attempt(ref_job, root / "r3-reference")
        ref_params = None if ref.failed else cj.final_params(ref_job)[1]
    return _trial(job, run, outage, errors, outage_s, kill_step, ref_params)


def _trial(job: Any, run: cj.Attempt, outage: dict[str, float], errors: list[BaseException], outage_s: float,
           kill_step: int, ref_params: dict[str, Any] | None) -> chaos.Trial:
    down, restart = outage.get("down", 0.0), outage.get("restart", 0.0)
    back = outage.get("back", float("inf"))
    failed_uploads = {int(e["text"].split("upload at step ")[1].split()[0]) for e in run.lines("upload at step ")}
    committed = {int(e["text"].split("committed: step ")[1].split()[0]): e["t"]
                 for e in run.lines("checkpoint committed: step ")}
    steps = [(e["t"], int(m.group(1) or m.group(2))) for e in run.events
             if e["event"] == "line" and (m := _STEP.search(e["text"]))]
    during = [s for t, s in steps if down < t < restart]
    late = [s for t, s in steps if restart - LATE_FRACTION * outage_s < t < restart]
    facts = cj.store_facts(job) if not errors else {"committed": [], "torn": [], "latest_valid": None}
    unverified = [s for s in facts["committed"] if not _verifies(job, s)]
    stats = next((e["text"] for e in reversed(run.lines("checkpoint stats: "))), "")
    final = cj.final_step(job)
    checks = {
        "outage started at the kill step": not errors and run.fault_at is not None and "back" in outage,
        f"outage lasted {outage_s:.0f}s": restart - down >= outage_s,
        "training went on while S3 was down": max(during, default=-1) > kill_step,
        "still training in the outage's last quarter": bool(late) and min(late) > kill_step,
        "nothing committed while S3 was down": not [t for t in committed.values() if down < t < restart],
        "an upload failed and was retried": kill_step in failed_uploads and bool(run.lines("retrying in")),
        "every retried upload committed": bool(failed_uploads) and failed_uploads <= set(committed),
        "no checkpoint given up": "'failed': 0" in stats,
        "job finished": run.failed is None,
        "every committed step is stored and verifies": bool(committed) and set(committed) == set(facts["committed"])
        and not unverified and not facts["torn"],
        "final checkpoint committed": final is not None and facts["latest_valid"] == final == max(committed, default=-1),
        "no orphan process": not run.orphans,
    }
    diff = None
    if ref_params is not None:
        diff = cj.max_abs_diff(cj.final_params(job)[1], ref_params) if run.failed is None else float("inf")
        checks[f"params within {chaos.EXACT_ATOL:g} of an uninterrupted run"] = diff <= chaos.EXACT_ATOL
    after = [t for t in committed.values() if t >= back]
    trial = chaos.Trial("R3", f"S3 killed at step {kill_step} for {outage_s:.0f}s", checks,
                        recovery_s=(min(after) - back) if after else None, max_abs_diff=diff)
    trial.details.update({
        "outage": outage, "outage_s": restart - down if restart else None, "kill_step": kill_step,
        "steps_during_outage": [min(during, default=None), max(during, default=None)],
        "last_step_logged_late_in_outage": max(late, default=None), "failed_uploads": sorted(failed_uploads),
        "committed": len(committed), "stats": stats, "retry_lines": [e["text"][-120:] for e in run.lines("retrying in")],
        "store": {k: v for k, v in facts.items() if k != "steps"}, "unverified": unverified,
        "errors": [repr(e) for e in errors], "error": (run.failed or "")[-2000:] or None,
        "attempt_s": round(run.seconds, 2)})
    chaos.echo(trial)
    return trial


def _verifies(job: Any, step: int) -> bool:
    from training.checkpoint.store import store_for

    try:
        store_for(job.checkpoint_prefix, job.config.checkpoint).load(step)
        return True
    except Exception:  # noqa: BLE001 - a checkpoint that does not load does not verify
        return False

