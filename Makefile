# The two commands of the README: `make demo` runs the pipeline end to end on the embedded
# stack; `make test` runs the test suite. Both install what they need first.
PY := .venv/bin/python

.PHONY: setup demo test test-fast down status benchmark trainer-requirements topology topology-status test-topology

setup:
	@scripts/bootstrap.sh

demo: setup
	$(PY) scripts/demo.py

# Two pytest workers, each taking whole files (module fixtures and a file's order stay on one):
# most of the integration tier waits on real jobs, servers and Airflow, so two share 2 cores
# well; a third made each test slower by as much as it gained (benchmarks/README.md). Files go
# out longest first (tests/conftest.py, from tests/durations.json; refresh it with
# scripts/test_durations.py from the JUnit report). The 30 slowest tests are listed at the end.
test: setup
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=30 --junitxml=.local/test-report.xml

test-fast: setup
	$(PY) -m pytest -m "unit or dag"

# Stops the embedded stack and, if one is up, the namespace topology (infra/topology.py).
down:
	$(PY) -m infra.services down
	$(PY) -m infra.topology down

# The scaled-out deployment on network-namespace hosts of this machine (root; minutes to start).
topology: setup
	$(PY) -m infra.topology up

topology-status:
	$(PY) -m infra.topology status

# Its test tier: up, the training DAG through the REST API, the cheap faults (triggerer, S3 link), down
# (not part of `make test`).
test-topology: setup
	$(PY) -m pytest -m topology tests/integration/test_topology.py tests/integration/test_topology_review.py tests/integration/test_topology_faults.py

status:
	$(PY) -m infra.services status

benchmark: setup
	$(PY) benchmarks/run.py

# docker/trainer-requirements.txt is exported from uv.lock's `trainer` group: run this after
# changing that group or the lock (tests/unit/test_dependencies.py fails while it is stale).
trainer-requirements:
	uv export --frozen --no-hashes --only-group trainer --no-emit-package mxnet -o docker/trainer-requirements.txt >/dev/null
