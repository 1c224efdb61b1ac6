"""Time limits on one HTTP request: reading its body (a slow upload cannot hold a connection and a body buffer
forever) and generating its answer (``--request-timeout``: the request ends with a clear error and its sequences
are aborted, freeing their KV blocks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


class DeadlineExceeded(Exception):
    """The request's deadline passed while it was waiting for the next item."""


def deadline_after(seconds: float | None) -> float | None:
    """The event loop's clock ``seconds`` from now (None: no deadline)."""
    return None if seconds is None else asyncio.get_running_loop().time() + seconds


async def until_deadline(items: AsyncIterator[T], deadline: float | None) -> AsyncIterator[T]:
    """``items`` until they end, or :class:`DeadlineExceeded` once the loop's clock passes ``deadline``."""
    it = items.__aiter__()
    loop = asyncio.get_running_loop()
    while True:
        try:
            if deadline is None:
                item = await it.__anext__()
            else:
                item = await asyncio.wait_for(it.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:  # (the builtin TimeoutError from Python 3.11 on)
            raise DeadlineExceeded from None
        yield item


__all__ = ["DeadlineExceeded", "deadline_after", "until_deadline"]
