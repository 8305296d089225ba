"""gpt2-serve: load GPT-2 and serve it over HTTP with uvicorn.

gpt2-serve --model gpt2 --port 8000
GPT2_API_KEY=secret gpt2-serve --model ./my-checkpoint --host 0.0.0.0
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
import uvicorn

from .app import create_app, freeze_long_lived
from .connections import uvicorn_config
from .settings import CGROUP, available_cpus, parse_settings

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    failures: list[Exception] = []

    def on_load_error(error: Exception) -> None:
        failures.append(error)
        server.should_exit = True

    try:  # before loading the model: uvicorn would bind only after starting the load, then exit mid-load
        sock = _bind(settings.host, settings.port)
    except OSError as e:
        print(
            f"gpt2-serve: error: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", file=sys.stderr
        )
        return 1
    size_threads(os.environ)
    app = create_app(settings, on_load_error=on_load_error, on_loaded=freeze_long_lived)
    server = uvicorn.Server(uvicorn_config(app, settings))
    log.info("listening on %s port %d", settings.host, settings.port)
    server.run(sockets=[sock])
    if failures:
        print(f"gpt2-serve: error: cannot load the model: {failures[0]}", file=sys.stderr)
        return 1
    return 0


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, as uvicorn binds one (IPv6 when the host has a colon)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def threads_for(default: int, environ: Mapping[str, str], cgroup: Path = CGROUP) -> int | None:
    """Torch's threads for this process: None where `OMP_NUM_THREADS` names them (torch has read it already),
    else torch's `default` (the host's cores, whatever the container allows) cut to `available_cpus`. Never
    more than the default: on a host with SMT torch counts physical cores, and threads on sibling hyperthreads
    only contend."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    return min(default, available_cpus(cgroup))


def size_threads(environ: Mapping[str, str]) -> None:
    """Set torch's threads (`threads_for`) before the model loads, saying so where that changes them."""
    default = torch.get_num_threads()
    threads = threads_for(default, environ)
    if threads is None or threads == default:  # torch's own choice stands: said only at --log-level debug
        log.debug("torch threads: %d (%s)", default, "OMP_NUM_THREADS" if threads is None else "torch's default")
        return
    torch.set_num_threads(threads)
    log.info(
        "torch threads: %d (the CPUs this process may use, by its affinity and its cgroup's CPU quota; torch's "
        "default was %d; set OMP_NUM_THREADS to choose)",
        threads,
        default,
    )
