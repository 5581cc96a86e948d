"""The namespace topology's settings (infra.topology): one source for the topology and
docker/compose.yaml's env file, and the Airflow configuration each host gets from it."""
import re
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
