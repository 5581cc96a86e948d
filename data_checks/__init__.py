"""Shard a source dataset into per-worker RecordIO shards with a manifest, and validate them.

Sharding is ``sources`` → ``readers`` / ``images`` → ``preprocess`` → ``assign`` → ``shard``;
validation is ``suites`` → ``validate`` → ``cross`` → ``report``; a batch-scoring input is
``sources`` → ``score_input`` → ``score_checks``.

- ``sources``: find the files of a source dataset, fingerprint them, open them as byte streams.
- ``filesystems``: which fsspec filesystem reads a source URI, with which options and errors.
- ``readers``: stream a table source (CSV, CSV.gz, Parquet; one or many files) as bounded chunks.
- ``images``: stream an image folder (images + ``labels.csv``) as bounded chunks of features.
- ``preprocess``: table preprocessing, fitted on the train split at shard time, applied to all.
- ``assign``: seeded, streaming assignment of rows to train/val/test and to balanced train shards.
- ``shard``: write the RecordIO shards, committing the manifest last.
- ``parts``: the same shards from parts of the source (mapped tasks: plan, count, shard, merge).
- ``suites``: Great Expectations suites, one function per dataset kind, and the code that runs them.
- ``validate``: one Great Expectations run per committed shard, then the cross-shard checks.
- ``cross``: checks that need every shard at once (cross-shard consistency, drift).
- ``report``: the validation report: JSON, a small HTML page, the failure message.
- ``score_input``: a batch-scoring input: its files, fingerprint and parts, its rows in chunks.
- ``score_checks``: a batch-scoring input checked against the training manifest: schema, drift.
- ``errors``: the deterministic failure kinds of the data stage (never worth a retry).
- ``__main__``: the command line of the data stage; runs with no Airflow at all.

Nothing here imports Airflow, and importing this package is cheap: pandas, pyarrow, mxnet and
Great Expectations are imported by the functions that need them.
"""
from data_checks.errors import DataError, DataValidationError

__all__ = ["DataError", "DataValidationError"]
