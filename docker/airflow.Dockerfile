# Airflow image for the scaled-out stack (docker/compose.yaml): the project's locked
# environment (uv.lock) with its `airflow-image` group (the Celery executor and the PostgreSQL
# driver); no dev tools and no `local` group (the SeaweedFS binary of the embedded stack).
#   docker build -f docker/airflow.Dockerfile -t mxpipe-airflow .
FROM python:3.11-slim-bookworm

RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1=12.2.0-14+deb12u1 \
    && rm -rf /var/lib/apt/lists/*

COPY --from=ghcr.io/astral-sh/uv:0.13.8 /uv /usr/local/bin/uv
ENV UV_NO_CACHE=1 \
    UV_PROJECT_ENVIRONMENT=/opt/mxpipe/.venv \
    PYTHONUNBUFFERED=1

WORKDIR /opt/mxpipe
COPY pyproject.toml uv.lock /opt/mxpipe/
# Exactly the locked set of these groups (tests/integration/test_deploy_artifacts.py lists it).
RUN uv sync --frozen --no-default-groups --group airflow-image --no-install-project --compile-bytecode

COPY common/ /opt/mxpipe/common/
COPY training/ /opt/mxpipe/training/
COPY data_checks/ /opt/mxpipe/data_checks/
COPY infra/ /opt/mxpipe/infra/
COPY plugins/ /opt/mxpipe/plugins/
COPY dags/ /opt/mxpipe/dags/

RUN useradd --system --uid 50000 --home-dir /opt/airflow airflow \
    && mkdir -p /opt/airflow && chown airflow /opt/airflow
USER 50000
ENV PATH=/opt/mxpipe/.venv/bin:$PATH \
    PYTHONPATH=/opt/mxpipe \
    AIRFLOW_HOME=/opt/airflow \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/mxpipe/dags \
    AIRFLOW__CORE__LOAD_EXAMPLES=False
# One image, several components: each service's probe is in docker/compose.yaml.
HEALTHCHECK NONE
ENTRYPOINT ["airflow"]
CMD ["version"]
