"""Restart in place (``training.launch.restarts``), with shell scripts for roles: a failed role
costs a restart of every role on the same cluster, not the job; the budget counts failures in a
row without a new checkpoint, so a job that keeps committing survives any number of failures,
and one that does not ends after its budget with an error that says so and is not retried. What
a restart cannot help (a deterministic failure, the job's timeout) ends the job at once."""
import os
from types import SimpleNamespace

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


NOTICE = ("printf '@event {\"v\":1,\"kind\":\"spot_interruption\",\"instance_id\":\"i-1\",\"action\":\"terminate\","
          "\"time\":\"2026-12-06T20:13:00Z\",\"host\":\"host-a\"}\\n'")


class ReclaimingCluster(script_cluster.ScriptCluster):
    """A script cluster whose machine ``host-a`` is reclaimed: ``release_interrupted`` records the
    call and, unless a replacement is asked for and ``capacity`` allows it, shrinks by a worker."""

    def __init__(self, record_dir, env, scripts, *, capacity):
        super().__init__(record_dir, env, scripts)
        self.spec = SimpleNamespace(workers=2, servers=1)
        self.capacity = capacity
        self.released = []

    def release_interrupted(self, host, *, replace):
        self.released.append((host, replace))
        if replace and self.capacity:
            return True
        self.spec.workers -= 1
        return False


class RecordingCluster(ReclaimingCluster):
    """A reclaiming cluster whose roles' output the supervisor cannot read while they run (as SSM's
    on ``ec2``): the notices are recorded under ``folder``."""

    def __init__(self, *args, folder, **kwargs):
        super().__init__(*args, **kwargs)
        self.folder = folder

    def spot_notice_folder(self, job_uri):
        return self.folder


def _noticed(watch, tmp_path, *, capacity, **cfg):
    # Every role of the machine reports the notice in the first round; the workers then wait to
    # be stopped (rank 0 "checkpoints" on SIGTERM); in the next round they finish.
    counter = tmp_path / "rounds"
    worker = (f"echo $$ >> {counter}; n=$(wc -l < {counter}); "
              "echo '@event {\"v\":1,\"kind\":\"worker_started\",\"rank\":0,\"num_workers\":2}'; "
              f"if [ $n -le 2 ]; then trap 'echo emergency checkpoint; exit 75' TERM; {NOTICE}; "
              "while :; do sleep 0.1; done; fi; sleep 0.3; echo done")
    scripts = {"scheduler": f"{NOTICE}; sleep 1", "server-0": "sleep 1", "worker-0": worker, "worker-1": worker}
    folder = cfg.pop("record_notices_in", None)
    if folder is not None:  # the roles record the notice instead of printing it
        notice = NOTICE.replace("printf '@event ", f"printf '").replace("\\n'", f"' > {folder}/i-1.json")
        scripts = {name: script.replace(NOTICE, f"mkdir -p {folder}; {notice}") for name, script in scripts.items()}
        cluster = RecordingCluster(watch.record_dirs[0], watch.env, scripts, capacity=capacity, folder=str(folder))
    else:
        cluster = ReclaimingCluster(watch.record_dirs[0], watch.env, scripts, capacity=capacity)
    config = TrainConfig().replace(cluster={"num_workers": 2, "num_servers": 1, "job_timeout_s": 60,
                                            **cfg.get("cluster", {})},
                                   checkpoint={"preempt_grace_s": 2, **cfg.get("checkpoint", {})})
    status = StatusWriter(str(tmp_path / "status.json"), JobStatus(state="running", job_id="j"))
    sup = Supervisor(config, cluster=cluster, base_env=dict(os.environ), status=status)
    try:
        sup.run("s3://bucket/job.json")
        return None, cluster, status.status
    except JobFailed as exc:
        return exc, cluster, status.status
    finally:
        watch.check("the supervisor")


def test_a_spot_notice_restarts_once_on_a_replacement(tmp_path, nothing_left):
    err, cluster, record = _noticed(nothing_left, tmp_path, capacity=True)
    assert err is None and cluster.released == [("host-a", True)]  # three roles reported it: one release
    assert [launch.num_workers for launch in cluster.launches] == [2, 2]
    assert record.restarts == 1 and record.restarts_without_progress == 0
    assert record.last_restart_reason == "spot interruption notice for i-1 (host-a)"


def test_without_capacity_an_elastic_job_goes_on_one_worker_fewer(tmp_path, nothing_left):
    err, cluster, record = _noticed(nothing_left, tmp_path, capacity=False, checkpoint={"elastic": True})
    assert err is None and [launch.num_workers for launch in cluster.launches] == [2, 1]
    assert record.last_restart_reason.endswith("going on with 1 worker(s) and 1 server(s)")


def test_a_job_that_cannot_shrink_ends_retryably_for_a_whole_cluster(tmp_path, nothing_left):
    err, cluster, _ = _noticed(nothing_left, tmp_path, capacity=False, cluster={"on_spot_interruption": "shrink"})
    assert cluster.released == [("host-a", False)] and len(cluster.launches) == 1
    assert not err.deterministic and "checkpoint.elastic is off" in str(err)


def test_a_spot_notice_restarts_even_with_restarts_off(tmp_path, nothing_left):
    err, cluster, record = _noticed(nothing_left, tmp_path, capacity=True, cluster={"max_restarts_without_progress": 0})
    assert err is None and len(cluster.launches) == 2 and record.restarts == 1


def test_the_job_timeout_counts_from_the_job_start_across_restarts(tmp_path, nothing_left):
    # Every round commits and fails: progress each time, so only the job's own bound ends it.
    counter = tmp_path / "runs"
    script = (f"n=$(($(cat {counter} 2>/dev/null || echo 0)+1)); echo $n > {counter}; {COMMIT} $((n*10)); "
              "sleep 0.5; exit 1")
    err, cluster, _ = _run(nothing_left, {"worker-0": script}, job_timeout_s=3)
    assert err.role == "job" and "exceeded its timeout of 3s" in str(err)
    assert len(cluster.launches) > 1


def test_a_notice_recorded_in_the_cluster_s_folder_is_acted_on_too(tmp_path, nothing_left):
    folder = tmp_path / "spot_notices"
    folder.mkdir()
    (folder / "i-0.json").write_text("left by an earlier job")  # emptied at the job's start
    err, cluster, record = _noticed(nothing_left, tmp_path, capacity=True, record_notices_in=folder)
    assert err is None and cluster.released == [("host-a", True)] and len(cluster.launches) == 2
    assert record.last_restart_reason == "spot interruption notice for i-1 (host-a)"
    assert not (folder / "i-0.json").exists()
