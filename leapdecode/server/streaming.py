"""Server-sent events and client-disconnect handling shared by the completion routes.

* :class:`TextDeltas` turns the engine's cumulative texts into the deltas a stream sends: a delta never ends in an
  incomplete UTF-8 character (``'\\ufffd'``) and, while stop strings are active, the last ``len(longest stop) - 1``
  characters are held back so a stop string is never partially sent. The deltas concatenate to exactly the
  non-streamed text.
* :class:`AbortingStreamingResponse` aborts the request as soon as the client goes away (or the stream ends for any
  reason), so no abandoned request keeps generating; :func:`until_disconnect` does the same for a non-streamed one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from leapdecode.server.async_engine import ChoiceSnapshot, RequestStream, StreamOutput

SSE_DONE = "data: [DONE]\n\n"


class TextDeltas:
    """Turns cumulative texts into deltas.

    Invariant: the deltas returned so far are ``self.sent``, a prefix of the latest text; before the final
    update that prefix never ends in ``'\\ufffd'`` and never covers the last ``hold``
    characters (a stop string could still be completing there and would then be cut from the final text)."""

    def __init__(self, stop_list: list[str]) -> None:
        self.sent = ""
        self.hold = max((len(s) for s in stop_list), default=1) - 1

    def update(self, text: str, finished: bool) -> str:
        upto = len(text) if finished else len(text) - self.hold
        if not finished:
            while upto > 0 and text[upto - 1] == "\ufffd":
                upto -= 1
        if upto <= len(self.sent):
            return ""
        delta = text[len(self.sent) : upto]
        self.sent = text[:upto]
        return delta


@dataclass(frozen=True)
class Delta:
    """What one streamed chunk carries for choice ``index``: new ``text`` (None on the opening chunk), the
    ``finish_reason`` on the choice's last chunk, and the ``choice`` snapshot (of ``output``) whose tokens from
    ``tokens_from`` on are new since the previous chunk of this choice (``tokens_from`` is 0 on its first)."""

    index: int
    text: str | None
    finish_reason: str | None
    choice: ChoiceSnapshot | None
    tokens_from: int
    first: bool = False
    output: StreamOutput | None = None


# builds one SSE payload from a delta (None: send nothing for it)
ChunkBuilder = Callable[[Delta], dict[str, Any] | None]


class ChoiceDeltas:
    """The deltas of every choice of one answer: choice ``j`` of prompt ``k`` is choice ``k * n + j``. Each choice
    has its own :class:`TextDeltas`; its last delta carries its ``finish_reason`` and nothing follows it."""

    def __init__(self, stop_lists: list[list[str]], n: int) -> None:
        self.n = n
        self.texts = [TextDeltas(stops) for stops in stop_lists for _ in range(n)]
        self.tokens_sent = [0] * len(self.texts)
        self.closed = [False] * len(self.texts)

    def update(self, k: int, out: StreamOutput) -> list[Delta]:
        """The deltas snapshot ``out`` of prompt ``k`` adds."""
        deltas = []
        for c in out.choices:
            index = k * self.n + c.index
            if self.closed[index]:
                continue
            text = self.texts[index].update(c.text, c.finished)
            if text or c.finished:
                deltas.append(Delta(index, text, c.finish_reason, c, self.tokens_sent[index], output=out))
                self.tokens_sent[index] = len(c.token_ids)
                self.closed[index] = c.finished
        return deltas


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamOutput]]:
    """``(k, snapshot)`` from the ``k``-th stream, in the order they arrive, until every stream has finished; an
    error of any stream propagates."""
    pending = {asyncio.ensure_future(anext(s)): k for k, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                k = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield k, out
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[k]))] = k
    finally:
        for task in pending:
            task.cancel()


class AbortingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always watches for the client going away and then calls ``on_close``.

    Starlette only watches for ``http.disconnect`` under ASGI spec < 2.4; this class also runs
    ``on_close`` (an idempotent abort) when the stream ends for any reason, so no abandoned request keeps
    generating."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.on_close()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            await super().__call__(scope, receive, send)
        finally:
            watcher.cancel()
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run ``work``; if the client disconnects first, cancel it. Returns ``(finished, result)``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    return False, None


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as compact JSON."""
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"
