"""gpt2-serve: load GPT-2 and serve it over HTTP with uvicorn.

gpt2-serve --model gpt2 --port 8000
GPT2_API_KEY=secret gpt2-serve --model ./my-checkpoint --host 0.0.0.0
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import uvicorn

from model.cpus import size_threads

from .app import create_app, freeze_long_lived, load_failure
from .connections import uvicorn_config
from .settings import parse_settings

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
        print(f"gpt2-serve: error: {load_failure(failures[0])}", file=sys.stderr)
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
