"""The engine: owns the model and schedules every request onto it, from one worker thread.

No model code runs on the event loop. Requests wait in a bounded queue; the worker admits them into a
continuous batch (`model.generate.DecodeBatch`) as rows free up, runs one step at a time (a decode token for
every active sequence and the next prompt chunks, in one forward pass), and at the end of each step hands its
tokens to their requests' asyncio queues, in one call into the event loop (not one a token). A request that
arrives while others decode joins at the next step. Requests with hooks (activations to capture,
interventions) share the batch too, each seeing only its own values. Those that only want a prompt's
activations (nothing to generate, no logits) skip the KV cache: those waiting run together in padded forward
passes that end after the last hook they capture (`model.generate.prefill_prompts`), one pass of at most a
prompt chunk's tokens (`prefill_chunk`, B x the longest) before each decode step (and a block of a whole
prompt's pass, below), so short ones share a pass; a prompt with edits has a pass of its own. One whose pass
would cost more than a chunk's through every block joins the batch and is prefilled a chunk a step, as a
generation's, unless its edits need the whole prompt at once (`mean`): its pass then runs a block a step
(`model.generate.PromptsPass`). A cancelled request (client gone) leaves the batch at the next step and frees
its row; a sequence that fails on its own (non-finite logits, say) ends with its error, and its batch goes on.
Jobs (`call`: a piece of a lab request's work, a block of its pass or a part of its measures) wait in a queue
bounded like the requests' and run one between two steps, so that a burst of them does not stall the sequences
decoding; a job whose caller is gone leaves the queue, or, once running, stops at the next block its forward
passes enter."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from model.generate import (
    Completion,
    DecodeBatch,
    GenerationError,
    PromptsPass,
    SamplingParams,
    SequenceState,
    TokenEvent,
    TokenLogprob,
    has_edits,
    new_sequence,
    pass_blocks,
    prefill_prompts,
)
from model.gpt import GPT
from model.hooks import needs_whole_prompt, select_hooks
from model.interventions import EditSpec, InterventionError
from model.loading import LoadedModel

from .metrics import Metrics
from .threads import release_openmp_pool

log = logging.getLogger(__name__)
T = TypeVar("T")

CLAIM_S = 5.0  # how long the room a refused request needs is held for its retry (its 429 says retry after 1 s)


class QueueFull(Exception):
    """More requests are waiting than the queue allows."""


class EngineStopped(Exception):
    """The engine is shutting down."""


class JobCancelled(Exception):
    """A running job's caller is gone: raised as its forward pass enters the next block."""


@dataclass
class _Claim:
    """Room held for the largest request refused lately (a 429), so that smaller ones arriving all the time
    cannot keep it out for ever: while it holds, a smaller request is taken only where it leaves that many
    places; the next request of that size or more takes the room, and the claim lapses `CLAIM_S` after its last
    refusal (a client that gave up)."""

    n: int  # sequences
    until: float  # time.monotonic()


@dataclass(eq=False)  # compared by identity (`in`, `remove` on the queue)
class _Request:
    seq: SequenceState
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenEvent | Completion | BaseException]
    submitted: float = field(default_factory=time.perf_counter)
    last_token: float | None = None
    cancelled: bool = False
    label: str | None = None  # the sequence's prompt among several (`input_ids[1]`), its errors prefixed with it


E = TypeVar("E", bound=BaseException)


def labelled(error: E, label: str | None) -> E:
    """`error` with `label` (a prompt's place among several, `input_ids[1]`) before its message, of its own kind
    (a ContextLengthError stays one): for the errors a request's client reads, a `GenerationError` or an
    `InterventionError`; any other, and any without a label, as it is."""
    if label is not None and isinstance(error, GenerationError):
        return type(error)(f"{label}: {error}", error.param)
    if label is not None and isinstance(error, InterventionError):
        return type(error)(f"{label}: {error}", error.param)
    return error


