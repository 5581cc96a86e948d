"""Test support shared by the test suite (``tests/``) and the benchmarks (``benchmarks/``).

Both import it; it imports neither of them (tests/unit/test_import_direction.py), and it may
import every package of the project. What it holds:

- ``ROOT`` / ``REPO``: the repository's folder (a ``Path`` and its ``str``), defined here only;
- ``digits``: scikit-learn's digits as the pipeline's source table (a frame, CSV bytes);
- ``dag_runs``: ``dag.test()`` runs of a DAG in a child process with an AIRFLOW_HOME of its own
  (the one DagBag runner script), and the environment such a run needs;
- ``dag_services`` / ``dag_stack``: S3 and MLflow servers of a benchmark's own, and the training
  DAG run against them;
- ``airflow_stack`` / ``operator_runs`` / ``dags_operator_variants``: the real Airflow stack
  (scheduler, triggerer, ...) and what the training operator's tests run on it;
- ``local_jobs`` / ``ps_cluster``: a JobSpec run as every run is (local backend, detached
  supervisor), or a worker script run as a ps-lite job, with nothing left behind;
- ``netns_hosts``: throwaway hosts in network namespaces for the ``hosts`` backend;
- ``topology_runs``: the training DAG run through the namespace topology (``infra.topology``), and
  what of the topology is left on the machine after ``down``; ``topology_faults``: issue 27's
  faults (a worker host, the triggerer host, PostgreSQL, the S3 link) injected into such runs;
- ``chaos`` / ``chaos_outage`` / ``chaos_net``: the chaos harness (R1–R4) that
  ``benchmarks/chaos.py`` runs and the chaos tests share; ``constrained_links``: jobs on
  namespace hosts behind rate-limited links (``benchmarks/constrained_links.py``);
- ``chaos_jobs`` / ``killer``: the chaos harness's job attempts and S3 server, and the soak's
  killer of random live roles;
- ``timeline``: a job's event log read as attempts, failures and goodput (P4, G1, the tests);
- ``cities_table``: a generated table with a text column and missing values;
- ``scaled_tables`` / ``default_runs``: generated tables with features on scales from 0.01 to
  1000, and a job trained on them with the DAG's defaults, scored beside scikit-learn's MLP;
- ``result_file``: the ``--json`` result file of a benchmark script;
- ``metadata_server`` / ``spot_runs``: a fake EC2 instance metadata service (IMDSv2) whose spot
  interruption notice a test switches on, and a real job that gets the notice mid-training;
- ``server_load``: each parameter server's share of a model by MXNet's key assignment, and its
  measured traffic (``ss``) and memory while a local job runs (``benchmarks/big_model.py``);
- ``run_queue``: the machine's runnable threads sampled during a benchmark, for the planner's fair share;
- ``periodic``: the sampler thread the benchmarks' samplers share (``sample()`` every period);
- ``s3_requests``: every S3 request of a job's processes counted by a boto3 event hook (a
  ``sitecustomize`` on the roles' ``PYTHONPATH``), read back by process, operation and key;
- ``waits``: waiting on a condition with a bound (never a fixed sleep and one read);
- ``tiny_model``: a tiny Gluon MLP trained in seconds and exported as the trainer exports (registry,
  review and scoring tests, the batch-scoring benchmark).
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO = str(ROOT)
