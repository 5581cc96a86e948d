# The two commands of the README: `make demo` runs the pipeline end to end on the embedded
# stack; `make test` runs the test suite. Both install what they need first.
PY := .venv/bin/python

.PHONY: setup demo test test-fast down status benchmark trainer-requirements

setup:
	@scripts/bootstrap.sh

demo: setup
	$(PY) scripts/demo.py

# Two pytest workers, each taking whole files (module fixtures and a file's order stay on one):
# most of the integration tier waits on real jobs, servers and Airflow, so two share 2 cores
# well. The 30 slowest tests are listed at the end.
test: setup
	$(PY) -m pytest -n 2 --dist loadfile --durations=30

test-fast: setup
	$(PY) -m pytest -m "unit or dag"

down:
	$(PY) -m infra.services down

status:
	$(PY) -m infra.services status

benchmark: setup
	$(PY) benchmarks/run.py

# docker/trainer-requirements.txt is exported from uv.lock's `trainer` group: run this after
# changing that group or the lock (tests/unit/test_dependencies.py fails while it is stale).
trainer-requirements:
	uv export --frozen --no-hashes --only-group trainer --no-emit-package mxnet -o docker/trainer-requirements.txt >/dev/null
