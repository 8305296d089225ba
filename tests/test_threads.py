"""Torch work off the engine's thread leaves no OpenMP threads behind (server/threads.py): each thread's
pool of them would cut the engine's threads' spinning between parallel regions once they outnumber the CPUs."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from model.loading import LoadedModel
from server.engine import Engine
from server.threads import ReleaseOpenMP, _libgomp_paths, _pauses, release_openmp_pool, run_in_threadpool

T = TypeVar("T")

pytestmark = [
    pytest.mark.skipif(not _pauses(), reason="torch's OpenMP here is not a libgomp with omp_pause_resource_all"),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc/self/task to list threads by"),
]


def threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def parallel_op() -> set[str]:
    """A torch op big enough to run on several threads; returns the threads it started (its pool's)."""
    before = threads()
    torch.ones(4_000_000).mul_(3.0).sum()
    return threads() - before


def ended(started: set[str], timeout: float = 5.0) -> bool:
    """Whether the threads `started` have all exited (libgomp's released threads end just after the call)."""
    deadline = time.monotonic() + timeout
    while started & threads():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def on_a_helper(fn: Callable[[], T]) -> T:
    with ThreadPoolExecutor(1) as helper:
        return helper.submit(fn).result()


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """The tests run torch on one thread (conftest.py), which starts no pool: two here."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_release_ends_the_pool_a_helper_thread_started() -> None:
    def work() -> tuple[set[str], bool]:  # checked on the helper: a thread's exit would end its pool too
        started = parallel_op()
        release_openmp_pool()
        return started, ended(started)

    started, gone = on_a_helper(work)
    assert started, "the op started no threads: nothing to check"
    assert gone


def test_release_leaves_other_threads_pools_alone() -> None:
    """Released on a thread without a pool, nothing ends: another thread's pool (the engine's) lives on."""
    started: list[set[str]] = []
    ready, done = threading.Event(), threading.Event()

    def holder() -> None:  # the engine's thread, say: a pool kept between its parallel regions
        started.append(parallel_op())
        ready.set()
        done.wait(10)
        release_openmp_pool()

    with ThreadPoolExecutor(1) as other:
        held = other.submit(holder)
        assert ready.wait(10)
        on_a_helper(release_openmp_pool)
        time.sleep(0.1)
        assert started[0] and started[0] <= threads()
        done.set()
        held.result()
    assert ended(started[0])


def test_run_in_threadpool_returns_the_result_and_leaves_no_pool() -> None:
    async def main() -> tuple[set[str], set[str], bool]:  # checked while the worker thread lives
        started, left = await run_in_threadpool(lambda: (parallel_op(), threads()))
        return started, left, ended(started)

    started, left, gone = asyncio.run(main())
    assert started and started <= left  # while the op's thread lived, its pool did
    assert gone


def test_run_in_threadpool_releases_the_pool_when_the_call_fails() -> None:
    started: list[set[str]] = []

    def failing() -> None:
        started.append(parallel_op())
        raise ValueError("encoding failed")

    async def main() -> bool:
        with pytest.raises(ValueError, match="encoding failed"):
            await run_in_threadpool(failing)
        return ended(started[0])

    assert asyncio.run(main()) and started[0]


def test_an_engine_releases_the_pool_of_the_thread_that_made_it(loaded: LoadedModel) -> None:
    """A model loaded and an engine made on one thread (a Ray replica's, an embedding program's): that
    thread's OpenMP threads end with the engine's construction, so only the engine's thread keeps a pool."""

    def work() -> tuple[set[str], bool]:
        started = parallel_op()
        Engine(loaded, max_batch_size=2)
        return started, ended(started)

    started, gone = on_a_helper(work)
    assert started and gone


def test_requests_leave_no_pool_on_the_event_loops_thread() -> None:
    """Torch work a handler does on the event loop (an edit's dump value cast, checked finite) leaves no
    OpenMP threads once its response starts, a stream's too (`ReleaseOpenMP`)."""
    started: list[set[str]] = []
    seen_in_stream: list[set[str]] = []

    async def plain(request: Request) -> Response:
        started.append(parallel_op())
        return PlainTextResponse("ok")

    async def streamed(request: Request) -> Response:
        started.append(parallel_op())

        async def body() -> AsyncIterator[bytes]:
            seen_in_stream.append(threads())
            yield b"data: 1\n\n"

        return StreamingResponse(body())

    app = ReleaseOpenMP(Starlette(routes=[Route("/plain", plain), Route("/stream", streamed)]))

    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [(await client.get(path)).status_code for path in ("/plain", "/stream")]

    assert asyncio.run(main()) == [200, 200]  # on this thread, which lives on: its pool would too
    assert all(started) and ended(started[0]) and ended(started[1])
    assert not started[1] & seen_in_stream[0]  # released before the body ran


def test_torchs_libgomp_can_release() -> None:
    """Where torch brings its own libgomp (its wheel on Linux), its release is found: not silently skipped.
    (Runtimes loaded later by other packages, CTranslate2's say, are not looked for.)"""
    torch_dir = str(Path(torch.__file__).parent)
    if not any(path.startswith(torch_dir) for path in _libgomp_paths()):
        pytest.skip("torch here brings no libgomp of its own")
    assert _pauses()
