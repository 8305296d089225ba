"""Slow and idle clients, with raw sockets against a real uvicorn server (gpt2-serve's configuration, in a
thread of this process around the loaded tiny model): headers or a body that never finish are a 408 and
the connection closes, an idle keep-alive connection is closed, a request beyond the connection cap is a
503; after each, a good request still succeeds."""

from __future__ import annotations

import json
import re
import socket
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
from inprocess import settings, wait_until

from model.loading import LoadedModel
from server.app import create_app
from server.cli import _bind
from server.connections import uvicorn_config
from server.settings import parse_settings

GUARD = 60.0  # seconds a socket waits before the test fails as hung (a guard, not a measured bound)


@dataclass
class Running:
    server: uvicorn.Server
    host: str
    port: int

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
        yield Running(server, "127.0.0.1", port)
    finally:
        server.should_exit = True
        thread.join(GUARD)
        sock.close()


@pytest.fixture(scope="module")
def strict(loaded: LoadedModel) -> Iterator[Running]:
    """Short bounds, so that each case ends in about a second."""
    with running(loaded, header_timeout=1.0, body_timeout=1.0, keep_alive_timeout=1.0) as r:
        yield r


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


def assert_good_request(r: Running) -> None:
    body = {"input_ids": [464, 3797], "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(r.url + GEN, json=body, timeout=GUARD)
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
            refused = httpx.get(r.url + "/health", timeout=GUARD)
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["type"] == "service_unavailable"
            assert "2 connections open, its limit (--max-connections)" in error["message"]
            assert re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])  # answered by the guard
        finally:
            for sock in idle:
                sock.close()
        wait_until(lambda: r.open_connections() == 0, timeout=GUARD)
        assert_good_request(r)
        metrics = httpx.get(r.url + "/metrics", timeout=GUARD).text  # counted like any answer
        assert 'gpt2_requests_total{route="unmatched",status="503"} 1.0' in metrics, metrics


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
            plain = httpx.get(r.url + "/health", headers={"Origin": "http://a.example"}, timeout=GUARD)
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
        (["--header-timeout", "0"], {}, "header_timeout must be a number of seconds above 0, got 0.0"),
        ([], {"GPT2_BODY_TIMEOUT": "soon"}, "GPT2_BODY_TIMEOUT must be a number, got 'soon'"),
        ([], {"GPT2_KEEP_ALIVE_TIMEOUT": "inf"}, "keep_alive_timeout must be a number of seconds above 0, got inf"),
        ([], {"GPT2_MAX_CONNECTIONS": "0"}, "max_connections must be at least 1, got 0"),
        (["--write-timeout", "-1"], {}, "write_timeout must be a number of seconds above 0, got -1.0"),
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
    and the reservation given back. The server serves on."""
    with running(loaded, write_timeout=3.0, max_activation_bytes=64 * 2**20) as r:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.settimeout(GUARD)
        sock.connect((r.host, r.port))
        with sock:
            body = json.dumps({"input_ids": list(range(100)), "activations": {"hooks": ["logits"]}}).encode()
            head = "POST /v1/activations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)
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


def test_a_slow_reader_is_not_dropped_one_that_takes_nothing_is() -> None:
    """The write deadline, checked each `--write-timeout` while the send buffer stays full: a client that took
    something since the last check (the buffer smaller) gets another period; one that took nothing is dropped."""
    from server.connections import _BoundedH11Protocol

    class Transport:
        buffered, aborted = 3_000_000, False

        def get_write_buffer_size(self) -> int:
            return self.buffered

        def abort(self) -> None:
            self.aborted = True

    class Loop:
        def __init__(self) -> None:
            self.timers: list[tuple[float, Any]] = []

        def call_later(self, delay: float, fn: Any, *args: Any) -> Any:
            self.timers.append((delay, lambda: fn(*args)))
            return type("Timer", (), {"cancel": lambda self: None})()

    protocol = object.__new__(_BoundedH11Protocol)  # just the deadline's state: no connection behind it
    protocol.write_timeout, protocol.transport, protocol.loop = 2.0, Transport(), Loop()  # type: ignore[assignment]
    protocol.client = ("127.0.0.1", 1)
    protocol._write_timer = None
    protocol._watch_writes(protocol.transport.get_write_buffer_size())
    for taken in (65536, 1, 0):  # two periods in which the client took some, then one in which it took none
        protocol.transport.buffered -= taken  # type: ignore[attr-defined]
        delay, fire = protocol.loop.timers.pop(0)  # type: ignore[attr-defined]
        assert delay == 2.0 and not protocol.transport.aborted  # type: ignore[attr-defined]
        fire()
    assert protocol.transport.aborted and not protocol.loop.timers  # type: ignore[attr-defined]
    protocol.transport.aborted = False  # type: ignore[attr-defined]
    protocol._watch_writes(protocol.transport.get_write_buffer_size())  # a client that takes the rest: no more
    protocol.transport.buffered = 0  # type: ignore[attr-defined]
    protocol.loop.timers.pop(0)[1]()  # type: ignore[attr-defined]
    assert not protocol.transport.aborted and not protocol.loop.timers and protocol._write_timer is None  # type: ignore[attr-defined]