@dataclass(eq=False)
class _Job:
    fn: Callable[[GPT], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    cancelled: bool = False  # set from the event loop, read on the engine's thread as blocks start


class RequestStream:
    """One sequence's tokens as the engine produces them; `completion` holds the result at the end."""

    def __init__(self, engine: Engine, request: _Request) -> None:
        self._engine = engine
        self._request = request
        self.completion: Completion | None = None

    @property
    def index(self) -> int:
        return self._request.seq.index

    @property
    def prompt(self) -> list[int]:
        return self._request.seq.prompt

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """Set once the prompt is prefilled, before its first token arrives (if they were asked for)."""
        return self._request.seq.prompt_logprobs

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while self.completion is None:
            item = await self._request.queue.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Completion):
                self.completion = item
            else:
                yield item

    async def result(self) -> Completion:
        async for _ in self:
            pass
        assert self.completion is not None
        return self.completion

    def cancel(self) -> None:
        """Stop generating (the client went away); safe to call at any time, also after the end."""
        if self.completion is None and not self._request.cancelled:
            self._engine._cancel(self._request)


def default_prefill_chunk(device: torch.device) -> int:
    """Prompt tokens per engine step where none is given: enough to use the matrix units well, few enough not
    to slow the decoding sequences much."""
    return 512 if device.type == "cuda" else 64


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        max_batch_size: int = 16,
        max_queue: int = 256,
        prefill_chunk: int | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """`prefill_chunk`: prompt tokens per engine step, packed with the decode tokens (None: by device)."""
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError("max_batch_size and max_queue must be at least 1")
        self.loaded = loaded
        self.model: GPT = loaded.model
        self.tokenizer = loaded.tokenizer
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.passes = 0  # lab passes under way, each a job at a time (`routes.deps.stepped`): at most max_queue
        self.metrics = metrics or Metrics()
        config = self.model.config
        self.prefill_chunk = default_prefill_chunk(loaded.device) if prefill_chunk is None else prefill_chunk
        # Before serving: on a GPU the decode step is captured as CUDA graphs; on a CPU in bfloat16, every
        # shape of a step is run once (see DecodeBatch.warm_up).
        static = loaded.device.type == "cuda"
        self._batch = DecodeBatch(self.model, max_batch_size, config.n_positions, self.prefill_chunk, static)
        self._shared_counted = 0  # of the batch's shared_tokens, those already in the metrics
        self._groups = itertools.count()
        self._batch.warm_up()
        # The cache was zeroed and the batch warmed on this thread: its OpenMP threads go, so that the engine's
        # thread keeps the only pool and its threads spin between parallel regions (server/threads.py).
        release_openmp_pool()
        self._prompt_only: deque[_Request] = deque()  # admitted, for `prefill_prompts` passes in turn
        self._whole_passes: deque[_Request] = deque()  # admitted, for passes a block a step, one at a time
        self._passing: _Passing | None = None  # the one under way
        self._requests: dict[int, _Request] = {}  # id(seq) -> request, for every admitted sequence
        self._waiting: deque[_Request] = deque()
        self._admitting = 0  # requests taken from `_waiting` into the batch this turn, not in it yet
        self._claim: _Claim | None = None  # room held for a request refused for the lack of it
        self._jobs: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._outbox: list[tuple[_Request, TokenEvent | Completion | BaseException]] = []  # this step's items

    @property
    def kv_cache_bytes(self) -> int:
        return self._batch.cache.nbytes()

    @property
    def sequences(self) -> int:
        """Sequences waiting or being generated now (a replica's load, as Ray Serve's `stats` reports it)."""
        return len(self._waiting) + len(self._requests)

    @property
    def running(self) -> bool:
        """Whether the worker thread is alive: it ends only when the engine stops, or on a bug."""
        return self._thread is not None and self._thread.is_alive()

    # --- the event loop's side -------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpt2-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def most_sequences(self) -> int:
        """The most sequences a request may ask for: what an idle server takes at once, the batch's places
        and the queue's. More is a 400 (a retry could never succeed); fewer, while others are being served,
        may be a 429 (`QueueFull`)."""
        return self.max_batch_size + self.max_queue

    def check_count(self, n: int, param: str) -> None:
        """A 400 naming `param` (the field that set how many there are) for a request of `n` sequences, more
        than `most_sequences`."""
        if n > self.most_sequences:
            raise GenerationError(
                f"the request asks for {n} sequences (one per prompt and choice), more than the server takes at "
                f"once ({self.most_sequences}: its --max-batch-size {self.max_batch_size} decoding and --max-queue "
                f"{self.max_queue} waiting): send at most {self.most_sequences}",
                param,
            )

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        hooks: Sequence[str] | None = None,
        edits: EditSpec | None = None,
        count_param: str = "prompt",
        capture_dtype: torch.dtype | None = None,
        labels: Sequence[str] | None = None,
    ) -> list[RequestStream]:
        """Queue one sequence per prompt, all or none (`capture_dtype`: the captured activations are kept in
        it, as a dump sends them, not in the model's dtype first). Raises `GenerationError`/`UnknownHookError` for an
        invalid request or one that could never fit (both 400s: a retry would not help; `count_param`, the
        field that set how many there are, is named when they are too many), then `QueueFull` (429) when
        valid sequences do not fit now; nothing is queued then. `labels`: each sequence's prompt among several
        (`input_ids[1]`), which the errors of its own begin with, here or as it runs (an edit's position out of
        range of one prompt only, its logits overflowing alone; not a stop list's, the whole request's, nor a
        failed pass's, which several sequences share)."""
        self.check_count(len(prompts), count_param)  # before building anything: the count is the client's
        names = select_hooks(hooks, self.model.config.n_layer) if hooks else None
        each: list[str | None] = list(labels) if labels is not None else [None] * len(prompts)
        seqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            try:
                seqs.append(new_sequence(self.model, i, prompt, p, self.tokenizer, names, edits, capture_dtype))
            except InterventionError as e:  # an edit's position past this prompt's end, say (the rest, its stop
                # lists, are the whole request's; so are its edits' where every sequence is as long, as they
                # are checked against lengths alone)
                lengths = {len(prompt) + p.max_new_tokens for prompt, p in zip(prompts, params, strict=True)}
                raise labelled(e, each[i] if len(lengths) > 1 else None) from None
        group = next(self._groups)  # its sequences share prompt prefixes with each other, not with another request's
        for seq in seqs:
            seq.group = group
        loop = asyncio.get_running_loop()
        requests = [_Request(seq, loop, asyncio.Queue(), label=label) for seq, label in zip(seqs, each, strict=True)]
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            self._make_room(len(requests))
            self._waiting.extend(requests)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify()
        return [RequestStream(self, r) for r in requests]

    def _make_room(self, n: int) -> None:
        """Take a request of `n` sequences, or raise `QueueFull` (nothing taken): at most `max_queue` wait beyond
        the batch's free places, and while a larger request refused lately holds its room (`_Claim`), a
        smaller one is taken only beside it. Under the lock."""
        now = time.monotonic()
        free = max(0, self.max_batch_size - self._active() - self._admitting)  # places about to be taken
        room = self.max_queue + free - len(self._waiting)
        claim = self._claim if self._claim is not None and self._claim.until > now else None
        held = claim.n if claim is not None and n < claim.n else 0  # none where this request is as large
        if n <= room - held:
            if claim is not None and n >= claim.n:  # the room held was for this one (or one as large)
                self._claim = None
            return
        if claim is None or n >= claim.n:  # the largest refused holds the room, from now for CLAIM_S more
            self._claim = _Claim(n, now + CLAIM_S)
        waiting = len(self._waiting)
        why = (
            f"room for {max(0, room - held)} more ({_count(free, 'free place')} in the batch and "
            f"{self.max_queue} in the queue, with {_count(waiting, 'sequence')} waiting"
        )
        if held:
            why += f"; {held} of those places held for a larger request refused before, which comes first"
        raise QueueFull(f"the request's {_count(n, 'sequence')} do{'es' if n == 1 else ''} not fit now: {why})")

    async def call(self, fn: Callable[[GPT], T], continuing: bool = False) -> T:
        """Run `fn(model)` on the engine's thread, between engine steps, and return its result (raises
        `QueueFull` when `max_queue` jobs are waiting already, unless `continuing`: the next piece of work
        under way, which a full queue must not throw away half done). Cancelling the call takes its job out of
        the queue if it has not started, and stops it at its next block if it has (each block a chance to
        stop). A long piece of work is better several calls, a block of the model or so each (the lab's
        passes: `routes.deps.stepped`): decode steps run between them."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if len(self._jobs) >= self.max_queue and not continuing:
                raise QueueFull(f"{len(self._jobs)} model calls are waiting (the limit is {self.max_queue})")
            job = _Job(fn, loop, future)
            self._jobs.append(job)
            self._cv.notify()
        try:
            return await future
        except asyncio.CancelledError:  # the caller is gone (its client left)
            with self._cv:
                if job in self._jobs:  # not started: dropped
                    self._jobs.remove(job)
                job.cancelled = True  # running: stops at its next block
            raise

    def _cancel(self, request: _Request) -> None:
        with self._cv:
            request.cancelled = True
            if request in self._waiting:  # not admitted yet: its place in the queue is free at once
                self._waiting.remove(request)
                self.metrics.queue_depth.set(len(self._waiting))
            self._cv.notify()

    # --- the worker thread -----------------------------------------------------------------

    def _active(self) -> int:
        return len(self._batch) + len(self._prompt_only) + len(self._whole_passes) + (self._passing is not None)

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopping or self._jobs or self._waiting or self._active()):
                        self._cv.wait()
                    if self._stopping:
                        break
                    # One job between two steps, so that a burst of them does not stall the decoding
                    # sequences (with nothing decoding, the jobs run back to back, one per turn).
                    job = self._jobs.popleft() if self._jobs else None
                    admitted: list[_Request] = []
                    while self._waiting and self._active() + len(admitted) < self.max_batch_size:
                        admitted.append(self._waiting.popleft())  # a request cancelled by now left the queue
                    self._admitting = len(admitted)  # neither waiting nor in the batch until `_admit`
                    self.metrics.queue_depth.set(len(self._waiting))
                    self.metrics.running.set(self._active() + len(admitted))  # theirs, from now (a job may run first)
                if job is not None:
                    self._run_job(job)
                    job = None  # what it holds (a gradient's graph) is not kept while the engine waits
                self._drop_cancelled()
                for request in admitted:
                    if not request.cancelled:  # cancelled while the job ran: nothing of it is run
                        self._admit(request)
                self._admitting = 0
                self._step()
        self._fail_all(EngineStopped("the server is shutting down"))

    def _run_job(self, job: _Job) -> None:
        def stop_if_cancelled(*_: Any) -> None:
            if job.cancelled:
                raise JobCancelled("the caller is gone")

        checks = [block.register_forward_pre_hook(stop_if_cancelled) for block in self.model.h]
        try:
            result = job.fn(self.model)
        except Exception as e:
            job.loop.call_soon_threadsafe(_settle, job.future, None, e)
        else:
            job.loop.call_soon_threadsafe(_settle, job.future, result, None)
        finally:
            for check in checks:
                check.remove()

    def _admit(self, request: _Request) -> None:
        self._requests[id(request.seq)] = request
        if not self._in_one_pass(request.seq):
            self._batch.add(request.seq)
        elif self._pass_tokens([request.seq]) > self.prefill_chunk:  # a long prompt whose edits need it whole
            self._whole_passes.append(request)
        else:
            self._prompt_only.append(request)

    def _in_one_pass(self, seq: SequenceState) -> bool:
        """Whether a sequence goes to `prefill_prompts`, one pass to the last hook it captures: it only wants
        its prompt's activations, and that pass costs no more than a step's prompt chunk through every block
        (`pass_blocks`), or its edits need the whole prompt in one pass (`mean`), which the batch would give it
        too, through every block. Any other joins the batch and is prefilled a chunk a step, through every
        block, its edits applied to each chunk's positions: one `prefill_prompts` pass over 1,000 tokens of
        gpt2-small held every stream on a 2-core CPU for 1.2 s to its last block, 2.2-2.6 s capturing every
        hook point, `/v1/activations`' default."""
        if not seq.prompt_only:
            return False
        if seq.capture is None or seq.hooks is None:
            return True  # nothing to capture: nothing to run
        if has_edits(seq) and needs_whole_prompt(seq.hooks):
            return True  # edits (the hooks before the capture) that need the prompt whole
        return self._pass_tokens([seq]) <= self.prefill_chunk

    def _step(self) -> None:
        try:
            self._step_batch()
        finally:  # the gauge first: a client that sees its token sees the batch it came from counted
            self.metrics.running.set(self._active())
            self._send()

    def _step_batch(self) -> None:
        if self._prompt_only or self._whole_passes or self._passing is not None:
            self._prefill_prompts()
        if not len(self._batch):
            return
        self.metrics.batch_size.observe(len(self._batch))
        try:
            events = self._batch.step()
        except Exception as e:
            hooked = [seq for seq in self._batch.seqs if seq.hooks is not None]
            if not hooked or len(hooked) == len(self._batch):
                self._fail(self._batch, e)
                return
            # The pass failed with hooks in it: those sequences end with the error (their hooks saw part of
            # a pass), and the step is taken again without them (no plain row has taken a token yet).
            self._fail(self._batch, e, hooked)
            self._send()  # their errors now, not after the pass taken again
            try:
                events = self._batch.step()
            except Exception as again:
                self._fail(self._batch, again)
                return
        self.metrics.prompt_tokens_shared.inc(self._batch.shared_tokens - self._shared_counted)
        self._shared_counted = self._batch.shared_tokens
        for seq, event in events:
            request = self._requests[id(seq)]
            if seq.error is not None:
                self._end_with(request, seq.error)
                continue
            if event is not None:
                self._deliver(request, event)
            if seq.finish_reason is not None:
                self._finish(request)

    def _prefill_prompts(self) -> None:
        """The next block of a whole prompt's pass under way, or its first, and the next prompt-only
        sequences in one padded pass (`prefill_prompts`) of at most `prefill_chunk` tokens, B x the longest (at
        least one prompt): no more before the next decode step than a prompt chunk of generation's and a block
        (or the LM head) of such a pass. A prompt with edits runs in a pass of its own, so that an edit that
        fails fails only its own request. A whole prompt's pass runs a block a step (`PromptsPass`: the streams
        decode between its blocks, where its one pass held them all, 1.2 s at 1,000 tokens of gpt2-small on a
        2-core CPU), one such pass at a time, the cheaper passes beside it meanwhile. Its work is charged to the
        batch (`DecodeBatch.charge`) as it runs, as the batch's own whole prompts are, and the next such pass
        begins only once the batch owes its decoding rows no steps (`owes`): such passes sent back to back slow
        the streams as chunked prompts do."""
        ended: list[_Request] = []
        if self._passing is not None:
            ended += self._pass_a_block()
        if self._passing is None and self._whole_passes and not ended and not self._batch.owes():
            whole = self._whole_passes[0]
            self._passing = _Passing(whole, PromptsPass(self.model, [whole.seq]))
            self._whole_passes.popleft()  # after: `_active`, read by the event loop's thread, counts it meanwhile
            ended += self._pass_a_block()
        group: list[_Request] = []
        for request in self._prompt_only:
            if group:
                alone = has_edits(request.seq) or has_edits(group[0].seq)
                longest = max(len(r.seq.prompt) for r in (*group, request))
                if alone or longest * (len(group) + 1) > self.prefill_chunk:
                    break  # the next pass, after the decode step
            group.append(request)
        if group:
            for request in group:
                self._prompt_only.remove(request)
            prefill_prompts(self.model, [r.seq for r in group])
            ended += group
        for request in ended:
            if request.seq.error is not None:
                self._end_with(request, request.seq.error)
            else:
                self._finish(request)
        self._send()  # their results now, not after the decode pass that follows

    def _pass_a_block(self) -> list[_Request]:
        """The next step of the whole prompt's pass under way, its work charged to the batch in tokens through
        every block (whole ones: the fraction left goes with the next step's); its request if the pass is over."""
        passing = self._passing
        assert passing is not None
        passing.work += len(passing.request.seq.prompt) * passing.run.step() / self.model.config.n_layer
        due = round(passing.work) - passing.charged
        self._batch.charge(due)
        passing.charged += due
        if not passing.run.done:
            return []
        self._passing = None
        return [passing.request]

    def _pass_tokens(self, seqs: list[SequenceState]) -> float:
        """The work of a `prefill_prompts` pass over `seqs`, in tokens through every block: B x the longest, to
        the last hook any captures (`pass_blocks`)."""
        config = self.model.config
        names = [n for s in seqs if s.capture is not None for n in s.capture.names]
        return len(seqs) * max(len(s.prompt) for s in seqs) * pass_blocks(config, names) / config.n_layer

    def _post(self, request: _Request, item: TokenEvent | Completion | BaseException) -> None:
        """`item` for `request`'s queue, sent with the rest of this step's at its end (`_send`)."""
        self._outbox.append((request, item))

    def _send(self) -> None:
        """The items posted so far to their queues, in the order they came: one call into each event loop,
        so that a step of many sequences wakes the loop once, not once a token. A loop that has closed (its
        requests' callers are gone) loses its items, and the others still get theirs."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], Any]]] = {}
        for request, item in self._outbox:
            by_loop.setdefault(request.loop, []).append((request.queue, item))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed
                log.warning("dropped %d items for a closed event loop", len(items))

    def _deliver(self, request: _Request, event: TokenEvent) -> None:
        now = time.perf_counter()
        if request.last_token is None:
            self.metrics.time_to_first_token.observe(now - request.submitted)
        else:
            self.metrics.inter_token_latency.observe(now - request.last_token)
        request.last_token = now
        self.metrics.tokens_generated.inc()
        self._post(request, event)

    def _finish(self, request: _Request) -> None:
        del self._requests[id(request.seq)]
        self._post(request, request.seq.result())

    def _end_with(self, request: _Request, error: Exception) -> None:
        """One sequence failed on its own (its batch goes on): hand its request the error."""
        if isinstance(error, GenerationError):
            log.info("sequence ended: %s", error)
        else:
            log.exception("sequence failed", exc_info=error)
        del self._requests[id(request.seq)]
        self._post(request, labelled(error, request.label))

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._requests.values() if r.cancelled]:
            self._batch.cancel(request.seq)
            for waiting in (self._prompt_only, self._whole_passes):
                if request in waiting:
                    waiting.remove(request)
            if self._passing is not None and self._passing.request is request:  # the rest of its pass is not run
                self._passing = None
            del self._requests[id(request.seq)]

    def _fail(self, batch: DecodeBatch, error: Exception, seqs: list[SequenceState] | None = None) -> None:
        """A forward pass failed: end every sequence of that batch (or `seqs`) with the error, keep serving."""
        seqs = list(batch.seqs) if seqs is None else seqs
        log.exception("engine step failed; ending %d sequences", len(seqs), exc_info=error)
        for seq in seqs:
            batch.cancel(seq)
            request = self._requests.pop(id(seq), None)
            if request is not None:
                self._post(request, error)

    def _fail_all(self, error: Exception) -> None:
        with self._cv:
            pending = list(self._waiting) + list(self._requests.values())
            self._waiting.clear()
            self._requests.clear()
            jobs = list(self._jobs)
            self._jobs.clear()
        for request in pending:
            request.loop.call_soon_threadsafe(request.queue.put_nowait, error)
        for job in jobs:
            job.loop.call_soon_threadsafe(_settle, job.future, None, error)


@dataclass
class _Passing:
    """A whole prompt's pass under way (`PromptsPass`), and its work so far in tokens through every block."""

    request: _Request
    run: PromptsPass
    work: float = 0.0
    charged: int = 0  # of `work`, in whole tokens


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
