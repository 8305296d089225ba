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
pool and no other): the routes run their encoders through `run_in_threadpool` here, which does so, and
`ReleaseOpenMP` does it on the event loop's thread around every request (parsing an edit casts its dump
value there). Where torch uses another OpenMP runtime, or a libgomp without that call, releasing does
nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch  # noqa: F401  (its OpenMP runtime loaded before `_pauses` looks for it)
from starlette.concurrency import run_in_threadpool as _run_in_threadpool
from starlette.types import Message, Receive, Scope, Send

from .asgi import HTTPOnly

P = ParamSpec("P")
T = TypeVar("T")

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the runtime may keep what it can rebuild cheaply


def _libgomp_paths() -> list[str]:
    """The GNU OpenMP runtimes loaded in this process (torch's; older torch wheels name theirs
    libgomp-<hash>.so.1, and our kernels may bring the system's), as /proc/self/maps lists them."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:  # not Linux
        return []
    return sorted(p for p in paths if Path(p).name.startswith("libgomp"))


@cache
def _pauses() -> tuple[Callable[[int], int], ...]:
    """Each loaded libgomp's omp_pause_resource_all (looked up once, torch imported: its runtime loaded).
    Never a second copy of a library (RTLD_NOLOAD), and not LLVM's runtime under libgomp's name (it has
    `__kmpc_fork_call`), whose pause would stop every thread's pool, the engine's too."""
    found = []
    for path in _libgomp_paths():
        try:
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
            pause = lib.omp_pause_resource_all  # OpenMP 5.0: libgomp from GCC 9 on
        except (OSError, AttributeError):
            continue
        if hasattr(lib, "__kmpc_fork_call"):
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        found.append(pause)
    return tuple(found)


def release_openmp_pool() -> None:
    """End the OpenMP threads this thread started (none: nothing happens; inside a parallel region: libgomp
    refuses). The next parallel region on this thread starts a pool again; call it where a thread's torch
    work is done for now."""
    for pause in _pauses():
        pause(OMP_PAUSE_SOFT)


async def run_in_threadpool(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Starlette's `run_in_threadpool`, with the worker thread's OpenMP pool released afterwards."""

    def call() -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            release_openmp_pool()

    return await _run_in_threadpool(call)


class ReleaseOpenMP(HTTPOnly):
    """Plain ASGI: releases the event loop's thread's pool when a response starts (the handler's own work
    is done: edits parsed, a dump value cast to float32, checked finite) and when it has been sent. The loop
    runs a little torch work of its own, and its thread lives as long as the server."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                release_openmp_pool()
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            release_openmp_pool()
