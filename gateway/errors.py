"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure.

Handlers turn our own `OpenAIError`, FastAPI/Starlette HTTP errors and pydantic validation
errors into that shape; `CatchAllMiddleware` turns anything unexpected into a 500 in the same
shape, so a client never sees a stack trace or a plain-text body.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import iter_route_contexts
from pydantic import ValidationError
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
    405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
    503: "service_unavailable", 504: "timeout_error",
}


class OpenAIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str | None = None,
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error" if status >= 500
                                                else "invalid_request_error")
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


_CODED = "openai_code:"


def coded(code: str, message: str) -> PydanticCustomError:
    """For a validator to raise: its 400 then has this error code instead of invalid_value."""
    return PydanticCustomError(_CODED + code, message.replace("{", "{{").replace("}", "}}"))


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """("messages", 0, "content") → "messages[0].content"; "body" (FastAPI's root) dropped."""
    parts = [p for p in loc if p != "body"]
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or None


def from_validation_errors(errors: list[dict[str, Any]]) -> OpenAIError:
    """The first pydantic error as a 400 naming its parameter, the way OpenAI reports them."""
    if not errors:
        return invalid("Invalid request body.")
    error = errors[0]
    kind = error.get("type", "")
    param = _param_from_loc(tuple(error.get("loc", ())))
    if kind == "json_invalid":
        return invalid("We could not parse the JSON body of your request: "
                       f"{error.get('ctx', {}).get('error', 'invalid JSON')}.", code="invalid_json")
    if kind == "extra_forbidden":
        name = param if param is not None else repr(str(error.get("loc", ("",))[-1]))
        return invalid(f"Unrecognized request argument supplied: {name}", param=param if param else name,
                       code="unrecognized_argument")
    if kind == "missing":
        return invalid(f"Missing required parameter: '{param}'.", param=param,
                       code="missing_required_parameter")
    message = str(error.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")  # pydantic's prefix for our ValueErrors
    code = kind.removeprefix(_CODED) if kind.startswith(_CODED) else "invalid_value"
    if param is None:
        return invalid(f"Invalid request body: {message}", code=None if code == "invalid_value" else code)
    return invalid(f"Invalid value for '{param}': {message}", param=param, code=code)


async def _openai_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, (RequestValidationError, ValidationError))
    return from_validation_errors(list(exc.errors())).response()


async def _http_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    error = OpenAIError(exc.status_code, str(exc.detail))
    response = error.response()
    if exc.headers:
        response.headers.update(exc.headers)
    if exc.status_code == 405:
        response.headers["Allow"] = ", ".join(_allowed_methods(request, response.headers.get("Allow", "")))
    return response


def _allowed_methods(request: Request, allowed: str) -> list[str]:
    """`allowed` and the methods of every other route of the app at this path (Starlette's
    405 names the first route's only, and a path such as /v1/files has one route per method),
    the routes of the included routers (gateway/routes/) among them."""
    methods = {m.strip() for m in allowed.split(",") if m.strip()}
    for route in iter_route_contexts(request.app.router.routes):
        if route.methods and route.matches(request.scope)[0] != Match.NONE:
            methods.update(route.methods)
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(ValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Any exception that escapes a route before the response started becomes an
    OpenAI-shaped 500. (Starlette's own `Exception` handler would answer too, but re-raises
    afterwards; this one logs and stops there.) Once a response has started — an SSE stream —
    the stream itself must report errors, so the exception is only logged."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                return
            error = OpenAIError(500, "The server had an error while processing your request.",
                                type="server_error", code="internal_error")
            await error.response()(scope, receive, send)
