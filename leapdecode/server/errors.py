"""Every error the app answers has OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from leapdecode.server.protocol import APIError

logger = logging.getLogger("leapdecode.server")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Turn ``APIError``, Starlette's HTTP errors, FastAPI's validation errors and any other exception (a server
    bug: logged, answered 500) into OpenAI error bodies."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(str(exc.detail), status=exc.status_code, type=kind)
        err.headers = dict(exc.headers or {})
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _fastapi_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(f"invalid request: {exc.errors()[:3]}"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error serving %s", request.url.path)
        return error_response(APIError("internal server error", status=500, type="internal_error"))
