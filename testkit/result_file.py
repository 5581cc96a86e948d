"""The ``--json OUT`` file of a benchmark script.

``benchmarks/run.py`` runs every script with ``--json <temp file>`` and, when the script exits 0,
reads that file back with ``json.load`` as the script's result; the same file is what a person
gets from running one script by hand with ``--json``. Writing it in one place keeps the format
(indented JSON, one document) the same for every script. A result that is a JSON object also
records the command that produced it (``"command"``: the script and its arguments, without
``--json``), so ``benchmarks/run --record ID=FILE`` can put a figure measured by hand into the
report with the command that reproduces it.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any


def write_json(path: str | None, result: Any, *, default: Callable[[Any], Any] | None = None) -> None:
    """Write ``result`` to ``path`` as indented JSON; nothing when no ``--json`` was given.

    ``default`` converts what JSON cannot hold (``str`` for paths and enums in the chaos report).
    """
    if not path:
        return
    if isinstance(result, dict):
        result = {**result, "command": command_line(sys.argv)}
    with open(path, "w") as fh:
        json.dump(result, fh, indent=2, default=default)


def command_line(argv: list[str]) -> str:
    """``benchmarks/<script> <args>`` of a script's ``argv``, its ``--json`` option left out."""
    args, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif not arg.startswith("--json="):
            args.append(arg)
    return " ".join([f"benchmarks/{os.path.basename(argv[0])}", *args])
