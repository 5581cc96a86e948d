"""What a run's supervisor event log (``MXPIPE_EVENTS_FILE``) says about failures and goodput.

Pure arithmetic on the recorded events (``training/launch/launcher.py`` writes them: ``job_start``,
``roles_started``, every role ``line`` with the time it arrived, ``role_failed``,
``roles_stopped``, ``roles_restarting``), so it is unit-tested on a recorded file (tests/unit/test_goodput.py). Of the
role lines it reads the workers' events only (``common.events.parse_event``), never their human text.

**One failure** (``failure_timeline``), from the kill time on: detect (→ the supervisor's
``role_failed``), teardown (→ every role of the attempt stopped), retry (→ the next attempt's
start: the supervisor's ``roles_restarting`` after a restart in place, at once; a new
supervisor's ``job_start`` after an Airflow retry, its delay plus the task's start), cluster start (→ worker-0's
``worker_started``: the new roles imported mxnet and met in ps-lite), restore (→ the first
``resumed`` event, from step R: shards fetched, model built, checkpoint verified and loaded),
first step (→ the first step after the resume done, by default worker-0's
``first_step_after_resume`` event).

An attempt is one round of roles: from a ``job_start`` or a ``roles_restarting`` to the next.

**Goodput** (``goodput``) = productive training time ÷ wall time, where
- wall time runs from the first attempt's ``job_start`` to worker-0's last step mark of the last
  attempt (the final step; the export and the tasks around ``train`` are not training);
- an attempt's step marks are worker-0's ``progress`` events (every 5 s), its
  ``first_step_after_resume`` and its ``epoch_done`` events (their global step), each
  at the time the supervisor received it; between marks the time of a step is interpolated
  linearly, beyond them extrapolated at the attempt's mean seconds per step;
- productive time is the wall time of the steps that were kept: in an attempt that resumed from
  step R (0 for a fresh start) and whose work was kept up to step K (the step the next attempt
  resumed from; the final step for the last attempt), the time from step R+1 done to step K done,
  plus one mean step for step R+1 itself. Startup (role start, rendezvous, data, model build),
  restore, the first step's warm-up beyond a mean step, and every step that a later attempt
  trained again are therefore not productive. Periodic and epoch-end checkpoints and the epoch
  end's evaluation inside the kept range are (training as it runs without failures).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common import events as role_events

Event = dict[str, Any]
Pred = Callable[[Event], bool]

TERMS = ("detect", "teardown", "retry", "cluster_start", "restore", "first_step", "total")
LEAD = "worker-0"
# The role events that mark a step reached (their global_step), read from the lead role only.
_STEP_MARKS = (role_events.Progress, role_events.FirstStepAfterResume, role_events.EpochDone)
# The supervisor's events that start an attempt: a new supervisor, or a restart in place.
ATTEMPT_STARTS = ("job_start", "roles_restarting")


def _starts_attempt(ev: Event) -> bool:
    return ev["event"] in ATTEMPT_STARTS


def role_event_of(ev: Event) -> Any:
    """The role event (``common.events``) a recorded ``line`` carries, or None."""
    return role_events.parse_event(ev["text"]) if ev["event"] == "line" else None


def first_event(events: Sequence[Event], pred: Pred, after: float) -> Event:
    for ev in events:
        if ev["t"] >= after and pred(ev):
            return ev
    raise RuntimeError("event not found after %.3f" % after)


def role_event(kind: type, role: str | None = None, **fields: Any) -> Pred:
    """A predicate: a role's line (of ``role``, or any role) carrying a ``kind`` event
    (``common.events``) whose ``fields`` have the values given."""
    def pred(e: Event) -> bool:
        if role is not None and e.get("role") != role:
            return False
        got = role_event_of(e)
        return isinstance(got, kind) and all(getattr(got, k) == v for k, v in fields.items())
    return pred


def first_step_event(resumed: int) -> Pred:
    """The first-step mark the soak uses: worker-0's event once step ``resumed + 1`` is computed."""
    return role_event(role_events.FirstStepAfterResume, LEAD, global_step=resumed + 1)


def failure_timeline(events: Sequence[Event], kill_t: float,
                     first_step: Callable[[int], Pred] = first_step_event) -> dict[str, float]:
    """The terms of one failure's recovery (module docstring), in seconds, and the resume step."""
    failed = first_event(events, lambda e: e["event"] == "role_failed", kill_t)
    stopped = first_event(events, lambda e: e["event"] == "roles_stopped", failed["t"])
    start2 = first_event(events, _starts_attempt, stopped["t"])
    joined = first_event(events, role_event(role_events.WorkerStarted, LEAD), start2["t"])
    resumed = first_event(events, role_event(role_events.Resumed), joined["t"])
    step = role_event_of(resumed).step
    first = first_event(events, first_step(step), resumed["t"])
    marks = [kill_t, failed["t"], stopped["t"], start2["t"], joined["t"], resumed["t"], first["t"]]
    out = {name: marks[i + 1] - marks[i] for i, name in enumerate(TERMS[:-1])}
    out["total"] = first["t"] - kill_t
    out["resumed_from_step"] = step
    out["failed_role"] = failed.get("role", "")
    return out


