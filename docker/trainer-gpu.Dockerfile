# Trainer image, GPU: mxnet-cu117 1.9.1 on the CUDA 11.7 + cuDNN 8 runtime it was built for.
#   docker build -f docker/trainer-gpu.Dockerfile -t mxpipe-trainer:gpu .
# Run with the NVIDIA container runtime (`--gpus all`); the EC2 launch template's user data pulls
# this image on a GPU AMI. Python 3.11 comes from uv (the base image's Ubuntu ships 3.10 and
# mxnet 1.9.1 needs numpy<1.24, which has no 3.12 wheels).
FROM nvidia/cuda:11.7.1-cudnn8-runtime-ubuntu22.04

RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates=20240203~22.04.1 libgomp1=12.3.0-1ubuntu1~22.04 \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1

COPY --from=ghcr.io/astral-sh/uv:0.13.8 /uv /usr/local/bin/uv

WORKDIR /opt/mxpipe
# requirements.txt is the lock's `trainer` group minus mxnet (exported from uv.lock, see its
# header); mxnet-cu117 has the CPU build's dependencies, so --no-deps installs exactly the locked
# set plus this build, and `uv pip check` proves it complete.
COPY docker/trainer-requirements.txt /opt/mxpipe/requirements.txt
RUN uv venv --python 3.11 /opt/mxpipe/.venv \
    && uv pip install --python /opt/mxpipe/.venv/bin/python --no-deps -r requirements.txt mxnet-cu117==1.9.1 \
    && uv pip check --python /opt/mxpipe/.venv/bin/python

COPY common/ /opt/mxpipe/common/
COPY training/ /opt/mxpipe/training/
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
