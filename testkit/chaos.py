"""Chaos harness: real local-backend ``dist_sync`` jobs (2 workers, 1 server, the debug recipe,
optimizer on the workers so resume is exact) against a SeaweedFS S3 server started here.

Scenarios (``--scenarios R1,R2,R3,R4``):

- R1: ``--trials`` randomized trials (``--seed``). Each kills (SIGKILL) a random role (a worker,
  the server or the scheduler) right after a random step past the first checkpoint; the
  supervisor tears the job down; a retry over the same run prefix resumes and finishes.
- R2: checkpoint edge cases. ``torn``: rank 0 dies after a checkpoint's data files, before its
  manifest; ``corrupt``: the newest committed checkpoint gets flipped bytes before the retry;
  ``final``: a finished run is run again (its newest checkpoint is the final step).
- R3 (``testkit/chaos_outage.py``): the S3 server's process group is SIGKILLed at an exact
  training step and restarted on the same ports and data folder ``--outage-s`` later; the job
  must train through the outage, retry the failed upload, lose no checkpoint and finish with
  the parameters of an uninterrupted run.
- R4 (``chaos_net.py``, needs root and ``ip netns``): on the ``hosts`` backend over network
  namespaces, one worker host's link is cut for a few seconds and for longer than the stall
  timeout; the row says what the job did (rode it out, or torn down and resumed by a retry).

Checks per trial: finished; resumed from the newest checkpoint that verifies (never a torn or
corrupt one); final parameters within ``EXACT_ATOL`` of an uninterrupted reference run with the
same seed; no role process left (every process on the machine scanned for the attempt's tag).
Recovery time: from the fault (its once-file) to the worker's ``first step after resume done``
line; for R3 from the restart of S3 to the next committed checkpoint.

    .venv/bin/python benchmarks/chaos.py [--quick] [--trials N] [--seed S] [--soak]
        [--scenarios R1,R2,R3,R4] [--outage-s S] [--cut-s 5,30] [--json OUT]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The checkout on the path (run as ``python benchmarks/<script>.py``): testkit and the packages.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from testkit import chaos_jobs as cj  # noqa: E402
from testkit.digits import digits_csv  # noqa: E402
from testkit.result_file import write_json  # noqa: E402
from common import storage  # noqa: E402
from common.config import TrainConfig, recipe  # noqa: E402

EXACT_ATOL = 1e-6
ROLES = ("worker", "server", "scheduler")


@dataclass
class Trial:
    scenario: str
    name: str
    checks: dict[str, bool]
    recovery_s: float | None = None
    max_abs_diff: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(self.checks.values())


@dataclass
class Context:
    stack: cj.ChaosStack
    root: Path
    cfg: TrainConfig
    shards: str
    reference: dict[str, Any]
    total_steps: int

    def job(self, name: str, **overrides: Any) -> Any:
        cfg = self.cfg.replace(**overrides) if overrides else self.cfg
        return cj.job_for(cfg, self.shards, f"s3://{self.stack.bucket}/chaos/{name}")


def _resume_checks(ctx: Context, job: Any, first: cj.Attempt, retry: cj.Attempt, facts: dict[str, Any],
                   trial: Trial) -> None:
    """The checks every kill-and-retry trial shares."""
    trial.checks.update({
        "fault fired": first.fault_at is not None,
        "first attempt failed": first.failed is not None,
        "retry finished": retry.failed is None,
        "resumed from newest valid": retry.resumed_step() == facts["latest_valid"],
        "no partial checkpoint chosen": retry.resumed_step() is None or retry.resumed_step() in facts["committed"],
        "no orphan process": not first.orphans and not retry.orphans,
    })
    if retry.failed is None:
        step, params = cj.final_params(job)
        trial.max_abs_diff = cj.max_abs_diff(params, ctx.reference)
        trial.checks["finished at the last step"] = step == ctx.total_steps
        trial.checks[f"params within {EXACT_ATOL:g}"] = trial.max_abs_diff <= EXACT_ATOL
    done = retry.first_time("first step after resume done")
    if first.fault_at is not None and done is not None:
        trial.recovery_s = done - first.fault_at
        trial.details["recovery_terms_s"] = _terms(first, retry, done)
    trial.details.update({"resumed_step": retry.resumed_step(), "store_before_retry": facts,
                          "first_error": (first.failed or "").splitlines()[0][:200],
                          "retry_error": (retry.failed or "")[-2000:] or None,
                          "orphans": first.orphans + retry.orphans,
                          "attempt_s": [round(first.seconds, 2), round(retry.seconds, 2)]})


def _terms(first: cj.Attempt, retry: cj.Attempt, done: float) -> dict[str, float | None]:
    """Where the recovery time went: detect, teardown, between attempts, cluster start, restore."""
    def at(att: cj.Attempt, event: str) -> float | None:
        return next((e["t"] for e in att.events if e["event"] == event), None)

    marks = {"detect": at(first, "role_failed"), "teardown": at(first, "roles_stopped"),
             "between_attempts": at(retry, "job_start"), "cluster_start": retry.first_time("started (kvstore="),
             "restore_and_first_step": done}
    out, prev = {}, first.fault_at
    for name, t in marks.items():
        out[name] = None if t is None or prev is None else round(t - prev, 3)
        prev = t if t is not None else prev
    return out


def r1(ctx: Context, trials: int, rng: random.Random) -> list[Trial]:
    out = []
    every = ctx.cfg.checkpoint.every_n_steps
    for i in range(trials):
        kind = rng.choice(ROLES)
        victim = {"worker": f"worker-{rng.randrange(ctx.cfg.cluster.num_workers)}", "server": "server-0",
                  "scheduler": "scheduler"}[kind]
        # Before the last step: a kill after the final checkpoint is R2's "final step" case.
        kill_step = rng.randint(every + 1, ctx.total_steps - 1)
        killer = rng.randrange(ctx.cfg.cluster.num_workers)
        job, work = ctx.job(f"r1-{i}"), ctx.root / f"r1-{i}"
        first = cj.run_attempt(job, work, victim=victim, kill_step=kill_step, killer_rank=killer)
        facts = cj.store_facts(job)
        retry = cj.run_attempt(job, work, victim=victim, kill_step=kill_step, killer_rank=killer)
        trial = Trial("R1", f"kill -9 {victim} at step {kill_step}", {})
        _resume_checks(ctx, job, first, retry, facts, trial)
        trial.details.update({"victim": victim, "kill_step": kill_step, "killer_rank": killer})
        out.append(trial)
        echo(trial)
    return out


def r2(ctx: Context) -> list[Trial]:
    # Synchronous writes: every checkpoint on the cadence is attempted (async may skip one
    # while another uploads), so the torn and the corrupted steps are known in advance.
    sync = {"checkpoint": {"async_upload": False}}
    every = ctx.cfg.checkpoint.every_n_steps
    torn_step = 3 * every
    out = []

    job, work = ctx.job("r2-torn", **sync), ctx.root / "r2-torn"
    env = {"MXPIPE_FAULT_KILL_IN_UPLOAD_STEP": str(torn_step)}
    first = cj.run_attempt(job, work, env=env)
    facts = cj.store_facts(job)
    retry = cj.run_attempt(job, work, env=env)
    trial = Trial("R2", f"torn checkpoint at step {torn_step}", {
        "torn folder left (data, no manifest)": torn_step in facts["torn"],
        "previous one chosen": facts["latest_valid"] == 2 * every})
    _resume_checks(ctx, job, first, retry, facts, trial)
    out.append(trial)
    echo(trial)

    job, work = ctx.job("r2-corrupt", **sync), ctx.root / "r2-corrupt"
    first = cj.run_attempt(job, work, victim="worker-1", kill_step=torn_step + every // 2, killer_rank=0)
    newest = cj.store_facts(job)["committed"][:1]
    if newest:
        cj.flip_bytes(job, newest[0])
    facts = cj.store_facts(job)
    retry = cj.run_attempt(job, work)
    trial = Trial("R2", f"corrupt checkpoint at step {newest[0] if newest else '?'}", {
        "newest committed was corrupted": newest == [torn_step],
        "previous one chosen": facts["latest_valid"] == 2 * every,
        "corrupt one skipped (logged)": bool(retry.lines("skipping checkpoint"))})
    _resume_checks(ctx, job, first, retry, facts, trial)
    out.append(trial)
    echo(trial)

    # Run the finished job once more: its newest checkpoint is the final step (the train task
    # died after the job, or register failed and the whole DAG run was cleared).
    again = cj.run_attempt(job, work)
    step, params = cj.final_params(job)
    trial = Trial("R2", "rerun of a finished run (resume at the final step)", {
        "finished": again.failed is None,
        "resumed at the final step": again.resumed_step() == ctx.total_steps and
        bool(again.lines("nothing left to train")),
        "no new step trained": not again.lines("first step after resume done"),
        "no orphan process": not again.orphans,
        f"params within {EXACT_ATOL:g}": step == ctx.total_steps and cj.max_abs_diff(params, ctx.reference)
        <= EXACT_ATOL}, max_abs_diff=cj.max_abs_diff(params, ctx.reference),
        details={"error": (again.failed or "")[-2000:] or None, "attempt_s": round(again.seconds, 2)})
    out.append(trial)
    echo(trial)
    return out


# -- setup, table, CLI ------------------------------------------------------------------------------


def shard_copies(stack: cj.ChaosStack, cfg: TrainConfig, name: str, copies: int) -> str:
    from data_checks.shard import shard_dataset

    base = f"s3://{stack.bucket}/chaos-data/{name}"
    storage.put_bytes(storage.join(base, "digits.csv"), digits_csv(copies))
    shard_dataset(cfg.replace(data={"source_uri": storage.join(base, "digits.csv")}), storage.join(base, "shards"))
    return storage.join(base, "shards")


def base_config() -> TrainConfig:
    """The debug recipe, 2 workers + 1 server, optimizer on the workers (exact resume). No restart
    in place: each fault ends the job, and the harness's retry is a new job on the same prefix
    (the path of an Airflow retry, which every fault a restart cannot fix still takes)."""
    return recipe("debug").replace(cluster={"num_workers": 2, "num_servers": 1, "kvstore": "dist_sync",
                                            "optimizer_on": "workers", "job_timeout_s": 900.0,
                                            "max_restarts_without_progress": 0})


def _s3_scenarios(root: Path, scenarios: list[str], trials: int, seed: int, outage_s: float,
                  r3_copies: int) -> list[Trial]:
    stack = cj.ChaosStack(root)
    stack.start()
    results: list[Trial] = []
    try:
        with stack.environment():
            cfg = base_config()
            shards = shard_copies(stack, cfg, "digits", 1)
            ref_job = cj.job_for(cfg, shards, f"s3://{stack.bucket}/chaos/reference")
            ref = cj.run_attempt(ref_job, root / "reference")
            if ref.failed:
                raise RuntimeError(f"the reference run failed:\n{ref.failed}")
            total, params = cj.final_params(ref_job)
            ctx = Context(stack, root, cfg, shards, params, total)
            print(f"reference: {total} steps in {ref.seconds:.1f}s", flush=True)
            if "R1" in scenarios:
                results += r1(ctx, trials, random.Random(seed))
            if "R2" in scenarios:
                results += r2(ctx)
            if "R3" in scenarios:
                from testkit.chaos_outage import r3  # it builds on this module's Trial

                results.append(r3(stack, root, cfg, outage_s, r3_copies, reference=True))
    finally:
        stack.stop()
    return results


def run(root: Path, scenarios: list[str], trials: int, seed: int, outage_s: float, r3_copies: int = 20,
        cut_seconds: list[float] | None = None) -> dict:
    results: list[Trial] = []
    if {"R1", "R2", "R3"} & set(scenarios):
        results += _s3_scenarios(root, scenarios, trials, seed, outage_s, r3_copies)
    if "R4" in scenarios:  # the hosts backend over network namespaces: no S3 (a shared folder)
        from testkit import chaos_net

        if chaos_net.why_not():
            print(f"R4 skipped: {chaos_net.why_not()}", flush=True)
        else:
            for trial in chaos_net.r4(root / "r4", cut_seconds or [5.0, chaos_net.STALL_S + 10.0]):
                echo(trial)
                print(f"R4 outcome: {trial.details['outcome']}", flush=True)
                results.append(trial)
    return {"seed": seed, "trials": [asdict(t) | {"passed": t.passed} for t in results],
            "rows": summarize(results), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def summarize(results: list[Trial]) -> list[dict[str, Any]]:
    rows = []
    for name in dict.fromkeys(t.scenario for t in results):
        group = [t for t in results if t.scenario == name]
        rec = [t.recovery_s for t in group if t.recovery_s is not None]
        diffs = [t.max_abs_diff for t in group if t.max_abs_diff is not None]
        rows.append({"scenario": name, "trials": len(group), "passed": sum(t.passed for t in group),
                     "median_recovery_s": statistics.median(rec) if rec else None,
                     "worst_recovery_s": max(rec) if rec else None, "max_abs_diff": max(diffs) if diffs else None})
    return rows


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| scenario | trials | passed | median recovery s | worst recovery s | max abs diff |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['trials']} | {r['passed']} | {_fmt(r['median_recovery_s'], '.2f')} | "
                     f"{_fmt(r['worst_recovery_s'], '.2f')} | {_fmt(r['max_abs_diff'], '.3g')} |")
    return "\n".join(lines)


def echo(trial: Trial) -> None:
    bad = [k for k, ok in trial.checks.items() if not ok]
    print(f"{trial.scenario} {trial.name}: {'PASS' if trial.passed else 'FAIL ' + ', '.join(bad)}"
          f" recovery={_fmt(trial.recovery_s, '.2f')}s diff={_fmt(trial.max_abs_diff, '.3g')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    # The whole first paragraph: its first line alone stops mid-sentence.
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--scenarios", default="R1,R2,R3,R4")
    parser.add_argument("--trials", type=int, default=None, help="R1 trials (default 4; --quick 2; --soak 25)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="CI size: 2 R1 trials, a 10 s S3 outage")
    parser.add_argument("--soak", action="store_true", help="a long setting: 25 R1 trials")
    parser.add_argument("--outage-s", type=float, default=None, help="R3 outage (default 30; --quick 10)")
    parser.add_argument("--cut-s", default="", help="R4 link cuts in seconds, comma-separated "
                        "(default: 5 and the stall timeout + 10)")
    parser.add_argument("--json", help="write every trial and the table to this file")
    args = parser.parse_args(argv)
    trials = args.trials or (25 if args.soak else 2 if args.quick else 4)
    outage = args.outage_s if args.outage_s is not None else (10.0 if args.quick else 30.0)
    scenarios = [s.strip().upper() for s in args.scenarios.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="mxpipe-chaos-") as tmp:
        cuts = [float(c) for c in args.cut_s.split(",") if c.strip()] or None
        report = run(Path(tmp), scenarios, trials, args.seed, outage, cut_seconds=cuts)
    print("\n" + table(report["rows"]))
    write_json(args.json, report, default=str)
    return 0 if all(t["passed"] for t in report["trials"]) else 1

