"""Shard a source dataset into per-worker RecordIO shards with a manifest, and validate them.

``sources`` (find + fingerprint the files) → ``readers`` / ``images`` (stream bounded chunks) →
``assign`` (seeded stratified split, balanced shards) → ``shard`` (write, commit manifest last).
``suites`` (GX suites per dataset kind) → ``validate`` (per shard) → ``cross`` (cross-shard checks,
drift) → ``report`` (JSON, HTML, failure message).

Nothing here imports Airflow, and importing this package is cheap: pandas, pyarrow, mxnet and
Great Expectations are imported by the functions that need them.
"""
from data_checks.errors import DataError, DataValidationError

__all__ = ["DataError", "DataValidationError"]
