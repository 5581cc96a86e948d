# Trainer image, CPU: what every ps-lite role (scheduler, server, worker) runs.
#   docker build -f docker/trainer-cpu.Dockerfile -t mxpipe-trainer:cpu .
# A role is `python -m training worker JOB_URI` (or `python -c "import mxnet"` for scheduler and
# server) with the DMLC_* variables set by the cluster backend; see common/roles.py.
FROM python:3.11-slim-bookworm

# mxnet 1.9.1's wheel links libgomp; libquadmath/libgfortran come inside the wheel.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1=12.2.0-14+deb12u1 \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=0 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/mxpipe
# requirements.txt is the lock's `trainer` group minus mxnet itself (exported from uv.lock, see
# its header), so each image adds its own mxnet build: --no-deps installs exactly that set and
# `pip check` proves it complete.
COPY docker/trainer-requirements.txt /opt/mxpipe/requirements.txt
RUN python -m venv /opt/mxpipe/.venv \
    && /opt/mxpipe/.venv/bin/pip install --no-deps -r requirements.txt mxnet==1.9.1 \
    && /opt/mxpipe/.venv/bin/pip check

COPY common/ /opt/mxpipe/common/
COPY training/ /opt/mxpipe/training/
# Compiled once here: roles start from .pyc, never compiling at each start.
RUN /opt/mxpipe/.venv/bin/python -m compileall -q /opt/mxpipe/common /opt/mxpipe/training \
    && useradd --system --uid 10001 --home-dir /opt/mxpipe trainer
USER 10001
ENV PATH=/opt/mxpipe/.venv/bin:$PATH \
    PYTHONPATH=/opt/mxpipe
# A role is a batch process watched by the supervisor (exit code, output, stall timeout),
# not a service to probe.
HEALTHCHECK NONE
ENTRYPOINT ["python", "-m", "training"]
CMD ["--help"]
