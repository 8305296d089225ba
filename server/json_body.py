"""Request bodies are read as JSON in which each object names a key once.

Python's `json`, like most parsers, keeps the last of two equal keys: `{"attn": [0], "attn": []}` would
quietly mean `{"attn": []}`, and the client would get the answer to a question it did not ask. RFC 8259
leaves such objects to the parser ("the names within an object SHOULD be unique"); this API refuses them
with a 400 naming the key's path (`residual.attn`, `interventions.0.hook`). Everything else reads as
`json.loads` reads it (NaN and Infinity, integers up to Python's 4,300 digits, the same errors), in the same
single pass, but for the encoding: UTF-8 only, as RFC 8259 has it (a byte order mark before it is taken, as
the RFC allows); `json.loads` would also guess UTF-16 and UTF-32 from the first bytes, and take surrogates
encoded as UTF-8 bytes (CESU-8), which are not UTF-8.

FastAPI parses a body with `await request.json()` on the request its route handler is given: a router made
with `APIRouter(route_class=JSONBodyRoute)` hands its handlers a `JSONBodyRequest`, which parses a body of
more than `THREAD_BYTES` on a worker thread, so that the event loop goes on serving the other clients' streams
meanwhile. What a body costs to parse is bounded by its size: `loads` refuses one that holds more arrays and
objects than `MAX_CONTAINERS` or one per `CONTAINER_BYTES` of it, whichever is more (the largest tensor a
4 MiB body can hold, an edit's [pos, head, d_head] or [head, q, k] values, is some thousands of lists; edits of
[pos, 1] values by the hundred come near, every LayerNorm scale of gpt2-xl over 1,024 positions 99,500: those
go as safetensors, `{"safetensors_base64": ...}`, as the error says), and pauses the cyclic garbage collector
while it parses (a collection every 700 new lists walks all those made so far: 100,000 small lists took 107 ms
to parse, 7 ms so). A 4 MiB body of two million small lists held every stream for 0.4-1.6 s; it is refused in
26-73 ms now.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool

from model.json_file import CLIP, clip

THREAD_BYTES = 64 * 1024  # bodies above this are parsed on a worker thread (about a millisecond's parse)
MAX_CONTAINERS = 100_000  # arrays and objects a body may hold, or one per CONTAINER_BYTES of it if that is more
CONTAINER_BYTES = 64


class TooManyContainers(ValueError):
    """A body that holds more arrays and objects than its size allows (`MAX_CONTAINERS`, `CONTAINER_BYTES`)."""

    def __init__(self, count: int, allowed: int, size: int) -> None:
        super().__init__(
            f"the body holds {count:,} JSON arrays and objects, more than the {allowed:,} a body of {size:,} bytes "
            f"may ({MAX_CONTAINERS:,}, or one per {CONTAINER_BYTES} bytes): send a tensor's values as fewer, longer "
            f'lists, or as a safetensors file ({{"safetensors_base64": ...}})'
        )


def spelled(path: Sequence[str | int]) -> str:
    """A field's path in the body as every message writes it: keys joined by dots, list indices in brackets
    (`interventions[0].direction.feature`), as the edits' own errors name an edit (`interventions[0]`)."""
    text = ""
    for i, part in enumerate(path):
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            key = part or '""'  # an empty key, as JSON writes it
            text += f".{key}" if i else key
    return text


class DuplicateKeyError(ValueError):
    """An object in the body names a key twice; `param` is the key's path (`spelled`; cut short, as the
    message's copy is: a key can be megabytes long)."""

    def __init__(self, path: list[str | int]) -> None:
        dotted = spelled(path)
        self.param = dotted if len(dotted) <= CLIP else dotted[:CLIP] + "..."
        super().__init__(f"the body names the key {clip(dotted)} more than once: send each key once")


