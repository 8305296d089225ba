"""What the route handlers share: the engine and settings of the app, prompts turned into token ids,
waiting on or streaming the engine's results, and the server-wide budget of activation dump bytes.

Nothing slow runs on the event loop: prompts are tokenized on a worker thread (a 4 MB prompt takes
seconds), and a client that disconnects while it waits cancels its sequences, freeing their batch rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from model.generate import Completion, ContextLengthError, GenerationError, TokenEvent, validate_prompt
from model.gpt import GPT
from model.huge_pages import trim_heap
from model.interventions import EditSpec
from model.lab.steering import Directions
from model.tokenizer import InvalidTextError

from .. import encoding
from ..engine import Engine, QueueFull, RequestStream
from ..errors import GONE, APIError, ClientLeft, error_body, generation_error_body
from ..metrics import Metrics
from ..middleware import SlicedBodies
from ..schemas import Edits
from ..settings import Settings
from ..threads import run_in_threadpool

log = logging.getLogger(__name__)
T = TypeVar("T")


def get_engine(request: Request) -> Engine:
    engine: Engine | None = request.app.state.engine
    if engine is None:
        raise APIError(503, "the model is still loading; retry shortly", headers={"Retry-After": "5"})
    return engine


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


@dataclass(frozen=True)
class Held:
    """What a request holds budget bytes for, as its 413 names it: `name`, the field `param`, and what to ask
    for instead (`smaller`)."""

    name: str
    param: str
    smaller: str


DUMP = Held("the activation dump", "activations", "fewer hooks or fewer tokens")
DUMP_AND_FEATURES = Held("the activation dump and the SAE features", "activations", "fewer hooks, features or tokens")
GRADIENTS = Held("the gradients", "hooks", "fewer hooks or fewer tokens")


class DumpBudget:
    """The bytes of activation dumps in flight at once, server-wide, at most `limit`: the answers that hold
    activations (dumps, SAE feature readings with their hook's capture, gradients at hook points) and what an
    analysis holds between its jobs, or a steering vector's measure from a prompt's pass to its reduction (`Held`
    says which a request holds).

    A dump takes several times its size at its peak, captured, converted and encoded (about 5x), and its answer
    is held until sent; `--max-activation-bytes` bounds each, this bounds them all together. A request reserves
    its dump's size, as the 413 estimates it, before any model work (`DumpHold.reserve`) and holds it until its
    answer is sent or it fails. While the budget is full, a request waits its turn, first come first served (so
    small dumps do not pass a large one forever); at most `max_waiting` wait, beyond them 429. When the last dump
    in flight is given back, the C heap's free pages go back to the system: glibc keeps freed arenas, and six
    concurrent 184 MB dumps left a server 2.8 GB larger than before them."""

    def __init__(self, limit: int, max_waiting: int, metrics: Metrics) -> None:
        self.limit, self.max_waiting, self.metrics = limit, max_waiting, metrics
        self.in_flight = 0
        self._waiting: deque[tuple[DumpHold, int, asyncio.Future[None]]] = deque()

    async def reserve(self, hold: DumpHold, nbytes: int, what: Held = DUMP) -> None:
        """Add `nbytes` to `hold` once they fit, in turn (cancel the wait to give up). Raises APIError (413,
        worded by `what`) for more than the whole budget, `QueueFull` (429) when `max_waiting` requests wait
        already."""
        if nbytes > self.limit:
            raise APIError(
                413,
                f"{what.name} would take up to {nbytes} bytes, more than the server holds for all dumps "
                f"at once ({self.limit}, its --max-dump-bytes-in-flight): ask for {what.smaller}",
                what.param,
            )
        if not self._waiting and self.in_flight + nbytes <= self.limit:
            self._grant(hold, nbytes)
            return
        if len(self._waiting) >= self.max_waiting:
            waiting = len(self._waiting)
            raise QueueFull(
                f"{waiting} requests are waiting for room in the server's dump budget (the limit is {self.max_waiting})"
            )
        waiter = (hold, nbytes, asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        self.metrics.dumps_waiting.set(len(self._waiting))
        try:
            await waiter[2]
        except asyncio.CancelledError:
            if waiter in self._waiting:  # not granted (if it was, `hold` has the bytes and gives them back)
                self._waiting.remove(waiter)
                self._admit()  # the ones behind it may fit now
            raise

    def release(self, nbytes: int) -> None:
        self.in_flight -= nbytes
        self.metrics.dump_bytes_in_flight.set(self.in_flight)
        self._admit()

    def _grant(self, hold: DumpHold, nbytes: int) -> None:
        self.in_flight += nbytes
        hold.nbytes += nbytes
        self.metrics.dump_bytes_in_flight.set(self.in_flight)

    def _admit(self) -> None:
        """Grant the waiting requests their bytes, in order, while the first fits."""
        while self._waiting and self.in_flight + self._waiting[0][1] <= self.limit:
            hold, nbytes, future = self._waiting.popleft()
            if not future.cancelled():  # one cancelled is taken out by its own task
                self._grant(hold, nbytes)
                future.set_result(None)
        self.metrics.dumps_waiting.set(len(self._waiting))


class DumpHold:
    """One request's share of the `DumpBudget`: what it reserved, given back once its answer is sent."""

    def __init__(self, budget: DumpBudget) -> None:
        self.budget = budget
        self.nbytes = 0

    async def reserve(self, nbytes: int, request: Request, what: Held = DUMP) -> None:
        """Wait for `nbytes` of the budget (a 499 if the client leaves meanwhile)."""
        if nbytes:
            await unless_disconnected(request, self.budget.reserve(self, nbytes, what))

    def release(self) -> bool:
        """Give the bytes back; returns whether they were the last in flight."""
        if not self.nbytes:
            return False
        self.budget.release(self.nbytes)
        self.nbytes = 0
        return self.budget.in_flight == 0


async def dump_hold(request: Request) -> AsyncIterator[DumpHold]:
    """A request's `DumpHold`, given back after its answer is sent, however the request ends (an error, the
    client gone, the server stopping); the heap is trimmed, off the event loop, once no dump is in flight."""
    hold = DumpHold(request.app.state.dump_budget)
    try:
        yield hold
    finally:
        if hold.release():
            await run_in_threadpool(trim_heap)


class Steps(Protocol):
    """Work in bounded pieces, about a block of the model each (the lab's passes: `MetricPass`, `HighwayPass`,
    `ScoringPass`, `NextTokenPass`, `CapturePass`, `AnalysisPass`, `FeatureReading`): `step` runs the next."""

    @property
    def done(self) -> bool: ...

    def step(self, model: GPT) -> object: ...  # what it returns, if anything, is not read


async def stepped(request: Request | None, engine: Engine, work: Steps, begun: bool = False) -> None:
    """Run `work` to its end, each step an engine job of its own: decode steps go on between them. Only the
    first job of a request's work can meet a full queue (429; `begun`: the request has work done already,
    an earlier pass): once begun, it goes on to its end (a full queue refusing a later step would throw that
    work away). A request's first pass is refused (429) while `max_queue` are under way, each holding what it
    keeps between its jobs; its later passes are not. A client gone ends it (a 499): its waiting job leaves the
    queue, a running one stops where `Engine.call` stops it, and no job of it follows. With no `request`
    (work inside a stream, whose answer has begun), the stream's end does the same: it cancels this."""
    if engine.passes >= engine.max_queue and not begun:
        raise QueueFull(
            f"{engine.passes} model calls of many steps are under way: a new one is taken once fewer than "
            f"{engine.max_queue} are (the requests already under way go on to their ends, so there can be more)"
        )
    engine.passes += 1
    try:
        while not work.done:
            call = engine.call(work.step, continuing=begun)
            await (call if request is None else unless_disconnected(request, call))
            begun = True
    finally:
        engine.passes -= 1


class GraphTurn:
    """One autograd graph alive at a time, server-wide. A gradient's pass (`/v1/gradients`, `/v1/attribution`'s
    scores, `/v1/analyze`'s gradients) runs as many engine jobs, with decode steps and other requests' jobs
    between them, and holds its graph across them; `--max-gradient-bytes` bounds each graph, and taking turns
    keeps that the bound of them all. The others wait, first come first served; at most `max_waiting` (429
    beyond them)."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.waiting = 0
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def held(self, request: Request) -> AsyncIterator[None]:
        """The turn, for the body of the `async with` (a 499 if the client leaves while it waits)."""
        if self._lock.locked() and self.waiting >= self.max_waiting:
            raise QueueFull(
                f"{self.waiting} {'request is' if self.waiting == 1 else 'requests are'} waiting to build an "
                f"autograd graph, one at a time (the limit is {self.max_waiting})"
            )
        self.waiting += 1
        taking = asyncio.ensure_future(self._lock.acquire())
        try:
            await unless_disconnected(request, taking)
        except BaseException:  # given up; if the lock was taken all the same (a race), it goes back
            if taking.done() and not taking.cancelled() and taking.exception() is None:
                self._lock.release()
            raise
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._lock.release()


def graph_turn(request: Request) -> GraphTurn:
    turn: GraphTurn = request.app.state.graph_turn
    return turn


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
DumpHoldDep = Annotated[DumpHold, Depends(dump_hold)]
GraphTurnDep = Annotated[GraphTurn, Depends(graph_turn)]


def prompt_field(input_ids: object) -> str:
    """The field a request's prompt came in, given its `input_ids`: what errors about the prompt name."""
    return "input_ids" if input_ids is not None else "prompt"


async def token_ids(
    engine: Engine, prompt: str | Sequence[Any] | None, input_ids: Sequence[Any] | None
) -> list[list[int]]:
    """Token ids of each prompt, from `prompt` (text, or texts) or `input_ids` (ids, or lists of ids). More
    prompts than the server takes at once (`Engine.check_count`) are a 400 before any is read through: a
    body of 800,000 one-id prompts took seconds of the event loop to be refused (every stream stalled)."""
    if (prompt is None) == (input_ids is None):
        raise GenerationError("give exactly one of prompt and input_ids", "prompt")
    if input_ids is not None:
        if not input_ids:
            raise GenerationError("input_ids is empty", "input_ids")
        if isinstance(input_ids[0], list):  # several prompts: counted before they are copied and checked
            engine.check_count(len(input_ids), "input_ids")
            prompts = [list(x) for x in input_ids]
        else:
            prompts = [list(input_ids)]
        check_prompts(engine, prompts, 0, "input_ids")  # empty or out-of-vocabulary ids: named as they came
        return prompts
    return await openai_prompt_ids(engine, prompt)


def places(param: str, prompts: Sequence[object], n: int = 1) -> list[str] | None:
    """Each sequence's prompt by its place (`input_ids[1]`), for the engine's errors about one of several
    prompts (`Engine.submit`'s labels): each prompt's `n` samples one after another; None for one prompt."""
    if len(prompts) == 1:
        return None
    return [f"{param}[{i}]" for i in range(len(prompts)) for _ in range(n)]


def check_prompts(engine: Engine, prompts: list[list[int]], max_new_tokens: int, param: str) -> None:
    """Each of a request's prompts checked against the model (`validate_prompt`), before anything is sized on
    them (a dump's bytes): a prompt too long for the context is a 400 `context_length_exceeded` whatever else
    the request asks. Of several, the error says which (`prompt[1]: the prompt is empty ...`)."""
    for i, ids in enumerate(prompts):
        try:
            validate_prompt(engine.model, ids, max_new_tokens, param)
        except GenerationError as e:
            if len(prompts) == 1:
                raise
            raise type(e)(f"{param}[{i}]: {e}", e.param) from None  # of its kind: a ContextLengthError stays one


async def openai_prompt_ids(engine: Engine, prompt: str | Sequence[Any] | None) -> list[list[int]]:
    """OpenAI's `prompt`: a string, a list of strings, a list of token ids or a list of lists of ids (no more
    prompts than the server takes at once: counted before they are encoded)."""
    if isinstance(prompt, str):
        return await encode(engine, [prompt], "prompt")
    items = list(prompt or [])
    if not items:
        raise GenerationError("the prompt list is empty", "prompt")
    if not isinstance(items[0], int):  # several prompts
        engine.check_count(len(items), "prompt")
    if isinstance(items[0], str):
        return await encode(engine, items, "prompt")
    if isinstance(items[0], int):
        return [items]
    return [list(x) for x in items]


async def encode(
    engine: Engine, texts: list[str], param: str, special: bool = True, prompts: bool = True
) -> list[list[int]]:
    """Token ids of `texts`, encoded on a worker thread (`encode_batch` lets go of the GIL meanwhile, so
    the event loop keeps serving); text that is not valid Unicode is a 400 naming `param`. `special`:
    `<|endoftext|>` in the text is id 50256, else the tokens of its characters. `prompts`: a text too long to
    be a prompt in the model's context is a 400 `context_length_exceeded` before it is encoded (a 4 MB text
    took seconds and 600 MB to encode before it was refused)."""
    if prompts:
        check_text_sizes(engine, texts, param)
    try:
        return await run_in_threadpool(engine.tokenizer.encode_batch, texts, special)
    except InvalidTextError as e:
        where = param if len(texts) == 1 else f"{param}[{e.item}]"
        raise GenerationError(f"{where} is {e}", param) from None


def check_text_sizes(engine: Engine, texts: list[str], param: str) -> None:
    """A text prompt of more bytes than the context's tokens could spell is a 400 `context_length_exceeded`
    before it is encoded (`Tokenizer.most_bytes_a_token`; no bound for a tokenizer that is not GPT-2's kind)."""
    most, n_ctx = engine.tokenizer.most_bytes_a_token, engine.model.config.n_positions
    if most is None:
        return
    for i, text in enumerate(texts):
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > n_ctx * most:
            where = "" if len(texts) == 1 else f"{param}[{i}]: "
            raise ContextLengthError(
                f"{where}the prompt ({size} bytes of text: at least {-(-size // most)} tokens of at most {most} "
                f"bytes each) is longer than the context of {n_ctx} tokens",
                param,
            )


async def resolved_edits(req: Edits, engine: Engine, directions: Directions) -> EditSpec | None:
    """A request's edits, their globs matched and each site checked (`EditSpec.plan`) on a worker thread: a
    thousand globbed edits take a few hundred milliseconds (more on gpt2-xl's 1,111 hook points), and the event
    loop keeps serving meanwhile."""
    config = engine.model.config
    if req.names_a_vector():
        await directions.refresh()  # the vectors other replicas stored (a Ray deployment's)

    def resolve() -> EditSpec | None:
        spec = req.edit_spec(config.n_layer, directions)
        if spec is not None:
            spec.plan(config)
        return spec

    return await run_in_threadpool(resolve)


async def results(streams: list[RequestStream], request: Request) -> list[Completion]:
    """Wait for every stream's completion. If one fails, the wait is cancelled or the client disconnects,
    all are cancelled: they leave the batch at the next step."""
    try:
        return await unless_disconnected(request, _completions(streams))
    finally:
        for s in streams:
            s.cancel()


async def json_response(build: Callable[..., Any], *args: Any) -> Response:
    """The JSON answer `build(*args)`, built and written on a worker thread: with a dump, or every token's
    text to decode, that takes long, and the event loop keeps serving meanwhile."""
    body = await run_in_threadpool(lambda: encoding.json_bytes(build(*args)))
    return Response(body, media_type="application/json")


class FileResponse(Response):
    """A file made of pieces (`encoding.to_safetensors`: a dump's header, then each tensor's own memory), sent
    one after another in slices of a MiB, never joined: a dump of hundreds of megabytes is in memory once. A
    client that leaves is sent no more (`SlicedBodies.http` says why each slice gives the event loop a turn)."""

    media_type = "application/octet-stream"
    slice_bytes = SlicedBodies.slice_bytes  # as the middleware slices an answer, where it runs (not under Ray)

    def __init__(self, pieces: list[bytes | memoryview]) -> None:
        super().__init__()
        self.pieces = [memoryview(p).cast("B") for p in pieces]
        self.headers["content-length"] = str(sum(len(p) for p in self.pieces))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.ensure_future(_disconnected(receive))  # the body is read: the next message says so
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            for piece in self.pieces:
                for start in range(0, len(piece), self.slice_bytes):
                    if gone.done() and gone.exception() is None:  # a receive that failed says nothing of the client
                        return
                    body = bytes(piece[start : start + self.slice_bytes])  # bytes, as ASGI has a body
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            _retrieved(gone)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled and the answer is a 499 (as
    nginx logs it: no one reads it)."""
    done = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((done, gone), return_when=asyncio.FIRST_COMPLETED)
        if done.done():  # also when the client left in the same turn: the answer (or its error) is read
            return done.result()
        raise APIError(499, GONE)
    finally:
        done.cancel()
        gone.cancel()


async def _completions(streams: list[RequestStream]) -> list[Completion]:
    """Every stream's completion, waited for together. The waits are tasks of this one, which ends them
    all however it ends (cancelled, or one stream failed): none is left pending, and asyncio has no
    unretrieved error to log."""
    waits = [asyncio.ensure_future(s.result()) for s in streams]
    try:
        return list(await asyncio.gather(*waits))
    finally:
        for w in waits:
            w.cancel()


async def _disconnect(request: Request) -> None:
    """Return when the client disconnects. The body is read already, so the server's next message is
    `http.disconnect`, sent when the connection closes (or once the response is complete)."""
    await _disconnected(request.receive)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Take a finished task's exception, so that asyncio does not log it as never retrieved."""
    if task.done() and not task.cancelled():
        task.exception()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[RequestStream, TokenEvent | None]]:
    """Events of several streams as they come; (stream, None) when a stream has finished."""
    if len(streams) == 1:  # one prompt (the common case): its events as they are, without a pump and queue
        try:
            async for event in streams[0]:
                yield streams[0], event
            yield streams[0], None
        finally:
            streams[0].cancel()
        return
    queue: asyncio.Queue[tuple[RequestStream, TokenEvent | None] | BaseException] = asyncio.Queue()

    async def pump(stream: RequestStream) -> None:
        try:
            async for event in stream:
                queue.put_nowait((stream, event))
            queue.put_nowait((stream, None))
        except BaseException as e:  # delivered to the consumer, which re-raises it
            queue.put_nowait(e)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        for _ in range(len(streams)):
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item[1] is None:
                    break
    finally:
        for task in tasks:
            task.cancel()
        for s in streams:
            s.cancel()  # a client gone mid-stream frees its rows at the next step


