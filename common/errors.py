"""Error kinds shared across layers.

``DeterministicError`` is the one mark of a failure that retrying cannot help: the same inputs
(config, data, settings, a job document) fail the same way every time. Whatever decides between
"fail for good" and "retry" (a worker's exit code, ``training/__main__.py``) looks at this class
only; any other exception, a library's plain ``ValueError`` included, is a retryable failure.
"""
from __future__ import annotations


class DeterministicError(Exception):
    """Retrying cannot help: bad input, config, data or settings. The message names the problem.

    Subclasses that callers catch as ``ValueError`` (pydantic turns a ``ValueError`` raised in a
    validator into a validation error, for one) derive from ``ValueError`` too; that second base
    is for those callers, never for the retry decision.
    """


class DataError(DeterministicError, ValueError):
    """A deterministic problem with the data (missing, empty, malformed, too small to split).

    The message names the problem and the URI or column, so a failed task reads as a diagnosis.
    """
