"""The MXNet parameter-server trainer. Never imports Airflow; importing this package is cheap
(mxnet is imported only inside the modules that run training).

- ``feed``: the data feed of a worker: shards in, batches out.
- ``checkpoint``: checkpoints of a job: what is in one, how it is committed, when one is written.
- ``loop``: the training loop of one worker role and everything a step needs.
- ``launch``: starting and supervising a job: the job spec, the role launcher, the supervisor.
- ``tracking``: everything MLflow: runs, parameters, the pyfunc model, registration, review.
- ``train_job``: a DAG run's job, attempt by attempt: its spec, staged code, warm start, result.
- ``__main__``: the trainer's command line; runs with no Airflow at all.
"""
