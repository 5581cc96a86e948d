"""Error kinds shared across layers."""
from __future__ import annotations


class DataError(ValueError):
    """A deterministic problem with the data (missing, empty, malformed, too small to split).

    The message names the problem and the URI or column, so a failed task reads as a diagnosis.
    """
