"""Torch work on threads other than the engine's, without slowing the engine's.

Torch's CPU kernels and ours run on OpenMP (GNU libgomp, torch's own copy, on Linux). libgomp gives every
thread that starts a parallel region a pool of threads of its own, and keeps it for as long as that thread
lives. Once the threads of all pools outnumber the CPUs, libgomp stops letting any pool's threads spin
between parallel regions (its "throttled" spin count: about a hundred turns): they sleep at once, and each
of the engine's regions, a few hundred in a decode step, first waits for the kernel to wake its other
threads. One long-lived helper thread that has run one parallel torch op (an activation dump cast to
float16 on one of Starlette's worker threads, a model loaded on the thread that later serves HTTP) is
enough: measured on a 2-core host, bench_server's 16-client level replayed on an engine thread, 321-333
tok/s alone, 280-299 with such a helper alive, 321-328 with the helper's pool released.

So whatever runs torch work off the engine's thread releases that thread's pool when it is done
(`release_openmp_pool`, OpenMP 5.0's `omp_pause_resource_all`, which in libgomp ends the calling thread's
pool), and the routes run their encoders through `run_in_threadpool` here, which does so. Where torch
uses another OpenMP runtime, or a libgomp without that call, releasing does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache
from typing import ParamSpec, TypeVar

from starlette.concurrency import run_in_threadpool as _run_in_threadpool

P = ParamSpec("P")
T = TypeVar("T")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the runtime may keep what it can rebuild cheaply


@cache
def _pause() -> Callable[[int], int] | None:
    """libgomp's omp_pause_resource_all, if torch has loaded libgomp (never a second copy: RTLD_NOLOAD)."""
    try:
        lib = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):  # not loaded (another runtime, not Linux), or older than OpenMP 5.0
        return None
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause


def release_openmp_pool() -> None:
    """End the OpenMP threads this thread started (none: nothing happens). The next parallel region on
    this thread starts a pool again; call it where a thread's torch work is done for now."""
    pause = _pause()
    if pause is not None:
        pause(OMP_PAUSE_SOFT)


async def run_in_threadpool(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Starlette's `run_in_threadpool`, with the worker thread's OpenMP pool released afterwards."""

    def call() -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            release_openmp_pool()

    return await _run_in_threadpool(call)
