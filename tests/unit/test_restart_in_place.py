"""Restart in place (``training.launch.restarts``), with shell scripts for roles: a failed role
costs a restart of every role on the same cluster, not the job; the budget counts failures in a
row without a new checkpoint, so a job that keeps committing survives any number of failures,
and one that does not ends after its budget with an error that says so and is not retried. What
a restart cannot help (a deterministic failure, the job's timeout) ends the job at once."""
import os

import pytest

from common.config import TrainConfig
from tests.unit import script_cluster
from training.launch.launcher import JobFailed, Supervisor
from training.launch.restarts import RestartBudget
from training.launch.status import JobStatus, StatusWriter, read_status

pytestmark = pytest.mark.unit

COMMIT = "printf '@event {\"v\":1,\"kind\":\"checkpoint_committed\",\"step\":%d,\"uri\":\"u\"}\\n'"


def _worker(counter, *, fail_runs, commit=True, code=1):
    """A worker that counts its runs in ``counter``; each of the first ``fail_runs`` runs commits
    a checkpoint (step 10 × run, when ``commit``) and exits ``code``, the next one succeeds."""
    commit_line = f"{COMMIT} $((n*10)); " if commit else ""
    return (f"n=$(($(cat {counter} 2>/dev/null || echo 0)+1)); echo $n > {counter}; echo run $n; "
            f"if [ $n -le {fail_runs} ]; then {commit_line}sleep 0.3; echo 'lost' >&2; exit {code}; fi; "
            "sleep 0.3; echo done")


def _run(watch, scripts, **cluster):
    status_uri = os.path.join(os.path.dirname(watch.record_dirs[0]), "status.json")
    cfg = TrainConfig().replace(cluster={"num_workers": 2, "num_servers": 1, "start_timeout_s": 30,
                                         "stall_timeout_s": 30, "job_timeout_s": 60, **cluster})
    cluster_ = script_cluster.ScriptCluster(watch.record_dirs[0], watch.env,
                                            {"scheduler": "sleep 0.5", "server-0": "sleep 0.5", **scripts})
    status = StatusWriter(status_uri, JobStatus(state="running", job_id="j"))
    sup = Supervisor(cfg, cluster=cluster_, base_env=dict(os.environ), status=status)
    try:
        sup.run("s3://bucket/job.json")
        return None, cluster_, status
    except JobFailed as exc:
        return exc, cluster_, status
    finally:
        watch.check("the supervisor")  # every role of every round stopped before run() returned


def test_a_job_that_commits_between_failures_survives_more_than_its_budget(tmp_path, nothing_left):
    counter = tmp_path / "runs"
    err, cluster, status = _run(nothing_left, {"worker-0": _worker(counter, fail_runs=5), "worker-1": "sleep 0.5"},
                                max_restarts_without_progress=1)
    assert err is None  # 5 failures, budget 1: each round committed a checkpoint before it failed
    assert len(cluster.launches) == 6 and counter.read_text().strip() == "6"
    record = status.status
    assert (record.restarts, record.restarts_without_progress) == (5, 0)
    assert "worker-0 on host-worker-0 failed: exit code 1" == record.last_restart_reason


def test_a_job_without_progress_stops_after_its_budget_with_an_error_that_says_so(tmp_path, nothing_left):
    counter = tmp_path / "runs"
    err, cluster, status = _run(nothing_left, {"worker-1": _worker(counter, fail_runs=100, commit=False)},
                                max_restarts_without_progress=2)
    assert len(cluster.launches) == 3  # the first round and 2 restarts; the 3rd failure in a row ends it
    assert err.deterministic and err.role == "worker-1" and err.exit_code == 1
    assert str(err).startswith("gave up after 2 in-place restart(s) in a row without progress (no checkpoint "
                               "committed yet; cluster.max_restarts_without_progress=2")
    assert "worker-1 on host-worker-1 failed: exit code 1" in str(err) and "lost" in str(err)
    assert status.status.restarts == 2


def test_progress_resets_the_count_and_its_absence_is_counted_from_the_last_checkpoint(tmp_path, nothing_left):
    # Runs 1-2 commit and fail, runs 3-5 fail without committing: with budget 2 the fifth run's
    # failure is the third in a row without progress.
    counter = tmp_path / "runs"
    script = (f"n=$(($(cat {counter} 2>/dev/null || echo 0)+1)); echo $n > {counter}; "
              f"if [ $n -le 2 ]; then {COMMIT} $((n*10)); fi; sleep 0.3; exit 1")
    err, cluster, _ = _run(nothing_left, {"worker-0": script}, max_restarts_without_progress=2)
    assert len(cluster.launches) == 5 and err.deterministic
    assert "no checkpoint committed after step 20" in str(err)


def test_budget_zero_leaves_the_failure_to_the_callers_retry(tmp_path, nothing_left):
    err, cluster, _ = _run(nothing_left, {"worker-1": _worker(tmp_path / "runs", fail_runs=1)},
                           max_restarts_without_progress=0)
    assert len(cluster.launches) == 1 and not err.deterministic
    assert str(err).startswith("worker-1 on host-worker-1 failed: exit code 1")


def test_a_deterministic_failure_and_the_job_timeout_are_not_restarted(tmp_path, nothing_left):
    err, cluster, _ = _run(nothing_left, {"worker-1": _worker(tmp_path / "runs", fail_runs=1, code=2)})
    assert len(cluster.launches) == 1 and err.deterministic and err.exit_code == 2
    loop = "while :; do echo step; sleep 0.2; done"
    err, cluster, _ = _run(nothing_left, {"worker-0": loop, "worker-1": loop}, job_timeout_s=1.5)
    assert len(cluster.launches) == 1 and err.role == "job"


def test_a_stalled_worker_is_restarted_too(tmp_path, nothing_left):
    counter = tmp_path / "runs"
    stall_once = (f"n=$(($(cat {counter} 2>/dev/null || echo 0)+1)); echo $n > {counter}; echo started; "
                  "if [ $n -le 1 ]; then sleep 300; fi; echo done")
    err, cluster, status = _run(nothing_left, {"worker-0": stall_once, "worker-1": "sleep 0.5"}, stall_timeout_s=1.5)
    assert err is None and len(cluster.launches) == 2
    assert "stalled: no output for 2s" in status.status.last_restart_reason


def test_the_budget_counts_streaks_not_totals():
    budget = RestartBudget(2)
    assert [budget.take(progressed) for progressed in (False, False, True, False, False, False)] == \
        [True, True, True, True, True, False]
    assert (budget.restarts, budget.without_progress) == (5, 2)
    assert not RestartBudget(0).take(True)
    with pytest.raises(ValueError):
        RestartBudget(-1)


def test_the_record_carries_the_counts(tmp_path):
    uri = str(tmp_path / "status.json")
    writer = StatusWriter(uri, JobStatus(state="running", job_id="j"))
    writer.update(restarts=3, restarts_without_progress=1, last_restart_reason="worker-1 on h failed: exit code 1")
    got = read_status(uri)
    assert (got.restarts, got.restarts_without_progress, got.last_restart_reason) == \
        (3, 1, "worker-1 on h failed: exit code 1")
