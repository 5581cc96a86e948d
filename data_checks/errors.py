"""The deterministic failure kinds of the data stage: never worth a retry."""
from __future__ import annotations

from typing import Any

from common.errors import DataError

__all__ = ["DataError", "DataValidationError"]




class DataValidationError(DataError):
    """The shards failed one or more validation checks.

    ``failures`` holds one dict per failed expectation or check (``expectation``, ``column``,
    counts, a few ``examples``); the message lists each of them.
    """

    def __init__(self, message: str, failures: list[dict[str, Any]], report_uri: str | None = None) -> None:
        super().__init__(message)
        self.failures = failures
        self.report_uri = report_uri

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the failures when the exception crosses a process boundary (pickled).
        return (type(self), (str(self), self.failures, self.report_uri))
