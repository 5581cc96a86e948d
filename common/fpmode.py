"""Flush denormal floats to zero in a role process (x86-64: the MXCSR FTZ and DAZ bits).

Why: on x86 an operation on a denormal float (|x| < 1.18e-38 in float32) is many times slower
than on a normal one. Adam's first moment of a weight whose gradient has become zero
(a dead ReLU unit) decays by beta1 = 0.9 a step and crosses the denormal range a few hundred
steps later; in the LeNet job of ``benchmarks/trainer_throughput.py`` about 350,000 moments were
denormal from the third epoch on and each step took 1.5x as long (see benchmarks/README.md).
With FTZ a result that would be denormal is written as 0, and with DAZ a denormal input is read
as 0: the update such a value feeds is below a weight's float32 resolution anyway.

How: MXCSR is per thread, and a new thread starts with its creator's. MXNet's engine and
OpenMP threads are started by the process's main thread after ``import mxnet``, so setting the
bits on the main thread before that import covers every thread that runs an operator. glibc
exposes no setter for the two bits, so this reads the environment with ``fegetenv``, sets them
in the ``fenv_t``'s MXCSR word and writes it back with ``fesetenv``.

NumPy builds its float limits lazily (``np.finfo``, which mxnet's import asks for) and warns
when the smallest subnormal reads as zero, as any denormal does under DAZ; the common ones are
built and cached before the bits are set. Later reads of a denormal value in these threads,
``finfo(...).smallest_subnormal`` included, give 0.

Which roles do it is decided by the launcher: ``cluster.flush_denormals`` sets ``ENV`` in every
role's environment and each role entry point calls ``apply_from_env`` before importing mxnet.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

from common.settings import settings

log = logging.getLogger(__name__)

ENV = "MXPIPE_FLUSH_DENORMALS"
_FTZ, _DAZ = 1 << 15, 1 << 6
# x86-64 glibc's fenv_t: the 28-byte x87 environment, then the 32-bit MXCSR.
_FENV_SIZE, _MXCSR_OFFSET = 32, 28


def supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and platform.system() == "Linux"


def _libm() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")


def _mxcsr(libm: ctypes.CDLL) -> tuple[ctypes.Array[ctypes.c_char], int]:
    env = ctypes.create_string_buffer(_FENV_SIZE)
    if libm.fegetenv(env) != 0:
        raise OSError("fegetenv failed")
    return env, int.from_bytes(env.raw[_MXCSR_OFFSET:_FENV_SIZE], "little")


def flushing() -> bool:
    """Whether the calling thread flushes denormals (both bits set)."""
    if not supported():
        return False
    _, word = _mxcsr(_libm())
    return word & (_FTZ | _DAZ) == _FTZ | _DAZ


def flush_denormals() -> bool:
    """Set FTZ and DAZ on the calling thread (and so on every thread it starts from now on).

    Returns False, changing nothing, where the CPU or C library is not x86-64 Linux.
    """
    if not supported():
        log.info("denormals are not flushed: %s %s has no MXCSR", platform.system(), platform.machine())
        return False
    import numpy as np

    for dtype in (np.float16, np.float32, np.float64, np.longdouble):
        np.finfo(dtype)  # cached with the true limits before they become unmeasurable
    libm = _libm()
    env, word = _mxcsr(libm)
    raw = bytearray(env.raw)
    raw[_MXCSR_OFFSET:_FENV_SIZE] = (word | _FTZ | _DAZ).to_bytes(4, "little")
    if libm.fesetenv(ctypes.create_string_buffer(bytes(raw), _FENV_SIZE)) != 0:
        raise OSError("fesetenv failed")
    if not flushing():
        raise OSError("MXCSR did not take the FTZ/DAZ bits")
    return True


def apply_from_env() -> bool:
    """``flush_denormals()`` when the role's environment asks for it (``ENV``, which the launcher
    sets to ``1`` or ``0``); call it before ``import mxnet``."""
    return settings().flush_denormals and flush_denormals()
