"""Bridge between asyncio request handlers and the single-threaded ``LLMEngine`` (continuous batching).

One background thread (the *engine thread*) owns the engine: it alone calls ``add_request``, ``step`` and
``abort_request`` once :meth:`AsyncEngine.start` has run. Handlers on the event loop talk to it through a
thread-safe inbox (adds and aborts, processed in FIFO order) and receive results through
``loop.call_soon_threadsafe``; every step's results for all requests go back in one callback.

Invariants
----------
* Every request the engine accepted ends exactly once: it finishes in the engine, it is aborted (client gone,
  :meth:`RequestStream.abort`), or the engine step fails / the engine stops and the request is aborted and its
  stream gets an error. Either way its KV blocks are freed by the engine thread.
* A :class:`RequestStream` receives *cumulative* snapshots (:class:`StreamOutput`); a slow consumer only sees
  the latest one (snapshots coalesce), so memory per request is bounded whatever the client's speed.
* ``num_queued`` counts requests submitted but not yet producing their first token (in the inbox,
  waiting in the scheduler, or prefilling); :meth:`AsyncEngine.add_request` refuses new requests with
  :class:`QueueFullError` once it reaches ``max_queue``. Only the event loop touches it, so it needs no lock.
* No input can kill the engine thread: engine exceptions are caught, reported to the affected requests,
  and the loop carries on. An error while processing one request fails that request alone (the engine contains
  it, ``LLMEngine.take_failed``); only a step that raises as a whole aborts every request it held.
* :meth:`AsyncEngine.unhealthy` says why the engine cannot serve (``/health`` answers 503 with it): the thread is
  gone, a tensor-parallel worker died (every later step would fail), or steps keep failing as a whole
  (``FAILING_STEPS`` in a row, or that many forwards in a row that failed for every request in them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leapdecode.engine.executor import WorkerDiedError
from leapdecode.engine.llm_engine import LLMEngine
from leapdecode.outputs import PositionLogprobs, RequestMetrics, RequestOutput
from leapdecode.sampling_params import SamplingParams
from leapdecode.server.props import SlotState, drafter_memory, slot_states
from leapdecode.structured import CompiledGrammar

logger = logging.getLogger("leapdecode.server")
# steps in a row that fail as a whole (or whose forward fails for every request) before /health says 503
FAILING_STEPS = 3
DRAFTER_MEMORY_EVERY_S = 1.0  # how often the engine thread re-measures its drafters' memory


class QueueFullError(Exception):
    """Too many requests are waiting for their first token; retry later."""


class EngineDeadError(Exception):
    """The engine is not running (stopped, or never started)."""


class RequestAbortedError(Exception):
    """The request was aborted before it finished."""


class EngineStepError(Exception):
    """An engine step failed; the request was aborted (this is a server bug, not bad input)."""


@dataclass(frozen=True)
class ChoiceSnapshot:
    """One completion of a request (``n`` > 1 gives several) at one moment; ``text`` is cumulative, and so are
    ``logprobs`` (one entry per token of ``token_ids``, when the request asked for them)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: Sequence[PositionLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StreamOutput:
    """An immutable snapshot of one request's progress, made on the engine thread.

    ``choices`` holds the request's completions (one per sample of ``n``); ``finished`` is true on the last
    snapshot only, once every completion has finished."""

    request_id: str
    choices: tuple[ChoiceSnapshot, ...]
    prompt_token_ids: Sequence[int]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Sequence[PositionLogprobs | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @classmethod
    def from_output(cls, out: RequestOutput) -> StreamOutput:
        choices = tuple(
            ChoiceSnapshot(
                index=c.index,
                text=c.text,
                token_ids=tuple(c.token_ids),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=c.logprobs,  # the engine's make_output copied its growing list: ours alone
            )
            for c in out.outputs
        )
        return cls(
            request_id=out.request_id,
            choices=choices,
            # (fresh lists from make_output, never touched again: no second O(prompt) copy per step)
            prompt_token_ids=out.prompt_token_ids,
            finished=out.finished,
            metrics=dataclasses.replace(out.metrics),  # the engine keeps mutating its own copy
            prompt_logprobs=out.prompt_logprobs,
        )


@dataclass(frozen=True)
class EngineGauges:
    """Engine state published by the engine thread after every iteration (read by ``/metrics``, ``/slots`` and
    ``/props``): ``slots`` every unfinished sequence, ``drafter_memory`` bytes per drafter (measured at most every
    ``DRAFTER_MEMORY_EVERY_S``)."""

    kv_blocks_in_use: int = 0
    kv_blocks_total: int = 0
    num_running: int = 0
    num_waiting: int = 0
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    slots: tuple[SlotState, ...] = ()
    drafter_memory: dict[str, int] = dataclasses.field(default_factory=dict)


class _Accepted:
    """Marker: the engine thread added the request."""


_ACCEPTED = _Accepted()

# callbacks the AsyncEngine fires on the event loop: first token (ttft_s), finish (output, e2e_s), abort
FirstTokenHook = Callable[[float], None]
FinishHook = Callable[[StreamOutput, float], None]


class RequestStream:
    """One request's results, consumed on the event loop: ``async for out in stream`` yields cumulative
    :class:`StreamOutput` snapshots and stops after the finished one. Abort with :meth:`abort` (idempotent;
    a no-op once finished)."""

    def __init__(self, owner: AsyncEngine, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.submitted = time.perf_counter()
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.done = False  # finished, failed or aborted: nothing more will be pushed
        self.first_token_at: float | None = None
        self._owner = owner
        self._latest: StreamOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._consumed_final = False

    # ------------------------------------------------------------------------------------ event-loop side
    def _push(self, item: StreamOutput | BaseException) -> None:
        if self.done:
            return
        if isinstance(item, BaseException):
            self._error = item
            self.done = True
        else:
            self._latest = item
            self.done = item.finished
        self._event.set()

    def abort(self) -> None:
        """Stop generating for this request and free its KV blocks (no-op when already done)."""
        self._owner._abort(self)

    def __aiter__(self) -> AsyncIterator[StreamOutput]:
        return self

    async def __anext__(self) -> StreamOutput:
        while True:
            if self._latest is not None:
                item, self._latest = self._latest, None
                if item.finished:
                    self._consumed_final = True
                return item
            if self._error is not None:
                raise self._error
            if self._consumed_final:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()


class AsyncEngine:
    """Runs an ``LLMEngine`` on a background thread and serves many concurrent requests from asyncio.

    Use ``start()`` from inside the running event loop, ``await add_request(...)`` (or ``generate(...)``) per
    request, and ``stop()`` at shutdown. See the module docstring for the invariants."""

    def __init__(
        self,
        engine: LLMEngine,
        max_queue: int = 256,
        on_first_token: FirstTokenHook | None = None,
        on_finish: FinishHook | None = None,
        on_abort: Callable[[], None] | None = None,
    ) -> None:
        if not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.num_queued = 0
        self.gauges = EngineGauges(kv_blocks_total=engine.block_manager.num_blocks, stats=engine.stats.as_dict())
        self.on_first_token = on_first_token
        self.on_finish = on_finish
        self.on_abort = on_abort
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._dead: str | None = None  # why the engine can never serve again (a tensor-parallel worker died)
        self._failing_steps = 0  # consecutive steps that raised as a whole
        self._last_failure = ""  # the kind of error the last of them raised
        self._memory_at = float("-inf")  # when drafter_memory was last measured

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def unhealthy(self) -> str | None:
        """Why the engine cannot serve now (None: it can). Read from the event loop; the engine thread writes."""
        if not self.is_running:
            return "the engine is not running"
        if self._dead is not None:
            return self._dead
        forwards = self.engine.failed_forwards
        if self._failing_steps >= FAILING_STEPS or forwards >= FAILING_STEPS:
            n = max(self._failing_steps, forwards)
            what = "engine step" if self._failing_steps >= FAILING_STEPS else "model forward"
            return f"the {what} failed {n} times in a row ({self._last_failure}); the server log has the details"
        return None

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the results."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="leapdecode-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread, abort every request still in the engine and fail their streams.

        Call from the event loop thread. After it returns the engine may be used directly again."""
        if self._thread is None:
            return
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0f s", timeout)
            return
        for rid in list(self.engine.requests):  # the thread is gone: safe to touch the engine here
            self.engine.abort_request(rid)
        while True:  # adds that never reached the engine
            try:
                self._inbox.get_nowait()
            except queue.Empty:
                break
        for stream in list(self._streams.values()):
            self._fail(stream, EngineDeadError("the server is shutting down"))
        self._publish()

    # ------------------------------------------------------------------------------------------- requests
    async def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> RequestStream:
        """Submit a request and wait until the engine accepted it (``grammar``: its structured output, compiled
        off the engine thread).

        Raises ``QueueFullError`` (too many queued), ``EngineDeadError`` (not running), or the engine's
        ``ValueError``/``TypeError`` for a request it refuses (e.g. prompt longer than the context)."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self.num_queued >= self.max_queue:
            raise QueueFullError(
                f"{self.num_queued} requests are already waiting (max_queue={self.max_queue})"
            )
        rid = uuid.uuid4().hex
        stream = RequestStream(self, rid, params)
        self._streams[rid] = stream
        self.num_queued += 1
        self._inbox.put(("add", rid, list(prompt_token_ids), params, prompt, grammar))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self._abort(stream)
            raise
        return stream

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> AsyncIterator[StreamOutput]:
        """Async iterator of cumulative snapshots; leaving the loop early aborts the request."""
        stream = await self.add_request(prompt_token_ids, params, prompt)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    # ---------------------------------------------------------------------------------- event-loop helpers
    def _leave_queue(self, stream: RequestStream) -> None:
        if stream.first_token_at is None:
            stream.first_token_at = time.perf_counter()
            self.num_queued -= 1

    def _abort(self, stream: RequestStream) -> None:
        if stream.done:
            return
        self._leave_queue(stream)
        self._streams.pop(stream.request_id, None)
        stream._push(RequestAbortedError(f"request {stream.request_id} was aborted"))
        if not stream.accepted.done():
            stream.accepted.cancel()
        self._inbox.put(("abort", stream.request_id))
        if self.on_abort:
            self.on_abort()

    def _fail(self, stream: RequestStream, exc: BaseException) -> None:
        self._leave_queue(stream)
        self._streams.pop(stream.request_id, None)
        if not stream.accepted.done():
            stream.accepted.set_exception(exc)
        stream._push(exc)

    def _dispatch(self, items: list[tuple[str, Any]]) -> None:
        """Runs on the event loop: route one engine iteration's results to their streams."""
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is None:  # aborted (or failed) meanwhile
                continue
            try:
                if item is _ACCEPTED:
                    if not stream.accepted.done():
                        stream.accepted.set_result(None)
                elif isinstance(item, BaseException):
                    self._fail(stream, item)
                else:
                    if stream.first_token_at is None:
                        self._leave_queue(stream)
                        if self.on_first_token and item.num_output_tokens:
                            self.on_first_token(stream.first_token_at - stream.submitted)
                    stream._push(item)
                    if item.finished:
                        self._streams.pop(rid, None)
                        if self.on_finish:
                            self.on_finish(item, time.perf_counter() - stream.submitted)
            except Exception:  # a metrics hook must never break delivery to the other requests
                logger.exception("delivering results for request %s failed", rid)

    def _send(self, items: list[tuple[str, Any]]) -> None:
        loop = self._loop
        if not items or loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._dispatch, items)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    # -------------------------------------------------------------------------------------- engine thread
    def _publish(self) -> None:
        eng = self.engine
        bm = eng.block_manager
        memory = self.gauges.drafter_memory
        if time.monotonic() - self._memory_at >= DRAFTER_MEMORY_EVERY_S:
            memory, self._memory_at = drafter_memory(eng), time.monotonic()
        self.gauges = EngineGauges(
            kv_blocks_in_use=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            num_running=len(eng.scheduler.running),
            num_waiting=len(eng.scheduler.waiting),
            stats=eng.stats.as_dict(),
            slots=slot_states(eng),
            drafter_memory=memory,
        )

    def _take_commands(self, block: bool) -> list[tuple[Any, ...]]:
        cmds: list[tuple[Any, ...]] = []
        if block:
            try:
                cmds.append(self._inbox.get(timeout=0.5))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _run(self) -> None:
        eng = self.engine
        while not self._stopping.is_set():
            try:
                self._iteration(eng)
            except Exception:  # never let the loop die; report and keep serving
                logger.exception("engine loop iteration failed")
                time.sleep(0.05)

    def _iteration(self, eng: LLMEngine) -> None:
        out: list[tuple[str, Any]] = []
        for cmd in self._take_commands(block=not eng.has_unfinished_requests()):
            if self._stopping.is_set():
                return
            if cmd[0] == "add":
                _, rid, tokens, params, prompt, grammar = cmd
                try:
                    eng.add_request(tokens, params, request_id=rid, prompt=prompt, grammar=grammar)
                    out.append((rid, _ACCEPTED))
                except (ValueError, TypeError) as e:
                    out.append((rid, e))
                except Exception as e:
                    logger.exception("add_request failed")
                    # the client gets the kind only: the message may name server paths (the log has it whole)
                    why = f"the engine could not add the request ({type(e).__name__}); the server log has the details"
                    out.append((rid, EngineStepError(why)))
            elif cmd[0] == "abort":
                eng.abort_request(cmd[1])
        if eng.has_unfinished_requests():
            self._step(eng, out)
        self._publish()
        self._send(out)

    def _step(self, eng: LLMEngine, out: list[tuple[str, Any]]) -> None:
        """One engine step on the engine thread: results, the requests it failed, and the health it shows."""
        try:
            results = eng.step()
        except Exception as e:  # the step as a whole: the engine's state is unknown, so every request is aborted
            logger.exception("engine step failed; aborting %d request(s)", len(eng.requests))
            self._failing_steps += 1
            self._last_failure = type(e).__name__
            if isinstance(e, WorkerDiedError):
                self._dead = f"a tensor-parallel worker died ({e}); restart the server"
            for rid in list(eng.requests):
                eng.abort_request(rid)
                why = f"the engine step failed ({type(e).__name__}); the server log has the details"
                out.append((rid, EngineStepError(why)))
        else:
            self._failing_steps = 0
            out.extend((r.request_id, StreamOutput.from_output(r)) for r in results)
        for rid, err in eng.take_failed().items():  # contained: only these requests failed
            cause = err.__cause__ or err
            logger.error("request %s failed in an engine step; the others go on", rid, exc_info=cause)
            self._last_failure = type(cause).__name__
            why = f"the engine step failed for this request ({type(cause).__name__}); the server log has the details"
            out.append((rid, EngineStepError(why)))
