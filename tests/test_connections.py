"""Slow and idle clients, with raw sockets against a real uvicorn server (gpt2-serve's configuration, in a
thread of this process around the loaded tiny model): headers or a body that never finish are a 408 and
the connection closes, an idle keep-alive connection is closed, a request beyond the connection cap is a
503; after each, a good request still succeeds."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from contract import GEN
from fastapi.testclient import TestClient
from inprocess import settings, wait_until

from model.loading import LoadedModel
from server import encoding
from server.app import create_app
from server.cli import _bind
from server.connections import uvicorn_config
from server.engine import Engine
from server.middleware import Sparse
from server.settings import parse_settings

GUARD = 60.0  # seconds a socket waits before the test fails as hung (a guard, not a measured bound)


@dataclass
class Running:
    server: uvicorn.Server
    host: str
    port: int
    thread: threading.Thread

    def stop(self) -> None:
        """Shut the server down now (as the block's end would): its drain runs, then it exits."""
        self.server.should_exit = True
        self.thread.join(GUARD)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=GUARD)
        return sock

    def open_connections(self) -> int:
        return len(self.server.server_state.connections)


@contextmanager
def running(loaded: LoadedModel, **overrides: Any) -> Iterator[Running]:
    s = settings(host="127.0.0.1", port=1, **overrides)  # the port is the bound socket's
    sock = _bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(create_app(s, loaded=loaded), s))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=GUARD)
        yield Running(server, "127.0.0.1", port, thread)
    finally:
        server.should_exit = True
        thread.join(GUARD)
        sock.close()


@pytest.fixture(scope="module")
def strict(loaded: LoadedModel) -> Iterator[Running]:
    """Short bounds, so that each case ends in about a second."""
    with running(loaded, header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1.0) as r:
        yield r


@contextmanager
def uvicorn_log(level: int) -> Iterator[list[logging.LogRecord]]:
    """The records uvicorn's error log takes at `level` and above while the block runs (that log does not
    propagate to caplog's handler). Enter it once the server is `running`: configuring uvicorn (its
    `dictConfig`) takes every handler off that log."""
    records: list[logging.LogRecord] = []
    logger = logging.getLogger("uvicorn.error")
    catch = logging.Handler(level)
    catch.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(catch)
    try:
        yield records
    finally:
        logger.removeHandler(catch)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout guards a hang)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def parse(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def assert_good_request(r: Running, headers: dict[str, str] | None = None) -> None:
    body = {"input_ids": [464, 3797], "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(r.url + GEN, json=body, headers=headers, timeout=GUARD)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"][0]["token_ids"]) == 2


def test_headers_that_never_finish_are_a_408_and_the_connection_closes(strict: Running) -> None:
    with strict.connect() as sock:
        sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: app")  # and nothing more
        status, headers, body = parse(read_until_closed(sock))
    assert status == 408
    assert headers["connection"] == "close"
    assert body["error"]["type"] == "request_timeout"
    assert "headers did not arrive within 1 s (--header-timeout)" in body["error"]["message"]
    assert_good_request(strict)


def test_a_connection_that_sends_nothing_is_a_408(strict: Running) -> None:
    with strict.connect() as sock:
        status, _, body = parse(read_until_closed(sock))
    assert status == 408 and "--header-timeout" in body["error"]["message"]
    assert_good_request(strict)


def test_a_body_shorter_than_its_content_length_is_a_408_and_the_connection_closes(strict: Running) -> None:
    with strict.connect() as sock:
        head = f"POST {GEN} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        sock.sendall(head.encode() + b'{"input_ids": [464')  # 18 of the 1000 bytes announced
        status, headers, body = parse(read_until_closed(sock))
    assert status == 408
    assert headers["connection"] == "close"
    assert body["error"]["type"] == "request_timeout"
    assert "body did not arrive within 1 s (--body-timeout)" in body["error"]["message"]
    assert_good_request(strict)


def test_an_idle_keep_alive_connection_is_closed(strict: Running) -> None:
    """A request served on a kept-alive connection; then nothing: the server closes it (the keep-alive
    timeout, which is shorter than the header timeout's 408, would it apply)."""
    with strict.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while b'"ok"}' not in raw:
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed before the answer: {raw!r}"
            raw += chunk
        assert raw.startswith(b"HTTP/1.1 200")
        assert read_until_closed(sock) == b""  # closed, with nothing more said
    assert_good_request(strict)


def test_a_partial_request_on_a_kept_alive_connection_is_a_408(strict: Running) -> None:
    """The header timeout starts again with the first bytes of the next request on the connection."""
    with strict.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        while b'"ok"}' not in raw:
            raw += sock.recv(65536)
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")
        status, _, body = parse(read_until_closed(sock))
    assert status == 408 and "--header-timeout" in body["error"]["message"]
    assert_good_request(strict)


def test_a_request_beyond_the_connection_cap_is_a_503(loaded: LoadedModel) -> None:
    with running(loaded, max_connections=2, header_timeout=120.0) as r:
        idle = [r.connect() for _ in range(2)]
        try:
            wait_until(lambda: r.open_connections() == 2, timeout=GUARD)
            refused = httpx.get(r.url + "/v1/models", timeout=GUARD)  # /health is answered past the cap
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "service_unavailable"
            assert "2 connections (its limit, --max-connections) are taken by 2 opened before" in error["message"]
            assert re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])  # answered by the guard
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: r.open_connections() == 0, timeout=GUARD)
        assert_good_request(r)
        metrics = httpx.get(r.url + "/metrics", timeout=GUARD).text  # counted like any answer
        assert 'gpt2_requests_total{route="/v1/models",status="503"} 1.0' in metrics, metrics  # where it was sent


