"""Connections: how gpt2-serve accepts them and how long a client may hold one without using it.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but it gives a request's headers
no time limit: a client that connects and sends nothing, or half a request line, holds its connection
for ever; and a client that reads none of its answer holds it in the send buffer for ever (a 147 MB dump,
say). `bounded_protocol` is uvicorn's h11 protocol with a deadline for the headers (a 408 in the API's error
shape, then the connection closes), a deadline for a client that leaves its answer unread (the connection
is dropped, its buffer freed) and a cap on open connections (a request on one beyond the cap is answered
503). The body's deadline is the request guard's (`server.middleware`), so that it
holds behind Ray Serve's proxy too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body
from .middleware import REFUSAL
from .settings import Settings

log = logging.getLogger(__name__)


def uvicorn_config(app: ASGIApp, settings: Settings) -> uvicorn.Config:
    """uvicorn's configuration for `app`, with the connection bounds of `settings`. The protocol and the
    event loop are named (not uvicorn's `auto`), so the server behaves the same whether or not httptools
    and uvloop are installed (Ray brings both)."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=False,
        http=bounded_protocol(settings.header_timeout, settings.max_connections, settings.write_timeout),
        loop="asyncio",
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]  # typed int; a float works
    )


def bounded_protocol(header_timeout: float, max_connections: int, write_timeout: float = 30.0) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with `header_timeout` seconds for each request's headers, `write_timeout` seconds
    for a client to take any of its answer once the send buffer is full, and at most `max_connections` open
    connections."""

    class BoundedH11Protocol(_BoundedH11Protocol):
        pass

    BoundedH11Protocol.header_timeout = header_timeout
    BoundedH11Protocol.max_connections = max_connections
    BoundedH11Protocol.write_timeout = write_timeout
    return BoundedH11Protocol


def _raw_response(status: int, reason: str, body: dict[str, Any]) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for answers sent outside h11's request cycle."""
    payload = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + payload


class _BoundedH11Protocol(H11Protocol):
    header_timeout: float = 10.0
    max_connections: int = 1024
    write_timeout: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self.limit_concurrency = None  # the cap is checked below, answered in the API's error shape
        self._app = self.app
        self.app = self._app_or_503

    # The headers' deadline starts when the connection opens, and again when the first bytes of a next
    # request arrive on a kept-alive connection (until then it is idle, and the keep-alive timeout applies).

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        self._stop_write_timer()
        super().connection_lost(exc)

    # The send buffer is full (asyncio's high-water mark): the answer waits there, and the app, whose sends
    # wait for room (uvicorn's flow control), with it. Each `write_timeout` while it stays full, the client must
    # have taken something (the buffer smaller than the last time): a slow reader goes on, one that takes
    # nothing is dropped.

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._watch_writes(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        self._stop_write_timer()
        super().resume_writing()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # an answer's tail can sit in the buffer under the high-water mark, never pausing the writes: its
        # deadline too (the connection would otherwise wait for it for ever, closing or kept alive)
        if self._write_timer is None and self.transport.get_write_buffer_size():
            self._watch_writes(self.transport.get_write_buffer_size())

    def _watch_writes(self, buffered: int) -> None:
        self._write_timer = self.loop.call_later(self.write_timeout, self._check_writes, buffered)

    def _stop_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _check_writes(self, buffered: int) -> None:
        now = self.transport.get_write_buffer_size()
        if now == 0:  # all taken
            self._write_timer = None
            return
        if now < buffered:  # the client took some: another period
            self._watch_writes(now)
            return
        self._write_timer = None
        log.info(
            "the client at %s took none of its answer for %g s (--write-timeout); dropping the connection",
            self.client,
            self.write_timeout,
        )
        self.transport.abort()  # its buffer goes, unsent; the app's waiting sends return (the client is gone)

    def _watch_headers(self) -> None:
        """Waiting for a request's headers (h11's client side is IDLE until they are complete): the timer
        runs; otherwise it stops."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)
        elif not waiting:
            self._stop_header_timer()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        message = f"the request's headers did not arrive within {self.header_timeout:g} s (--header-timeout)"
        log.info("%s; closing the connection from %s", message, self.client)
        # h11 cannot send a response to a request it has not seen: the bytes are written as they are.
        self.transport.write(_raw_response(408, "Request Timeout", error_body(408, message)))
        self.transport.close()

    async def _app_or_503(self, scope: Scope, receive: Receive, send: Send) -> None:
        if len(self.connections) > self.max_connections:  # the request guard answers it: a 503 with a request
            # id, logged and counted like every other answer
            scope[REFUSAL] = f"the server has {self.max_connections} connections open, its limit (--max-connections)"
        await self._app(scope, receive, send)
