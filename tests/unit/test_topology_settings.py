"""The namespace topology's settings (infra.topology): one source for the topology and
docker/compose.yaml's env file, and the Airflow configuration each host gets from it."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from infra.topology import AIRFLOW_HOSTS, HOSTS, TopologySettings, airflow_host_env, compose_env

pytestmark = pytest.mark.unit

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def test_checked_in_compose_env_file_is_the_generated_one():
    # Regenerate with: python -m infra.topology compose-env > docker/env.example
    assert (DOCKER / "env.example").read_text() == compose_env(TopologySettings())


def test_compose_file_reads_every_variable_of_the_env_file():
    compose = (DOCKER / "compose.yaml").read_text()
    names = [line.split("=", 1)[0] for line in compose_env(TopologySettings()).splitlines()
             if line and not line.startswith("#")]
    assert names and not [n for n in names if f"${{{n}" not in compose]
    # and nothing the env file lacks (a typo would be an unset variable at `compose up`)
    used = set(re.findall(r"\$\{(\w+)", compose))
    assert used <= set(names), used - set(names)


def test_every_host_has_an_address_of_its_own_on_the_subnet():
    settings = TopologySettings()
    addresses = [settings.address(h) for h in HOSTS]
    assert len(set(addresses)) == len(HOSTS) and settings.uplink_address not in addresses
    assert all(a.startswith(f"{settings.subnet}.") for a in addresses)
    # Linux interface names are at most 15 characters.
    assert len(settings.uplink) <= 15


def test_airflow_hosts_share_the_database_broker_and_secrets_but_name_themselves(tmp_path):
    settings = TopologySettings()
    creds = {"access_key": "AK", "secret_key": "SK", "postgres_password": "pg", "redis_password": "rd",
             "airflow_jwt_secret": "j", "airflow_api_secret_key": "a", "airflow_fernet_key": "f"}
    envs = {host: airflow_host_env(tmp_path, settings, creds, host) for host in AIRFLOW_HOSTS}
    shared = ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CELERY__BROKER_URL", "AIRFLOW__API_AUTH__JWT_SECRET",
              "AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "AIRFLOW_CONN_AWS_DEFAULT")
    for key in shared:
        assert len({env[key] for env in envs.values()}) == 1, key
    worker = envs["worker1"]
    assert worker["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert f"@{settings.address('db')}:" in worker["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
    assert worker["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == f"{settings.airflow_url}/execution/"
    # Each host its own home, and its own name in task logs (the namespaces share one hostname).
    assert len({env["HOME"] for env in envs.values()}) == len(envs)
    assert worker["MXPIPE_HOST_ADDRESS"] == settings.address("worker1")
    assert worker["AIRFLOW__CORE__HOSTNAME_CALLABLE"] == "infra.netns.host_address"
    assert worker["MXPIPE_HOME"].startswith(worker["HOME"])
    # A dead worker host's task is retried in seconds, not after the default 300 s.
    assert envs["airflow"]["AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT"] == str(settings.task_heartbeat_timeout_s)
    # All of it in the environment: the homes start empty (the topology tier checks it).
    assert list(tmp_path.rglob("*")) == []
    assert worker["AIRFLOW__CORE__FERNET_KEY"] == "f" and worker["AIRFLOW__API_AUTH__JWT_SECRET"] == "j"
    assert worker["MXPIPE_HOSTS_FILE"] == str(tmp_path / "etc" / "hosts.json")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a mount namespace)")
def test_a_host_sees_its_own_home_and_the_shared_config_only(tmp_path):
    """``host_command``'s mount namespace, without its network namespace (``ip netns exec``)."""
    from infra.topology import host_command, host_home, host_records, shared_config

    for host in ("worker1", "worker2"):
        host_home(tmp_path, host).mkdir(parents=True)
    (host_home(tmp_path, "worker2") / "f").write_text("worker2's")
    shared_config(tmp_path).mkdir()
    (shared_config(tmp_path) / "hosts.json").write_text("[]")
    host_records(tmp_path, "worker2").mkdir(parents=True)
    (tmp_path / ".view").mkdir()
    script = f"""
import json, os, sys
root = sys.argv[1]
def attempt(f):
    try:
        return f()
    except OSError as exc:
        return type(exc).__name__
print(json.dumps({{"cwd": os.getcwd(), "root": sorted(os.listdir(root)), "homes": os.listdir(root + "/hosts"),
                  "other": attempt(lambda: open(root + "/hosts/worker2/f").read()),
                  "records": attempt(lambda: os.listdir(root + "/records")),
                  "config": attempt(lambda: open(root + "/etc/hosts.json").read()),
                  "write_config": attempt(lambda: open(root + "/etc/x", "w")),
                  "write_other": attempt(lambda: os.mkdir(root + "/hosts/worker2")),
                  "write_own": attempt(lambda: open(root + "/hosts/worker1/mine", "w").write("1"))}}))
"""
    cmd = host_command(tmp_path, TopologySettings(), "worker1", [sys.executable, "-c", script, str(tmp_path)])
    out = subprocess.run(cmd[cmd.index("unshare"):], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen == {"cwd": str(host_home(tmp_path, "worker1")), "root": ["etc", "hosts"], "homes": ["worker1"],
                    "other": "FileNotFoundError", "records": "FileNotFoundError", "config": "[]",
                    "write_config": "OSError", "write_other": "OSError", "write_own": 1}, seen
    # What the host wrote is in its home; nothing of its view is left mounted here.
    assert (host_home(tmp_path, "worker1") / "mine").read_text() == "1"
    assert (host_home(tmp_path, "worker2") / "f").exists() and list((tmp_path / ".view").iterdir()) == []


def test_an_airflow_server_that_exits_is_started_again_and_stops_with_its_session(tmp_path, monkeypatch):
    """As compose's ``restart: unless-stopped``: the scheduler exits when PostgreSQL restarts."""
    from infra import topology
    from infra.processes import launch
    from testkit.waits import wait_for

    monkeypatch.setattr(topology, "RESTART_DELAY_S", 0)
    runs = tmp_path / "runs"
    cmd = topology._restarting(["sh", "-c", f"echo run >> {runs}; sleep 0.2; exit 1"])
    handle = launch("exits", cmd, {"PATH": "/usr/bin:/bin"}, tmp_path)
    try:
        wait_for(lambda: runs.exists() and len(runs.read_text().splitlines()) >= 3, timeout_s=30, what="3 starts")
        assert "exited with status 1; starting it again" in handle.log_tail()
    finally:
        assert handle.stop(timeout=10)
    after = runs.read_text()
    time.sleep(0.5)  # longer than a round of the loop (0.2 s and no delay)
    assert runs.read_text() == after  # stopped: no start after the session's SIGTERM