def http_exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], Any]:
    """Send one request on a kept-alive connection and read its whole answer (by its Content-Length)."""
    sock.sendall(request)
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return parse(head + b"\r\n\r\n" + body)


def post_json(sock: socket.socket, path: str, body: dict[str, Any]) -> None:
    """Send a POST of `body` as JSON on `sock` (its answer is the caller's to read)."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)


def reset(sock: socket.socket) -> None:
    """Close `sock` with a reset, as a client that gives up may, rather than in order."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def hold_loop(r: Running, release: threading.Event) -> None:
    """Keep the server's event loop busy until `release` is set; returns once it is busy."""
    held = threading.Event()

    def hold() -> None:
        held.set()
        release.wait(GUARD)

    r.server.servers[0].get_loop().call_soon_threadsafe(hold)
    assert held.wait(GUARD)


HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
MODELS = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"  # a route the cap applies to (not /health: test_deploy.py)


def test_the_connection_cap_refuses_the_newest_connections_not_one_opened_within_it(loaded: LoadedModel) -> None:
    """The cap counts connections in the order they opened: a client that opened its connection within the cap
    is served however many open after it (idle ones here, a flood of them in the attack this guards against:
    the cap must not make it worse), and the newest one past the cap is refused until older ones close."""
    with running(loaded, max_connections=2, header_timeout=120.0) as r:
        with r.connect() as kept:
            assert http_exchange(kept, MODELS)[0] == 200
            idle = [r.connect() for _ in range(3)]  # the second one is the cap's; the others are past it
            try:
                wait_until(lambda: r.open_connections() == 4, timeout=GUARD)
                assert http_exchange(kept, MODELS)[0] == 200  # it was refused: the count was over the cap
                with r.connect() as newest:
                    status, headers, body = http_exchange(newest, MODELS)
                assert status == 503 and headers["connection"] == "close", body
                assert "taken by 4 opened before this one" in body["error"]["message"]
                for sock in idle[1:]:  # past the cap, they go: the second one and the kept one are the two
                    sock.close()
                wait_until(lambda: r.open_connections() == 2, timeout=GUARD)
                with r.connect() as late:  # two older ones are open: still past the cap
                    assert http_exchange(late, MODELS)[0] == 503
                idle[0].close()
                wait_until(lambda: r.open_connections() == 1, timeout=GUARD)
                with r.connect() as later:  # one older one: within the cap now
                    assert http_exchange(later, MODELS)[0] == 200
            finally:
                for sock in idle:
                    sock.close()
        assert_good_request(r)


UPGRADE = (
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
)


def test_a_websocket_upgrade_leaves_no_connection_counted(loaded: LoadedModel) -> None:
    """An `Upgrade: websocket` request (the API has no WebSocket route) is served as the HTTP request it also
    is, and its connection is counted out when it closes: handed to uvicorn's WebSocket protocol, each stayed
    counted forever, older than any opened after it, so the cap then refused the oldest connections first.
    And /health sent in absolute form is answered past the cap, as /health is."""
    with running(loaded, max_connections=2, header_timeout=120.0) as r:
        for _ in range(3):
            with r.connect() as sock:
                assert http_exchange(sock, UPGRADE)[0] == 200
        wait_until(lambda: r.open_connections() == 0, timeout=GUARD)
        first, second, third = (r.connect() for _ in range(3))
        try:
            wait_until(lambda: r.open_connections() == 3, timeout=GUARD)
            assert [http_exchange(s, MODELS)[0] for s in (first, second, third)] == [200, 200, 503]
            with r.connect() as sock:  # past the cap: /health, however its target is spelled
                status, headers, _ = http_exchange(sock, b"GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert status == 200 and headers["connection"] == "close"
        finally:
            for sock in (first, second, third):
                sock.close()
        assert_good_request(r)


@pytest.mark.parametrize("answer", ["401", "413"])
def test_the_rest_of_a_refused_body_has_a_deadline(loaded: LoadedModel, answer: str) -> None:
    """A request refused before its body is read (no API key, or a Content-Length over the cap): the answer comes
    whole, and the rest of the body is read and dropped for at most `--header-timeout`, then the connection
    closes (a client trickling the rest of a declared terabyte held it for ever, each byte restarting the
    keep-alive timeout). A client that sends the rest in time keeps its connection for the next request
    (closing at once would reset a connection with the body unread, and a client still sending would see the
    reset, not the answer)."""
    auth = b"" if answer == "401" else b"Authorization: Bearer k\r\n"
    with running(loaded, api_key="k", max_body_bytes=1000, header_timeout=1.0, keep_alive_timeout=5.0) as r:
        with r.connect() as sock:
            huge = b"Content-Length: 1000000000000\r\n\r\n{"
            sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\n" + auth + huge)
            sock.settimeout(0.25)
            raw, started = b"", time.monotonic()
            while time.monotonic() - started < 10:  # a byte of body every 0.25 s, past the 1 s deadline
                try:
                    chunk = sock.recv(65536)
                except TimeoutError:
                    with contextlib.suppress(OSError):  # closed: what came before is read next
                        sock.sendall(b" ")
                    continue
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                raw += chunk
            else:
                pytest.fail("the connection stayed open")
            assert time.monotonic() - started < 5  # the drain deadline closed it, not the keep-alive timeout
        status, headers, body = parse(raw)
        assert status == int(answer) and "connection" not in headers, body
        with r.connect() as sock:  # the rest of the body sent in time: the connection serves on
            body_bytes = b"x" * 5000
            head = f"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body_bytes)}\r\n".encode()
            status, _, _ = http_exchange(sock, head + auth + b"\r\n" + body_bytes[:10])  # answered before the body
            assert status == int(answer)
            time.sleep(0.3)
            sock.sendall(body_bytes[10:])  # the rest, within the deadline: read and dropped
            time.sleep(1.5)  # idle past the header deadline, within the keep-alive timeout (no 408 meanwhile)
            assert http_exchange(sock, HEALTH)[0] == 200
    with running(loaded, api_key="k") as r, r.connect() as sock:  # a 401 with no body keeps its connection too
        status, headers, _ = http_exchange(sock, b"GET /v1/model HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 401 and "connection" not in headers
        assert http_exchange(sock, HEALTH)[0] == 200


def test_a_request_with_content_length_and_transfer_encoding_is_a_400_that_closes(strict: Running) -> None:
    """Both headers (RFC 9112, section 6.3: where the next request starts is in doubt, a request-smuggling
    risk behind a proxy): a 400 in the API's shape, and the connection closes, the request after it unread."""
    with strict.connect() as sock:
        body = b"4\r\n{}  \r\n0\r\n\r\n"
        head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head + body + HEALTH)
        raw = read_until_closed(sock)
    status, headers, answer = parse(raw)
    assert status == 400 and headers["connection"] == "close"
    assert "Content-Length and Transfer-Encoding" in answer["error"]["message"]
    assert raw.count(b"HTTP/1.1") == 1  # the pipelined /health was not answered
    assert_good_request(strict)


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"GET /health HTTP/1.1\r\n\r\n",
    ],
    ids=["bad chunk size", "two lengths", "no host"],
)
def test_a_request_that_is_not_http_is_a_400_in_the_apis_shape(strict: Running, request_bytes: bytes) -> None:
    """What h11 cannot parse is answered as every error is, `{"error": ...}` (uvicorn's is plain text), with the
    server's own headers and the body written as the app writes its JSON (compact)."""
    with strict.connect() as sock:
        sock.sendall(request_bytes)
        raw = read_until_closed(sock)
    status, headers, body = parse(raw)
    assert status == 400 and headers["content-type"] == "application/json" and headers["connection"] == "close"
    assert body["error"]["type"] == "invalid_request_error" and "not valid HTTP/1.1" in body["error"]["message"]
    assert headers["server"] == "uvicorn" and "date" in headers
    assert raw.partition(b"\r\n\r\n")[2].startswith(b'{"error":{"type":"invalid_request_error"')
    assert int(headers["content-length"]) == len(raw.partition(b"\r\n\r\n")[2])
    assert_good_request(strict)


