"""Everything MLflow: runs, parameters, the pyfunc model, registration, review, warm start, live runs.

- ``mlflow_params``: flattening the config into MLflow params.
- ``run_extras``: the run's extras (plots, dataset input).
- ``pyfunc_model``: the self-contained pyfunc model file.
- ``registry``: logging and registering a model run (``ModelRunRequest``).
- ``job_registration``: a DAG run's trained job registered: artefacts, tags, headline metrics.
- ``evaluation``: scoring a model on a test split (``score_model``, for registration and review).
- ``review``: the challenger-vs-champion comparison.
- ``gate``: the automatic gate before a human review.
- ``model_card``: a registered version's model card (Markdown, HTML), its summary for the review.
- ``warm_start``: resolving a ``models:/`` warm start to a checkpoint.
- ``batch_score``: batch scoring with a registered version: resolving it, the output's prefix,
  deterministic Parquet parts, the output manifest.
- ``server``: where the MLflow tracking server is, the one resolver every task and CLI uses.
- ``runs``: the MLflow runs a DAG run writes to, and the bounded client settings of every call.
- ``live``: the DAG run's MLflow run while its training runs: curves, system metrics, end state,
  fed by the supervisor with the roles' ``common.events``.
- ``reuse``: finding an earlier run's version trained on the same inputs, and recording its reuse.
- ``cost``: what a run consumed, as MLflow metrics (core-seconds per role, GPU-seconds).

Runs in Airflow tasks, CLIs and the supervisor, never in a role process. May import ``common``
and ``training.feed``/``training.checkpoint`` (to read test splits and checkpoints); never
``training.loop``.
"""
