"""The MXNet parameter-server trainer. Never imports Airflow; importing this package is cheap
(mxnet is imported only inside the modules that run training). Its top-level modules join its
parts: the CLI (``__main__``) and a DAG run's job, attempt by attempt (``train_job``)."""
