"""The MXNet parameter-server trainer. Never imports Airflow; importing this package is cheap
(mxnet is imported only inside the modules that run training)."""
