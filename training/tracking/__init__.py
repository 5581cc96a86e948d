"""Everything MLflow: runs, parameters, the pyfunc model, registration, review, warm start, live runs.

Owns: where the MLflow tracking server is (``server``), finding or creating a DAG run's run with
bounded MLflow calls (``runs``), the run kept live while its job trains (epoch curves, system
metrics, cost; fed by the supervisor with the roles' lines, read as ``common.events``: ``live``),
what a run consumed and recomputed (``cost``), flattening the config into MLflow params
(``mlflow_params``), the run's extras (plots, dataset input: ``run_extras``), the
self-contained pyfunc model file (``pyfunc_model``), logging and registering a trained job
(``registry``), scoring a model on a test split (``evaluation``), the challenger-vs-champion
comparison (``review``), the automatic gate before a human review (``gate``) and resolving a
``models:/`` warm start to a checkpoint (``warm_start``). Runs in Airflow tasks, CLIs and the
supervisor, never in a role process. May import ``common`` and
``training.feed``/``training.checkpoint`` (to read test splits and checkpoints); never
``training.loop``.
"""