@pytest.mark.parametrize(
    "body",
    [b"zz\r\n{}\r\n0\r\n\r\n", b"2\r\n{}}}\r\n0\r\n\r\n"],
    ids=["bad chunk size", "chunk longer than it said"],
)
@pytest.mark.parametrize("api_key", [None, "k"], ids=["open", "refused for its key too"])
def test_a_body_that_is_not_http_is_counted_and_logged_as_its_400(
    loaded: LoadedModel, body: bytes, api_key: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Headers h11 read, then a body it cannot: the 400 carries the request's id, and the log and the metrics
    say 400 (the connection layer answers it and closes, so the request's guard sees its client gone: a 499
    before). A request line h11 cannot read is logged once, at info, with the client's address (uvicorn's
    warning, one a request and without the address, at debug). So too where the guard would have refused it
    before reading its body (a 401, the bad chunk come with the headers): the client was sent the 400."""
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with running(loaded, api_key=api_key) as r, uvicorn_log(logging.WARNING) as warned, caplog.at_level("INFO"):
        with r.connect() as sock:
            head = b"POST /tokenize HTTP/1.1\r\nHost: x\r\nX-Request-Id: chunky-1\r\n"
            head += b"Transfer-Encoding: chunked\r\n\r\n"
            sock.sendall(head + body)
            status, headers, _ = parse(read_until_closed(sock))
        assert status == 400 and headers["x-request-id"] == "chunky-1", headers
        counted = 'gpt2_requests_total{route="/tokenize",status="400"} 1.0'
        metrics = lambda: httpx.get(r.url + "/metrics", headers=auth, timeout=GUARD).text  # noqa: E731
        wait_until(lambda: counted in metrics(), timeout=GUARD)
        assert 'status="499"' not in metrics() and 'status="401"' not in metrics()
        assert any('"request_id": "chunky-1"' in m and '"status": 400' in m for m in caplog.messages), caplog.text
        with r.connect() as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert parse(read_until_closed(sock))[0] == 400
        wait_until(lambda: "could not be read as HTTP/1.1: answered 400" in caplog.text, timeout=GUARD)
        assert_good_request(r, auth)
    assert not [rec.getMessage() for rec in warned if "Invalid HTTP request" in rec.getMessage()]


def test_requests_no_route_sees_are_counted_as_unmatched(loaded: LoadedModel) -> None:
    """A request line h11 cannot read (a 400) and headers that stop halfway (a 408 at the header deadline) are
    counted in /metrics under `unmatched`, as a path no route has is; a connection opened and left unused is
    closed with its 408 too, but it held no request, and is not counted."""
    with running(loaded, header_timeout=1.0) as r:
        with r.connect() as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            assert parse(read_until_closed(sock))[0] == 400
        with r.connect() as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHo")
            assert parse(read_until_closed(sock))[0] == 408
        with r.connect() as sock:
            assert parse(read_until_closed(sock))[0] == 408
        metrics = httpx.get(r.url + "/metrics", timeout=GUARD).text
    assert 'gpt2_requests_total{route="unmatched",status="400"} 1.0' in metrics, metrics
    assert 'gpt2_requests_total{route="unmatched",status="408"} 1.0' in metrics, metrics


@pytest.mark.parametrize(
    ("request_bytes", "status", "reason", "kind", "said"),
    [
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000,  # no end of the headers in 16 KiB
            431,
            "Request Header Fields Too Large",
            "request_header_fields_too_large",
            "did not end within 16384 bytes",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",  # whole, in one write
            431,
            "Request Header Fields Too Large",
            "request_header_fields_too_large",
            "did not end within 16384 bytes",
        ),
        (
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n{}",
            501,
            "Not Implemented",
            "not_implemented",
            "Transfer-Encoding is not one this server reads",
        ),
    ],
    ids=["headers too long", "headers too long, whole", "transfer-encoding gzip"],
)
def test_what_h11_cannot_read_gets_the_status_it_hints_at(
    loaded: LoadedModel, request_bytes: bytes, status: int, reason: str, kind: str, said: str
) -> None:
    """h11 hints 431 for a request line and headers that outgrow its buffer and 501 for a Transfer-Encoding it
    cannot read; uvicorn answered 400 to both. The answer says which, in the API's error shape, is counted under
    `unmatched` with that status, and the connection closes; the server serves on. A head over the buffer that
    arrives whole is a 431 too (h11 took it: it measures only a head not yet complete), and one a little under
    it is served."""
    with running(loaded) as r:
        with r.connect() as sock:
            sock.sendall(request_bytes)
            raw = read_until_closed(sock)
        answer, headers, body = parse(raw)
        assert raw.startswith(f"HTTP/1.1 {status} {reason}\r\n".encode()), raw[:80]
        assert answer == status and headers["connection"] == "close"
        assert body["error"]["type"] == kind and said in body["error"]["message"], body
        metrics = httpx.get(r.url + "/metrics", timeout=GUARD).text
        assert f'gpt2_requests_total{{route="unmatched",status="{status}"}} 1.0' in metrics, metrics
        assert_good_request(r)
        with r.connect() as sock:  # a head of 16,383 bytes, whole: served
            head = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
            sock.sendall(head + b"a" * (16_383 - len(head) - 4) + b"\r\n\r\n")
            assert parse(read_until_closed(sock))[0] == 200


def test_a_client_gone_before_its_answer_began_is_logged_and_counted_as_499(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The client leaves while its answer is built on a worker thread (a JSON answer, which takes seconds for a
    long /v1/analyze), where the route does not watch for it: what the route answers after that reaches no one
    (uvicorn drops it), so the request is logged and counted as 499, not as the 200 it would have been, and
    not as a cut answer either."""
    built, real = threading.Event(), encoding.json_bytes

    def slow(value: Any) -> bytes:
        built.set()
        time.sleep(0.5)  # the client is gone meanwhile
        return real(value)

    monkeypatch.setattr(encoding, "json_bytes", slow)
    generate = json.dumps({"input_ids": [464, 3797], "max_new_tokens": 2, "temperature": 0}).encode()
    head = b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Request-Id: left-1\r\n"
    with running(loaded) as r, caplog.at_level("INFO"):
        with r.connect() as sock:
            sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(generate) + generate)
            assert built.wait(GUARD)
        logged = lambda: [json.loads(m) for m in caplog.messages if '"request_id": "left-1"' in m]  # noqa: E731
        wait_until(lambda: bool(logged()), timeout=GUARD)
        (line,) = logged()
        assert line["status"] == 499 and "cut" not in line, line
        metrics = httpx.get(r.url + "/metrics", timeout=GUARD).text
        assert 'gpt2_requests_total{route="/v1/generate",status="499"} 1.0' in metrics, metrics
        assert 'route="/v1/generate",status="200"' not in metrics and "gpt2_answers_cut_total{" not in metrics
        assert_good_request(r)


