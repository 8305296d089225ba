"""Torch work off the engine's thread leaves no OpenMP threads behind (server/threads.py): each thread's
pool of them would cut the engine's threads' spinning between parallel regions once they outnumber the CPUs."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from model.loading import LoadedModel
from server.engine import Engine
from server.threads import _pause, release_openmp_pool, run_in_threadpool

T = TypeVar("T")

pytestmark = [
    pytest.mark.skipif(_pause() is None, reason="torch's OpenMP here is not a libgomp with omp_pause_resource_all"),
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="no /proc/self/task to list threads by"),
]


def threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def parallel_op() -> set[str]:
    """A torch op big enough to run on several threads; returns the threads it started (its pool's)."""
    before = threads()
    torch.ones(4_000_000).mul_(3.0).sum()
    return threads() - before


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
    def work() -> tuple[set[str], set[str]]:
        started = parallel_op()
        release_openmp_pool()
        return started, threads()

    started, after = on_a_helper(work)
    assert started, "the op started no threads: nothing to check"
    assert not started & after


def test_release_on_a_thread_without_a_pool_does_nothing() -> None:
    def work() -> tuple[set[str], set[str]]:
        before = threads()
        release_openmp_pool()
        return before, threads()

    before, after = on_a_helper(work)
    assert before == after


def test_run_in_threadpool_returns_the_result_and_leaves_no_pool() -> None:
    started, left = asyncio.run(run_in_threadpool(lambda: (parallel_op(), threads())))
    assert started and started <= left  # while the op's thread lived, its pool did
    assert not started & threads()


def test_run_in_threadpool_releases_the_pool_when_the_call_fails() -> None:
    started: list[set[str]] = []

    def failing() -> None:
        started.append(parallel_op())
        raise ValueError("encoding failed")

    with pytest.raises(ValueError, match="encoding failed"):
        asyncio.run(run_in_threadpool(failing))
    assert started[0] and not started[0] & threads()


def test_an_engine_releases_the_pool_of_the_thread_that_made_it(loaded: LoadedModel) -> None:
    """A model loaded and an engine made on one thread (a Ray replica's, an embedding program's): that
    thread's OpenMP threads end with the engine's construction, so only the engine's thread keeps a pool."""

    def work() -> tuple[set[str], set[str]]:
        started = parallel_op()
        Engine(loaded, max_batch_size=2)
        return started, threads()

    started, after = on_a_helper(work)
    assert started and not started & after
