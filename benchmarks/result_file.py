"""The ``--json OUT`` file of a benchmark script.

``benchmarks/run.py`` runs every script with ``--json <temp file>`` and, when the script exits 0,
reads that file back with ``json.load`` as the script's result; the same file is what a person
gets from running one script by hand with ``--json``. Writing it in one place keeps the format
(indented JSON, one document) the same for every script.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def write_json(path: str | None, result: Any, *, default: Callable[[Any], Any] | None = None) -> None:
    """Write ``result`` to ``path`` as indented JSON; nothing when no ``--json`` was given.

    ``default`` converts what JSON cannot hold (``str`` for paths and enums in the chaos report).
    """
    if not path:
        return
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2, default=default)
