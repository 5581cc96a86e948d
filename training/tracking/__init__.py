"""Everything MLflow: runs, parameters, the pyfunc model, registration, review, warm start.

Owns: flattening the config into MLflow params (``mlflow_params``), the run's extras (plots,
dataset input: ``run_extras``), the self-contained pyfunc model file (``pyfunc_model``),
logging and registering a model run (``registry``), a DAG run's trained job registered
(``job_registration``), scoring a model on a test split (``evaluation.score_model``, for
registration and review alike), the challenger-vs-champion comparison (``review``), the automatic gate
before a human review (``gate``) and resolving a ``models:/`` warm start to a checkpoint
(``warm_start``). Runs in Airflow tasks and CLIs, never
in a role process. May import ``common`` and ``training.feed``/``training.checkpoint`` (to read
test splits and checkpoints); never ``training.loop``.
"""
