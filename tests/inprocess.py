"""The in-process server the HTTP tests share: an app around the already-loaded `tiny` model with the
contract's limits, and the small helpers every such test uses (a good request that must succeed, waiting
for a condition, holding the engine's thread so that requests queue up, a request whose client leaves when
told)."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from contract import GEN, LIMITS
from fastapi.testclient import TestClient

from model.loading import LoadedModel
from server.app import create_app
from server.engine import Engine
from server.settings import Settings


def settings(**overrides: Any) -> Settings:
    return Settings(**{"model": "tiny", **LIMITS, **overrides})


@contextmanager
def serve(loaded: LoadedModel, **overrides: Any) -> Iterator[TestClient]:
    app = create_app(settings(**overrides), loaded=loaded)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def post_ok(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def assert_still_serving(client: TestClient) -> None:
    body = post_ok(client, GEN, {"prompt": "Hello", "max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert len(body["choices"][0]["token_ids"]) == 2


def wait_until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


@contextmanager
def engine_held(client: TestClient) -> Iterator[Engine]:
    """Hold the engine's thread in a job (`Engine.call`), so that requests queue up until the block ends."""
    engine: Engine = client.app.state.engine  # type: ignore[attr-defined]
    started, release = threading.Event(), threading.Event()

    def hold(_: Any) -> None:
        started.set()
        release.wait(30)

    assert client.portal is not None
    job = client.portal.start_task_soon(engine.call, hold)
    assert started.wait(10), "the engine did not run the job"
    try:
        yield engine
    finally:
        release.set()
        job.result(10)


@contextmanager
def nth_job_held(client: TestClient, monkeypatch: Any, n: int) -> Iterator[tuple[list[object], threading.Event]]:
    """Log the engine's jobs from now on (their functions, as they start) and hold the `n`th as it starts, until
    the block ends: yields the log and an event set once that job runs, so that a client can leave meanwhile."""
    engine: Engine = client.app.state.engine  # type: ignore[attr-defined]
    jobs: list[object] = []
    running, release = threading.Event(), threading.Event()
    run_job = engine._run_job

    def held(job: Any) -> None:
        jobs.append(job.fn)
        if len(jobs) == n:
            running.set()
            release.wait(30)
        run_job(job)

    monkeypatch.setattr(engine, "_run_job", held)
    try:
        yield jobs, running
    finally:
        release.set()


def log_engine(client: TestClient, monkeypatch: Any, jobs: int = 0) -> list[str]:
    """A log of the engine's decode steps ("step", while sequences decode) and of its jobs, each logged as
    what it runs: "<class>.step#<the pass's number>" for a pass's piece (passes numbered as they first run),
    else the function's name. With `jobs`, the decoding sequences wait before each step after their first
    (up to 20 s, then no more) until a job is queued, until `jobs` have run: a test that interleaves that many
    jobs with a generation's steps then does not depend on how fast the generation runs against the requests
    that queue them (on a loaded host, a short generation could end before the jobs came, or between two)."""
    engine = client.app.state.engine  # type: ignore[attr-defined]
    log: list[str] = []
    passes: list[object] = []
    real_step, real_job = engine._step, engine._run_job
    waits = jobs > 0

    def step() -> None:
        nonlocal waits
        if len(engine._batch):
            if waits and "step" in log and sum(e != "step" for e in log) < jobs:
                deadline = time.monotonic() + 20
                while not engine._jobs and time.monotonic() < deadline:  # not under the engine's lock: a peek
                    time.sleep(0.002)
                waits = bool(engine._jobs)  # ran out: the test's own checks say what went wrong
            log.append("step")
        real_step()

    def job(job: Any) -> None:
        owner = getattr(job.fn, "__self__", None)
        if owner is None:
            log.append(job.fn.__name__)
        else:
            passes.extend([owner] if owner not in passes else [])
            log.append(f"{type(owner).__name__}.step#{passes.index(owner)}")
        real_job(job)

    monkeypatch.setattr(engine, "_step", step)
    monkeypatch.setattr(engine, "_run_job", job)
    return log


def assert_interleaved(log: list[str], calls: list[int]) -> None:
    """While the generation still decodes, a decode step between every two of `calls` (indices into `log`),
    and at least one such pair."""
    last_step = max(i for i, e in enumerate(log) if e == "step")
    assert calls[0] < last_step, "the jobs came after the generation ended: nothing was interleaved"
    pairs = [(a, b) for a, b in itertools.pairwise(calls) if b < last_step]
    assert pairs or len(calls) == 1, f"the generation ended after the first job: nothing was interleaved {log}"
    for a, b in pairs:
        assert "step" in log[a:b], log


def wrap_forward_passes(monkeypatch: Any, model: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Send every forward pass of `model` through `wrap(original)`: the eager `GPT.forward` and, on a CPU,
    the fused pass (`FusedDecode.forward`, which decode steps without hooks take instead), so that a test
    that makes "the forward pass" fail or wait reaches both."""
    from model.kernels.decode import FusedDecode

    monkeypatch.setattr(model, "forward", wrap(model.forward))
    fused = wrap(FusedDecode.forward)  # called with the FusedDecode as its first argument
    monkeypatch.setattr(FusedDecode, "forward", lambda self, *args, **kwargs: fused(self, *args, **kwargs))


def on_event_loop() -> bool:
    """Whether the caller runs on an event loop's thread (not on a worker thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # a worker thread
        return False
    return True


class RawRequest:
    """A request sent to the app as raw ASGI, so that its client leaves exactly when told (`leave`)."""

    def __init__(self, client: TestClient, path: str, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.client, self.gone = client, asyncio.Event()
        self.sent: list[dict[str, Any]] = []
        messages = iter([{"type": "http.request", "body": data, "more_body": False}])

        async def receive() -> dict[str, Any]:
            message = next(messages, None)
            if message is None:
                await self.gone.wait()
                return {"type": "http.disconnect"}
            return message

        async def send(message: dict[str, Any]) -> None:
            self.sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        assert client.portal is not None
        self.task = client.portal.start_task_soon(client.app, scope, receive, send)

    def leave(self) -> int:
        """The client disconnects; returns the status the server answered with."""
        assert self.client.portal is not None
        self.client.portal.call(self.gone.set)
        self.task.result(10)
        status: int = self.sent[0]["status"]
        return status