def loads(body: bytes) -> Any:
    """`json.loads(body)` of a UTF-8 body, raising DuplicateKeyError for an object that names a key twice,
    TooManyContainers for one that holds more arrays and objects than its size allows (and UnicodeDecodeError
    for bytes that are not UTF-8)."""
    _count_containers(body)
    keys = _UniqueKeys()
    text = body.decode("utf-8").removeprefix("\ufeff")  # a bad byte's offset counts a BOM before it, as sent
    collecting = gc.isenabled()
    gc.disable()  # the parse makes no cycles; a collection every 700 lists made would walk all the others
    # (not `gc.freeze` after it, to spare the next collection a walk: `gc.unfreeze` would take back what the
    # server froze for good, `server.app.freeze_long_lived`)
    try:
        value = json.loads(text, object_pairs_hook=keys.object)
    finally:
        if collecting:
            gc.enable()
    if keys.path is not None:
        above = _path_to(keys.holder, value)
        assert above is not None, "the object holding the duplicate is in the body"
        raise DuplicateKeyError([*above, *keys.path])
    return value


def _count_containers(body: bytes) -> None:
    """Raise TooManyContainers where `body` holds more arrays and objects than its size allows: its brackets
    counted, a few milliseconds at 4 MiB, and where they are too many, again outside its strings."""
    allowed = max(MAX_CONTAINERS, len(body) // CONTAINER_BYTES)
    if len(body) // 2 <= allowed:  # each takes two bytes at least
        return
    count = body.count(b"[") + body.count(b"{")
    if count > allowed:
        outside = _outside_strings(body)
        count = outside.count(b"[") + outside.count(b"{")
        if count > allowed:
            raise TooManyContainers(count, allowed, len(body))


def _outside_strings(body: bytes) -> bytes:
    """The bytes of a JSON text that are outside its strings, in passes of linear time (a regular expression
    for strings restarts at every quote of one that never closes: hours over 4 MiB of them). Inside a string
    every backslash starts an escape: with the escaped backslashes taken out, then the escaped quotes, each
    quote left opens or closes a string. (Of a body that is not JSON, what json says of it is what counts.)"""
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(plain.split(b'"')[::2])


class _UniqueKeys:
    """An `object_pairs_hook` that builds each object as `json` does, and remembers the first that names a
    key twice. Objects are built inside out, so the path to that key is found on the way out: once there is
    one, each object built after it looks for it among its values, and if it is there, holds it in turn."""

    def __init__(self) -> None:
        self.path: list[str | int] | None = None  # from `holder` down to the key named twice
        self.holder: Any = None  # the outermost object built so far that holds that key

    def object(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        built = dict(pairs)
        if self.path is not None:
            for key, value in pairs:  # the pairs, not `built`: the holder may be a duplicate's lost value
                below = _path_to(self.holder, value)
                if below is not None:
                    self.path, self.holder = [key, *below, *self.path], built
                    break
        elif len(built) < len(pairs):
            self.path, self.holder = [_first_repeated(key for key, _ in pairs)], built
        return built


def _path_to(target: Any, value: Any) -> list[str | int] | None:
    """The list indices from `value` down to the object `target`, or None where it is not there. Only lists
    are searched: an object that held `target` would have become the holder as it was built."""
    if value is target:
        return []
    if isinstance(value, list):
        for i, item in enumerate(value):
            below = _path_to(target, item)
            if below is not None:
                return [i, *below]
    return None


def _first_repeated(keys: Iterable[str]) -> str:
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            return key
        seen.add(key)
    raise ValueError("no key is repeated")


class JSONBodyRequest(Request):
    """A request whose JSON body refuses duplicate keys (`loads`)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            # (json's scanner holds the GIL over a run of lists, a few tens of milliseconds at 4 MiB)
            self._json = await run_in_threadpool(loads, body) if len(body) > THREAD_BYTES else loads(body)
        return self._json


class JSONBodyRoute(APIRoute):
    """A route whose handler (FastAPI's own) is given a `JSONBodyRequest`: its body refuses duplicate keys."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def unique_keys(request: Request) -> Response:
            return await handler(JSONBodyRequest(request.scope, request.receive))

        return unique_keys