def test_a_partial_request_pipelined_behind_a_whole_one_is_a_408(strict: Running) -> None:
    """Half of a second request's headers, sent with the first: the header deadline runs for it once the first
    is answered (the keep-alive timeout closed it silently, without the 408)."""
    with strict.connect() as sock:
        sock.sendall(HEALTH + b"GET /health HTTP/1.1\r\nHo")
        raw = read_until_closed(sock)
    first, _, second = raw.partition(b'"ok"}')
    assert first.startswith(b"HTTP/1.1 200") and second.startswith(b"HTTP/1.1 408"), raw
    assert b"--header-timeout" in second


def test_a_request_target_in_absolute_form_is_served_by_its_path(loaded: LoadedModel) -> None:
    """RFC 9112, section 3.2.2: a server MUST accept `GET http://host/path` (a client set up for a proxy sends
    it); every route was a 404. The path after the authority is the route, its query kept, and the API key is
    still asked for on the paths that need it."""
    generate = {"input_ids": [464, 3797], "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    body = json.dumps(generate).encode()
    with running(loaded, api_key="k") as r:
        with r.connect() as sock:
            assert http_exchange(sock, b"GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
            refused = http_exchange(sock, b"GET http://x/v1/model HTTP/1.1\r\nHost: x\r\n\r\n")
            assert refused[0] == 401, refused
            status, _, answer = http_exchange(
                sock,
                b"POST http://example.com:8000/v1/generate?x=1 HTTP/1.1\r\nHost: y\r\nAuthorization: Bearer k\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body),
            )
            assert status == 200 and len(answer["choices"][0]["token_ids"]) == 2, answer
            assert http_exchange(sock, b"GET /a://b HTTP/1.1\r\nHost: x\r\nX-API-Key: k\r\n\r\n")[0] == 404  # a path
        with r.connect() as sock:  # no path at all: "/", the viewer's page
            sock.sendall(b"GET HTTPS://x:80 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            page = read_until_closed(sock)
        with r.connect() as sock:  # the target's authority is the host, not Host (a redirect names it)
            sock.sendall(b"GET http://user@good.example/v1/model/ HTTP/1.1\r\nHost: evil.example\r\nX-API-Key: k\r\n"
                         b"Connection: close\r\n\r\n")  # fmt: skip
            moved = read_until_closed(sock).partition(b"\r\n\r\n")[0].decode().lower()
    assert page.startswith(b"HTTP/1.1 200") and b"text/html" in page.partition(b"\r\n\r\n")[0], page[:300]
    assert moved.startswith("http/1.1 307") and "location: http://good.example/v1/model\r\n" in moved, moved


def test_every_get_route_answers_head(loaded: LoadedModel) -> None:
    """HEAD (RFC 9110, section 9.3.2): the GET's status and headers, no body, on every GET route."""
    from fastapi.routing import APIRoute

    from server.routes import gradients, lab, native, openai, ops, sae, tokenizer

    routers = (ops, native, openai, tokenizer, lab, gradients, sae)
    routes = [r for m in routers for r in m.router.routes if isinstance(r, APIRoute) and "GET" in r.methods]
    with TestClient(create_app(settings(), loaded=loaded), raise_server_exceptions=False) as client:
        served = client.get("/v1/models").json()["data"][0]["id"]
        paths = sorted({r.path.replace("{model_id:path}", served) for r in routes})
        assert {"/health", "/metrics", "/v1/model", "/v1/models", "/tokenizer_info"} <= set(paths)
        for path in paths:
            get, head = client.get(path), client.head(path)
            assert head.status_code == get.status_code == 200, (path, head.text)
            assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"], path
            if path != "/metrics":  # its counters move between the two
                assert head.headers["content-length"] == get.headers["content-length"], path
        refused = client.delete("/health")  # a 405 names both methods the route takes
        assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD", refused.headers
        assert client.put("/v1/generate").headers["allow"] == "POST"
        schema = client.get("/openapi.json").json()["paths"]
        assert not [path for path, methods in schema.items() if "head" in methods]  # no second operation


def test_a_cors_preflight_beyond_the_connection_cap_is_a_503_too(loaded: LoadedModel) -> None:
    """CORS, the outermost layer, answers preflights itself: one refused by the connection cap must still get
    the 503 (and its connection closed), not CORS's 200."""
    with running(loaded, max_connections=2, header_timeout=120.0, cors_origins=("http://a.example",)) as r:
        idle = [r.connect() for _ in range(2)]
        try:
            wait_until(lambda: r.open_connections() == 2, timeout=GUARD)
            preflight = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
            refused = httpx.options(r.url + "/v1/generate", headers=preflight, timeout=GUARD)
            assert refused.status_code == 503 and refused.headers["connection"] == "close", refused.text
            assert "--max-connections" in refused.json()["error"]["message"]
            plain = httpx.get(r.url + "/v1/models", headers={"Origin": "http://a.example"}, timeout=GUARD)
            assert plain.status_code == 503  # and readable by the page that sent it
            assert plain.headers["access-control-allow-origin"] == "http://a.example", plain.headers
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: r.open_connections() == 0, timeout=GUARD)
        assert httpx.options(r.url + "/v1/generate", headers=preflight, timeout=GUARD).status_code == 200


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--header-timeout", "2.5"], {}, {"header_timeout": 2.5}),
        ([], {"GPT2_BODY_TIMEOUT": "7", "GPT2_MAX_CONNECTIONS": "64"}, {"body_timeout": 7.0, "max_connections": 64}),
        (["--keep-alive-timeout", "0.5"], {"GPT2_KEEP_ALIVE_TIMEOUT": "9"}, {"keep_alive_timeout": 0.5}),
        (["--write-timeout", "12"], {"GPT2_WRITE_TIMEOUT": "3"}, {"write_timeout": 12.0}),
        ([], {}, {"header_timeout": 10.0, "body_timeout": 30.0, "keep_alive_timeout": 5.0, "max_connections": 1024}),
        ([], {}, {"write_timeout": 30.0}),
    ],
)
def test_the_bounds_are_settings(argv: list[str], env: dict[str, str], expected: dict[str, Any]) -> None:
    s = parse_settings(argv, environ=env)
    assert {name: getattr(s, name) for name in expected} == expected


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--header-timeout", "0"], {}, "--header-timeout must be a number of seconds above 0, got 0.0"),
        ([], {"GPT2_BODY_TIMEOUT": "soon"}, "GPT2_BODY_TIMEOUT must be a number, got 'soon'"),
        (
            [],
            {"GPT2_KEEP_ALIVE_TIMEOUT": "inf"},
            "GPT2_KEEP_ALIVE_TIMEOUT must be a number of seconds above 0, got inf",
        ),
        ([], {"GPT2_MAX_CONNECTIONS": "0"}, "GPT2_MAX_CONNECTIONS must be at least 1, got 0"),
        (["--write-timeout", "-1"], {}, "--write-timeout must be a number of seconds above 0, got -1.0"),
        (["--drain-timeout", "0"], {}, "--drain-timeout must be a number of seconds above 0, got 0.0"),
        ([], {"GPT2_DRAIN_TIMEOUT": "inf"}, "GPT2_DRAIN_TIMEOUT must be a number of seconds above 0, got inf"),
        ([], {"GPT2_DRAIN_TIMEOUT": "later"}, "GPT2_DRAIN_TIMEOUT must be a number, got 'later'"),
    ],
)
def test_a_bad_bound_is_a_usage_error(
    argv: list[str], env: dict[str, str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(argv, environ=env)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


def in_flight(r: Running) -> float:
    """The server's dump bytes in flight, from /metrics."""
    text = httpx.get(r.url + "/metrics", timeout=GUARD).text
    (value,) = re.findall(r"^gpt2_dump_bytes_in_flight (\S+)$", text, re.M)
    return float(value)


def test_a_client_that_reads_none_of_its_answer_holds_its_dump_until_it_is_dropped(loaded: LoadedModel) -> None:
    """A 20 MB dump (the logits of 100 positions) to a client that reads none of it: the request waits with
    its answer, a slice at a time, so its reservation stays in the dump budget (sent whole, the answer sat in
    the send buffer outside the budget, the request long over, for as long as the client stayed); once the
    send buffer has been full for `--write-timeout` (3 s here) the connection is dropped, the answer unsent,
    and the reservation given back; the answer is counted as cut by the write timeout. The server serves on."""
    with running(loaded, write_timeout=3.0, max_activation_bytes=64 * 2**20) as r:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.settimeout(GUARD)
        sock.connect((r.host, r.port))
        with sock:
            post_json(sock, "/v1/activations", {"input_ids": list(range(100)), "activations": {"hooks": ["logits"]}})
            got = sock.recv(4096)  # the answer has begun: its head and a first piece of the body
            time.sleep(0.5)  # long after a request whose answer went whole into the send buffer had ended
            assert in_flight(r) > 0  # still reserved: the answer waits for the client, a slice at a time
            wait_until(lambda: in_flight(r) == 0, timeout=GUARD)  # given back: the client was dropped
            try:
                while chunk := sock.recv(1 << 20):
                    got += chunk
            except ConnectionResetError:
                pass
        head_bytes, _, received = got.partition(b"\r\n\r\n")
        length = int(re.search(rb"content-length: (\d+)", head_bytes, re.I).group(1))  # type: ignore[union-attr]
        assert length > 20_000_000 and len(received) < length  # dropped before the answer was all sent
        assert_good_request(r)
        metrics = httpx.get(r.url + "/metrics", timeout=GUARD).text
        assert 'gpt2_answers_cut_total{reason="write_timeout",route="/v1/activations"} 1.0' in metrics, metrics
        assert 'gpt2_requests_total{route="/v1/activations",status="200"} 1.0' in metrics  # as it was sent
        assert 'route="/v1/generate"} ' not in metrics.split("gpt2_answers_cut_total", 1)[1].split("# HELP")[0]


def test_an_answer_the_drain_cuts_is_logged_as_cut_not_as_an_error(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """A 20 MB dump to a client that reads none of it when the server shuts down: at the end of the drain
    (0.5 s here) the answer is cut, its access-log line says `"cut": "drain"` and the guard warns of it with
    its id; uvicorn's error for an answer the app did not complete is not logged (the shutdown cut it)."""
    limits = {"write_timeout": 60.0, "drain_timeout": 0.5, "max_activation_bytes": 64 * 2**20}
    with (
        caplog.at_level("INFO"),
        socket.socket() as sock,
        running(loaded, **limits) as r,
        uvicorn_log(logging.INFO) as logged,
    ):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.settimeout(GUARD)
        sock.connect((r.host, r.port))
        post_json(sock, "/v1/activations", {"input_ids": list(range(100)), "activations": {"hooks": ["logits"]}})
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the answer has begun
        wait_until(lambda: in_flight(r) > 0, timeout=GUARD)
        r.stop()  # the server shuts down, the answer cut at the drain's end
    lines = [json.loads(m) for m in caplog.messages if m.startswith("{")]
    assert [(line["status"], line.get("cut")) for line in lines if line["path"] == "/v1/activations"] == [
        (200, "drain")
    ], lines
    assert "cut by the shutdown at the end of its drain timeout" in caplog.text
    assert any("Shutting down" in rec.getMessage() for rec in logged)  # the log is read
    assert not [rec.getMessage() for rec in logged if "without completing" in rec.getMessage()]


def test_a_client_that_leaves_during_its_answer_is_sent_no_more(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """A 20 MB dump to a client that reads its first piece and resets the connection: the rest is not pushed
    into the closed connection a slice after another (asyncio logged "socket.send() raised exception." for
    each of about a hundred slices, all in one turn of the event loop, before uvicorn could see the client
    gone). Nothing is logged but the answers, each cut by its client leaving, the dump budget is given back,
    and the server serves on."""
    with running(loaded, max_activation_bytes=64 * 2**20) as r, caplog.at_level("INFO", logger="server.access"):
        for _ in range(3):
            sock = socket.create_connection((r.host, r.port), timeout=GUARD)
            post_json(sock, "/v1/activations", {"input_ids": list(range(100)), "activations": {"hooks": ["logits"]}})
            got = b""
            while len(got) < 1 << 19:
                got += sock.recv(1 << 16)
            reset(sock)
            wait_until(lambda: in_flight(r) == 0, timeout=GUARD)
        assert_good_request(r)
        counted = 'gpt2_answers_cut_total{reason="client_left",route="/v1/activations"} 3.0'
        wait_until(lambda: counted in httpx.get(r.url + "/metrics", timeout=GUARD).text, timeout=GUARD)
    sent_to_nobody = [rec.getMessage() for rec in caplog.records if "socket.send() raised" in rec.getMessage()]
    assert sent_to_nobody == []
    cut = [json.loads(m) for m in caplog.messages if m.startswith("{") and '"cut"' in m]
    assert [(line["path"], line["status"], line["cut"]) for line in cut] == 3 * [
        ("/v1/activations", 200, "client_left")
    ]


def test_a_stream_its_client_resets_is_sent_no_more(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream whose client resets the connection while the event loop is busy (held for 0.2 s here), the
    events of several decode steps waiting: they went out in one turn of the loop, the first write failing and
    the others into the closed connection before uvicorn learned that the client had gone, and asyncio logged
    "socket.send() raised exception." for the fifth on. Now they are dropped; each answer is counted as cut by
    its client, and the server serves on. (Each step is made to take 20 ms, so that the stream still goes.)"""
    step = Engine._step

    def slow_step(engine: Engine) -> None:
        step(engine)
        time.sleep(0.02)

    monkeypatch.setattr(Engine, "_step", slow_step)
    with running(loaded) as r, caplog.at_level("WARNING", logger="asyncio"):
        for n in range(1, 4):
            sock = r.connect()
            stream = {"input_ids": [464], "max_new_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True}
            post_json(sock, GEN, stream)
            got = b""
            while got.count(b"data: ") < 2:
                chunk = sock.recv(1 << 16)
                assert chunk, got.decode("latin-1")
                got += chunk
            release = threading.Event()
            hold_loop(r, release)
            reset(sock)  # while the loop is held
            time.sleep(0.2)
            release.set()
            counted = f'gpt2_answers_cut_total{{reason="client_left",route="{GEN}"}} {n}.0'
            wait_until(lambda c=counted: c in httpx.get(r.url + "/metrics", timeout=GUARD).text, timeout=GUARD)
        assert_good_request(r)
    sent_to_nobody = [rec.getMessage() for rec in caplog.records if "socket.send() raised" in rec.getMessage()]
    assert sent_to_nobody == []


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
def test_an_answer_whose_client_left_is_not_encoded_on(
    loaded: LoadedModel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """A generation's JSON dump (the logits at 100 positions: a piece a row; streamed, in its last event) whose
    client resets the connection while a worker thread encodes it: the encoding stops at its next piece (it
    went on to the end, for no one), the request is logged as a 499 (streamed: its answer as cut by its client),
    its share of the dump budget is given back, nothing is logged as an error, and the server serves on. (Each
    piece is made to take 20 ms, so that the client leaves in the middle.)"""
    pieces: list[int] = []
    begun = threading.Event()
    nested_lists = encoding._nested_lists

    def slow_nested_lists(t: Any, out: list[bytes]) -> None:  # the function calls itself by this name too
        if t.dim() <= 1:
            pieces.append(len(pieces))
            begun.set()
            time.sleep(0.02)
        nested_lists(t, out)

    monkeypatch.setattr(encoding, "_nested_lists", slow_nested_lists)
    with (
        running(loaded, max_activation_bytes=256 * 2**20) as r,
        uvicorn_log(logging.ERROR) as errors,
        caplog.at_level("INFO", logger="server.access"),
    ):
        sock = r.connect()
        request = {"input_ids": list(range(99)), "max_new_tokens": 1, "activations": {"hooks": ["logits"]}}
        post_json(sock, GEN, request | {"stream": stream})
        assert begun.wait(GUARD)
        reset(sock)
        left_at = len(pieces)
        lines = lambda: [json.loads(m) for m in caplog.messages if m.startswith("{") and GEN in m]  # noqa: E731
        wait_until(lambda: len(lines()) == 1, timeout=GUARD)
        assert (lines()[0]["status"], lines()[0].get("cut")) == ((200, "client_left") if stream else (499, None))
        assert len(pieces) <= left_at + 2, f"{len(pieces) - left_at} pieces encoded after the client left, of 100"
        wait_until(lambda: in_flight(r) == 0, timeout=GUARD)
        assert_good_request(r)
    assert not [rec.getMessage() for rec in [*caplog.records, *errors] if rec.levelno >= logging.ERROR]


def test_an_answer_ready_in_the_turn_its_client_leaves_ends_quietly(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer whose JSON a worker thread finishes while the event loop is busy, its client resetting or
    closing the connection meanwhile: the answer's turn comes before the loop reads the close. Its last piece
    still reaches uvicorn, which has the answer complete (dropped, as the pieces before it are, uvicorn logged
    "ASGI callable returned without completing response" as an error), and the server serves on."""
    started, proceed, built = threading.Event(), threading.Event(), threading.Event()
    json_bytes = encoding.json_bytes

    def held_json_bytes(content: Any) -> bytes:
        started.set()
        proceed.wait(GUARD)
        body = json_bytes(content)
        built.set()
        return body

    monkeypatch.setattr(encoding, "json_bytes", held_json_bytes)
    for how in ("reset", "close"):
        for event in (started, proceed, built):
            event.clear()
        with running(loaded) as r, uvicorn_log(logging.ERROR) as errors:
            sock = r.connect()
            post_json(sock, GEN, {"input_ids": [464], "max_new_tokens": 2, "temperature": 0})
            assert started.wait(GUARD)
            release = threading.Event()
            hold_loop(r, release)  # the loop is busy
            proceed.set()
            assert built.wait(GUARD)
            time.sleep(0.1)  # the answer's JSON is handed back: it waits for the loop
            if how == "reset":
                reset(sock)
            else:
                sock.close()
            time.sleep(0.1)  # the close waits for the loop too
            release.set()
            assert_good_request(r)
        assert [rec.getMessage() for rec in errors] == [], how


def test_a_client_that_leaves_during_its_body_is_a_499(loaded: LoadedModel) -> None:
    """A client that closes its connection halfway through its request's body left: a 499 in the log and the
    metrics (as nginx counts it), not a 400 for a body no one will read the answer about."""
    with running(loaded) as r:
        sock = r.connect()
        head = "POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        sock.sendall(head.encode() + b'{"prompt": "Hel')
        time.sleep(0.2)
        sock.close()
        counted = 'gpt2_requests_total{route="/v1/generate",status="499"} 1.0'
        wait_until(lambda: counted in httpx.get(r.url + "/metrics", timeout=GUARD).text, timeout=GUARD)
        assert 'status="400"' not in httpx.get(r.url + "/metrics", timeout=GUARD).text
        assert_good_request(r)


def test_a_slow_reader_is_not_dropped_one_that_takes_nothing_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """The write deadline, checked each `--write-timeout` while the send buffer stays full: a client that took
    enough since the last check gets another period, one that took (next to) nothing is dropped. What it took
    shows as the bytes its TCP acknowledged (TCP_INFO, on Linux: at least `MIN_TAKEN` a period, since a
    client's kernel acknowledges a segment or so even to a client that reads a byte a period), or, where those
    cannot be read, as our buffer grown smaller, which moves only as the kernel's send buffer (megabytes) frees
    half of itself: a client reading a steady 100 kB/s was dropped with a deadline of 5 s, logged as having
    taken none."""
    from server import connections
    from server.connections import MIN_TAKEN, _BoundedH11Protocol

    class Socket:
        acked: int | None = 0

    monkeypatch.setattr(connections, "bytes_acked", lambda sock: None if sock is None else sock.acked)

    class Transport:
        buffered, aborted, socket = 3_000_000, False, Socket()

        def get_write_buffer_size(self) -> int:
            return self.buffered

        def get_extra_info(self, name: str) -> Any:
            return self.socket if name == "socket" else None

        def abort(self) -> None:
            self.aborted = True

    class Loop:
        def __init__(self) -> None:
            self.timers: list[tuple[float, Any]] = []

        def call_later(self, delay: float, fn: Any, *args: Any) -> Any:
            self.timers.append((delay, lambda: fn(*args)))
            return type("Timer", (), {"cancel": lambda self: None})()

    def protocol() -> Any:
        p = object.__new__(_BoundedH11Protocol)  # just the deadline's state: no connection behind it
        p.write_timeout, p.transport, p.loop, p.client = 2.0, Transport(), Loop(), ("127.0.0.1", 1)
        p._write_timer = None
        p._watch_writes()
        return p

    def periods(p: Any, taken: list[tuple[int, int]]) -> None:
        """Each period the client takes `from_buffer` bytes of our buffer and its TCP acknowledges `acked` more."""
        for from_buffer, acked in taken:
            assert not p.transport.aborted
            p.transport.buffered -= from_buffer
            if p.transport.socket.acked is not None:
                p.transport.socket.acked += acked
            delay, fire = p.loop.timers.pop(0)
            assert delay == 2.0
            fire()

    # acknowledged bytes tell: a steady reader whose reads our buffer does not see yet goes on, period after period
    p = protocol()
    periods(p, [(0, 200_000), (0, MIN_TAKEN), (65536, 0), (0, MIN_TAKEN - 1)])
    assert p.transport.aborted and not p.loop.timers
    # no TCP_INFO: our buffer tells
    p = protocol()
    p.transport.socket.acked = None
    periods(p, [(65536, 0), (1, 0), (0, 0)])
    assert p.transport.aborted and not p.loop.timers
    # a client that takes the rest: no more periods, and nothing dropped
    p = protocol()
    periods(p, [(p.transport.buffered, 0)])
    assert not p.transport.aborted and not p.loop.timers and p._write_timer is None


def test_a_new_pause_starts_a_period_of_its_own() -> None:
    """An answer's tail left in the buffer arms the deadline with that tail's size; the next answer's pause must
    start a period from what is buffered then (a client that took the first answer and most of the next one was
    dropped, measured against the first one's tail)."""
    from server.connections import _BoundedH11Protocol

    class Transport:
        buffered = 20_000

        def get_write_buffer_size(self) -> int:
            return self.buffered

        def get_extra_info(self, name: str) -> Any:
            return None  # no TCP_INFO: our buffer alone tells

        def abort(self) -> None:
            raise AssertionError("dropped")

    class Loop:
        def __init__(self) -> None:
            self.timers: list[Any] = []

        def call_later(self, delay: float, fn: Any, *args: Any) -> Any:
            timer = type("Timer", (), {"cancelled": False, "cancel": lambda t: setattr(t, "cancelled", True)})()
            self.timers.append((timer, fn))
            return timer

    p: Any = object.__new__(_BoundedH11Protocol)
    p.write_timeout, p.transport, p.loop, p.client = 2.0, Transport(), Loop(), ("127.0.0.1", 1)
    p._write_timer = None
    p._watch_writes()  # the first answer's tail, 20 kB
    p.transport.buffered = 1_200_000  # the next answer fills the buffer: paused
    p.flow = type("Flow", (), {"pause_writing": lambda f: None})()
    p.pause_writing()
    p.transport.buffered = 300_000  # the client takes 900 kB of it in the period
    live = [fn for timer, fn in p.loop.timers if not timer.cancelled]
    assert len(live) == 1
    live[0]()  # another period, not a drop


def test_the_tcp_info_read_is_what_the_peer_acknowledged() -> None:
    """`bytes_acked` on a real loopback connection: what the peer's kernel took of what was sent (Linux)."""
    from server.connections import bytes_acked

    if not sys.platform.startswith("linux"):
        pytest.skip("TCP_INFO's layout is Linux's")
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as client, listener.accept()[0] as server:
        assert bytes_acked(server) == 0
        server.sendall(b"x" * 100_000)
        got = 0
        while got < 100_000:
            got += len(client.recv(65536))
        wait_until(lambda: bytes_acked(server) == 100_000, timeout=GUARD)


def test_refusals_are_logged_sparsely(caplog: pytest.LogCaptureFixture) -> None:
    """A flood of connection-cap refusals is one warning every 10 s, saying how many it held back, not a line
    each (each refusal still has its access-log line)."""
    now = [0.0]
    sparse = Sparse(10.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="server.access"):
        said = []
        for t in (0.0, 0.5, 3.0, 9.9, 10.5, 11.0, 30.0):
            now[0] = t
            said.append(sparse.warning(f"refused at {t}"))
    assert said == [True, False, False, False, True, False, True]
    assert [r.getMessage() for r in caplog.records] == [
        "refused at 0.0",
        "refused at 10.5 (and 3 more like it in the 10 s before)",
        "refused at 30.0 (and 1 more like it in the 20 s before)",
    ]
