"""The id of the request being served, for the server's log records (a light module: ``serve`` imports it)."""

from __future__ import annotations

import contextvars
import logging

# set by the RequestId middleware for the whole handling of one request; None outside a request
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (``-`` outside a request) to every record it sees, for log formats that show
    ``%(request_id)s``; attach it to a handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get() or "-"
        return True