_LINE_BREAKS = {"\u2028".encode(): b"\\u2028", "\u2029".encode(): b"\\u2029", "\x85".encode(): b"\\u0085"}


def _one_line(data: bytes) -> bytes:
    """JSON text with the characters that end a line for `str.splitlines` (and so for httpx's `iter_lines`,
    which would cut an event in two) written as escapes: JSON's encoders write them as they are, and in UTF-8
    their bytes are those characters wherever they occur (inside strings: JSON allows them nowhere else)."""
    for character, escape in _LINE_BREAKS.items():
        data = data.replace(character, escape)
    return data


def sse(events: AsyncIterator[dict[str, Any] | bytes]) -> StreamingResponse:
    """Server-Sent Events: one `data:` line of JSON per event (given as a dict, or as JSON bytes already
    encoded off the event loop, whose text must be one line: a final event with its dump, whose only string is
    its empty "text"), then `data: [DONE]`. A dict is written as a whole answer is (`json_bytes`: infinities and
    NaN as null, which JSON parsers other than Python's would refuse as written), but for U+2028, U+2029 and
    U+0085 (`_one_line`)."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                data = event if isinstance(event, bytes) else _one_line(encoding.json_bytes(event))
                yield b"data: " + data + b"\n\n"
        except ClientLeft:  # its last event's dump stopped encoding: no one reads the rest
            return
        except GenerationError as e:  # this request's own fault, found mid-stream (e.g. its edits blew up)
            yield f"data: {json.dumps(generation_error_body(e))}\n\n".encode()
        except Exception as e:  # the status line is gone already: say it in the stream
            log.exception("stream failed", exc_info=e)
            yield f"data: {json.dumps(error_body(500, 'generation failed; the stream ends here'))}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