@dataclass
class Attempt:
    """One round of the run's roles (from a ``job_start`` or ``roles_restarting``) as its step marks show it."""

    start: float
    end: float  # the next attempt's start, or the last event
    resumed_from: int  # 0 for a fresh start
    points: list[tuple[float, int]]  # (time, global step) of worker-0's step marks
    # (time, step) of the checkpoints the attempt committed: the step was reached before that time
    # (a commit comes an upload later than its step, so it bounds the step from below, no more).
    committed: list[tuple[float, int]] = field(default_factory=list)

    def seconds_per_step(self) -> float | None:
        if len(self.points) < 2 or self.points[-1][1] == self.points[0][1]:
            return None
        return (self.points[-1][0] - self.points[0][0]) / (self.points[-1][1] - self.points[0][1])

    def time_at(self, step: float, spp: float) -> float:
        """When ``step`` was (or would have been) done: interpolated between marks, extrapolated beyond."""
        pts = self.points
        if step <= pts[0][1]:
            return pts[0][0] - (pts[0][1] - step) * spp
        for (t0, s0), (t1, s1) in zip(pts, pts[1:]):
            if s0 <= step <= s1 and s1 > s0:
                return t0 + (step - s0) / (s1 - s0) * (t1 - t0)
        return pts[-1][0] + (step - pts[-1][1]) * spp

    def step_at(self, t: float, spp: float) -> float:
        """The step reached at time ``t``: interpolated between the marks around it (extrapolated
        after the last), never less than a mark or a checkpoint committed before ``t``."""
        floor = max([float(self.resumed_from)] + [s for ts, s in self.points + self.committed if ts <= t])
        before = [(ts, s) for ts, s in self.points if ts <= t]
        if not before:
            return floor
        ts, s = before[-1]
        after = [(t1, s1) for t1, s1 in self.points if t1 > t]
        if after:
            t1, s1 = after[0]
            return max(floor, s + (t - ts) / (t1 - ts) * (s1 - s))
        return max(floor, s + (t - ts) / spp)

    def productive_s(self, kept: int, spp: float) -> float:
        """Wall time of the steps ``resumed_from + 1 … kept`` (module docstring)."""
        if not self.points or kept <= self.resumed_from:
            return 0.0
        return max(0.0, self.time_at(kept, spp) - self.time_at(self.resumed_from + 1, spp) + spp)


def attempts(events: Sequence[Event]) -> list[Attempt]:
    """The run's attempts in order, each with its resume step and worker-0's step marks."""
    starts = [i for i, e in enumerate(events) if _starts_attempt(e)]
    out = []
    for n, i in enumerate(starts):
        chunk = events[i:starts[n + 1]] if n + 1 < len(starts) else events[i:]
        resumed, points, committed = 0, [], []
        for ev in chunk:
            got = role_event_of(ev)
            if isinstance(got, role_events.Resumed) and resumed == 0:
                resumed = got.step
            if isinstance(got, _STEP_MARKS) and ev["role"] == LEAD:
                points.append((ev["t"], got.global_step))
            if isinstance(got, role_events.CheckpointCommitted):
                committed.append((ev["t"], got.step))
        out.append(Attempt(start=chunk[0]["t"], end=chunk[-1]["t"], resumed_from=resumed, points=points,
                           committed=committed))
    return out


def cadence_plans(events: Sequence[Event]) -> list[str]:
    """Rank 0's ``checkpoint cadence (auto)`` choices (``training.checkpoint.cadence``), in order."""
    mark = "checkpoint cadence (auto)"
    return [e["text"].split(mark, 1)[1].lstrip(":, ") for e in events
            if e["event"] == "line" and e["role"] == LEAD and mark in e["text"]]


def goodput(events: Sequence[Event], kill_times: Sequence[float]) -> dict[str, Any]:
    """Goodput of the run and one record per kill (the timeline, steps recomputed, time lost)."""
    runs = attempts(events)
    if not runs or not runs[-1].points:
        raise RuntimeError("the event log has no attempt with step marks: did the job train?")
    rates = [r for a in runs if (r := a.seconds_per_step()) is not None]
    median_spp = statistics.median(rates)
    spps = [a.seconds_per_step() or median_spp for a in runs]
    kept = [nxt.resumed_from for nxt in runs[1:]] + [runs[-1].points[-1][1]]
    productive = sum(a.productive_s(k, spp) for a, k, spp in zip(runs, kept, spps))
    wall = runs[-1].points[-1][0] - runs[0].start
    failures = []
    for kill_t in kill_times:
        n = max(i for i, a in enumerate(runs) if a.start <= kill_t)
        if n + 1 >= len(runs):
            raise RuntimeError(f"no attempt after the kill at {kill_t:.3f}: the run was not retried")
        killed, spp = runs[n], spps[n]
        reached = int(killed.step_at(kill_t, spp))
        record: dict[str, Any] = failure_timeline(events, kill_t)
        record.update(kill_t=kill_t, step_at_kill=reached,
                      steps_recomputed=max(0, reached - runs[n + 1].resumed_from),
                      restart=record["retry"] + record["cluster_start"])
        record["lost_s"] = record["total"] + record["steps_recomputed"] * spp
        failures.append(record)
    return {"wall_s": wall, "productive_s": productive, "goodput": productive / wall,
            "final_step": runs[-1].points[-1][1], "attempts": len(runs), "seconds_per_step": median_spp,
            "failures": failures}
