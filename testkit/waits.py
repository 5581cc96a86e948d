"""Waiting on a condition with a bound: a test reads a state once it holds, never after a fixed
sleep (which is too short under load and too long otherwise)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], *, timeout_s: float, what: str, poll_s: float = 0.05) -> T:
    """The first truthy value of ``condition()``, polled every ``poll_s``; ``TimeoutError``
    naming ``what`` (and the last value seen) when none came within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g}s (last seen: {value!r})")
        time.sleep(poll_s)


def process_started(pid: int, argv: list[str], *, timeout_s: float = 30.0) -> None:
    """Wait until ``pid`` runs ``argv``: right after ``Popen`` returns the child may still be in
    its ``execve`` (the parent is released before the new program's arguments are in place), and
    its command line then reads as empty."""
    import psutil

    wait_for(lambda: psutil.Process(pid).cmdline() == list(argv), timeout_s=timeout_s,
             what=f"pid {pid} running {argv!r}")
