"""Real `gpt2-serve` processes for the end-to-end tests: a free loopback port, start, wait, stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT = 180.0  # seconds: importing torch on a loaded 2-core machine can take a while


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m server ARGS`, its stderr (where it logs) to `log`. One intra-op thread: the test models
    gain nothing from more, and on a shared 2-core machine the threads mostly wait on each other."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with log.open("wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "server", *args],
            cwd=ROOT,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def wait_ready(process: subprocess.Popen[bytes], url: str, log: Path, timeout: float = STARTUP_TIMEOUT) -> None:
    """Poll `url`/health until it answers 200; fail the test, showing the server's log, if the process
    exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            pytest.fail(f"gpt2-serve exited with {process.returncode}:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"gpt2-serve not ready after {timeout:.0f} s:\n{log.read_text(errors='replace')}")
        time.sleep(0.1)


@contextmanager
def served(args: list[str], log: Path) -> Iterator[str]:
    """A real `gpt2-serve` (its own process) with ARGS on a free port, ready: yields its URL, then stops it."""
    port = free_port()
    process = launch([*args, "--port", str(port)], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, url, log)
        yield url
    finally:
        shut_down(process)


def shut_down(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=20)
