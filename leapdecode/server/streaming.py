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
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

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
