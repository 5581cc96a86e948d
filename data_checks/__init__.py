"""Shard a source table into per-worker RecordIO shards with a manifest, and validate them.

Nothing here imports Airflow, and importing this package is cheap: pandas, mxnet and Great
Expectations are imported by the modules that need them (``sources``, ``shard``, ``validate``),
which only task bodies and the CLI import.
"""
from data_checks.errors import DataError, DataValidationError

__all__ = ["DataError", "DataValidationError"]
