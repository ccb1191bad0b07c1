"""glibc malloc settings for fedpriv's compute processes: keep freed memory.

A step of the deep and few-shot families allocates and frees the same large tensors chunk
after chunk (rows, activations, their gradients, float64 blocks). By default glibc serves a
block above its mmap threshold (128 KiB, raised on the fly up to 32 MiB) with a fresh ``mmap``
and hands free memory at the top of its heap back to the system beyond twice that, so each
chunk's tensors land on pages the kernel faults in and zeroes again. With the threshold fixed
at its 64-bit maximum (32 MiB), freed memory kept (trim threshold) and the heap grown in large
steps (top pad), a chunk reuses the pages of the one before; blocks above 32 MiB are still
mapped and unmapped. The cost: a process keeps its peak memory until it exits. Measured in
docs/measurements.md ("glibc malloc settings of fedpriv's processes"); how to change it:
docs/reference/environment.md ("Malloc settings").

``tune()`` applies them with ``mallopt`` in a running process; it is called by the processes
fedpriv starts or owns (the ``fedpriv`` command, the Flower app's ServerApp and ClientApp),
and ``ENV`` passes the same settings to a process about to start (sweep workers). A program
that imports fedpriv as a library keeps its allocator unless it calls ``tune()``. Nothing
changes (``wanted``) where the environment holds the user's own malloc settings (any
``MALLOC_*`` variable, ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``: glibc applies those),
with ``FEDPRIV_MALLOC=system``, or where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Mapping

# (environment variable, mallopt parameter of malloc.h, value)
SETTINGS = (("MALLOC_MMAP_THRESHOLD_", -3, 32 * 2**20),  # M_MMAP_THRESHOLD: its 64-bit maximum
            ("MALLOC_TRIM_THRESHOLD_", -1, 2**31 - 1),  # M_TRIM_THRESHOLD: keep freed memory
            ("MALLOC_TOP_PAD_", -2, 512 * 2**20))  # M_TOP_PAD: grow the heap in large steps
ENV = {name: str(value) for name, _, value in SETTINGS}

@functools.cache
def tune() -> tuple[str, ...]:
    """Apply ``SETTINGS`` in this process, once (module docstring); the names of the
    variables whose settings are in force through this call (empty where nothing changed)."""
    if not wanted():
        return ()
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return ()
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return tuple(name for name, parameter, value in SETTINGS if mallopt(parameter, value) == 1)


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether fedpriv's settings apply under ``environ`` (default: this process's): glibc,
    no ``FEDPRIV_MALLOC=system``, and none of the user's own malloc settings (a ``MALLOC_*``
    variable, or ``glibc.malloc`` tunables in ``GLIBC_TUNABLES``)."""
    env = os.environ if environ is None else environ
    if env.get("FEDPRIV_MALLOC", "") == "system" or "glibc.malloc." in env.get(
            "GLIBC_TUNABLES", "") or any(name.startswith("MALLOC_") for name in env):
        return False
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

