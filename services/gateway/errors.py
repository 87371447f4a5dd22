"""OpenAI-style errors: one exception type carrying HTTP status, body fields and headers, and the handlers.

Every error the gateway returns has the body `{"error": {"message", "type", "param", "code"}}`, also
FastAPI's request-validation errors (OpenAI answers 400 where FastAPI would answer 422) and Starlette's
404/405 for unknown routes; on the Messages API's routes (`/v1/messages...`) the same errors take
Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from shared.error_types import RETRY_STATUSES, ErrorType
from shared.messages import ErrorBody

log = logging.getLogger("aflex.gateway")

INVALID_REQUEST = ErrorType.INVALID_REQUEST
AUTHENTICATION = ErrorType.AUTHENTICATION
NOT_FOUND = ErrorType.NOT_FOUND
RATE_LIMIT = ErrorType.RATE_LIMIT
OVERLOADED = ErrorType.OVERLOADED
SERVICE_UNAVAILABLE = ErrorType.SERVICE_UNAVAILABLE
TIMEOUT = ErrorType.TIMEOUT
SERVER_ERROR = ErrorType.SERVER_ERROR


def json_bytes(content: Any) -> bytes:
    """JSON by orjson, or by the standard library where orjson cannot (an integer beyond 64 bits, which JSON
    allows and a request may carry into what is echoed back)."""
    try:
        return orjson.dumps(content)
    except TypeError:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()


class JSONResponse(Response):
    """orjson-rendered JSON (FastAPI's ORJSONResponse is on its way out)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


class APIError(Exception):
    """An error to send to the client as an OpenAI error body with `status`."""

    def __init__(self, status: int, message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def anthropic_body(self) -> dict[str, Any]:
        """The error as Anthropic's Messages API sends it: `{"type": "error", "error": {"type", "message"}}`."""
        kind = ANTHROPIC_TYPES.get(self.type, self.type)
        return {"type": "error", "error": {"type": kind, "message": self.message}}


ANTHROPIC_TYPES: dict[str, str] = {SERVICE_UNAVAILABLE: "api_error", SERVER_ERROR: "api_error",
                                   TIMEOUT: "api_error"}  # Anthropic's names; the other types are theirs too


def _anthropic(request: Request) -> bool:
    """Whether `request` is on the Messages API's routes, whose errors take Anthropic's shape."""
    return request.url.path.startswith("/v1/messages")


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def retry_after_headers(seconds: float | None) -> dict[str, str]:
    """`Retry-After` in whole seconds (at least 1), and `retry-after-ms` that openai-python also reads."""
    seconds = 1.0 if seconds is None or not math.isfinite(seconds) or seconds <= 0 else seconds
    return {"Retry-After": str(max(1, math.ceil(seconds))), "retry-after-ms": str(int(seconds * 1000))}


def from_error_body(error: ErrorBody | None, retry_after_s: float | None = None) -> APIError:
    """Map a scheduler's typed rejection / error to an HTTP error (unknown types are 500)."""
    if error is None:
        return APIError(500, "the scheduler rejected the request without a reason", type=SERVER_ERROR)
    status = ErrorType.status_of(error.type)
    headers = retry_after_headers(retry_after_s) if status in RETRY_STATUSES else {}
    return APIError(status, error.message, type=error.type, param=error.param, code=error.code, headers=headers)


def _where(loc: tuple[Any, ...]) -> tuple[str | None, str]:
    """(param: the top-level field, path: where in it) of a validation error location."""
    parts = [str(p) for p in loc if p != "body"]
    return (parts[0] if parts else None), ".".join(parts)


async def _api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response(_anthropic(request))


async def _validation_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    # a refusal by name (a validator's ValueError) says more than a union branch's type error before it
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0] if errors else {})
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        message = f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}"
        return invalid(message).response(_anthropic(request))
    param, path = _where(loc)
    if param is None:
        return invalid(f"request body must be a JSON object: {first.get('msg', 'invalid body')}").response(
            _anthropic(request))
    message = f"{path}: {first.get('msg', 'invalid value')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return invalid(message, param).response(_anthropic(request))


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
    return APIError(exc.status_code, str(exc.detail), type=kind, headers=dict(exc.headers or {})).response(
        _anthropic(request))


async def _unexpected_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type=SERVER_ERROR).response(_anthropic(request))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, _unexpected_error_handler)
