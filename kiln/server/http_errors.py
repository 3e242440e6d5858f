"""Errors over HTTP: every failure leaves as the OpenAI error envelope

    {"error": {"message": ..., "type": ..., "param": ..., "code": <Kiln code name>}}

with the HTTP status of its Kiln code (the gRPC status names of kiln/errors.py), so HTTP and gRPC
clients see the same meanings and SDKs translate by `code`. Request-shape problems (malformed JSON,
wrong types, unknown fields) are INVALID_ARGUMENT; `param` names the request field at fault whenever
one is. An unknown model is answered as OpenAI does: 404, `invalid_request_error`, code
`model_not_found`, param `model`. Anything that is not a KilnError is a bug: it is logged and answered
as INTERNAL without its details.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kiln.errors import KilnError, NotFoundError
from kiln.server.quotas import retry_after

logger = logging.getLogger(__name__)

INTERNAL = "INTERNAL"
STATUS_BY_CODE = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "FAILED_PRECONDITION": 409,
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,
    "UNAVAILABLE": 503,
}
CODE_BY_STATUS = {**{status: code for code, status in STATUS_BY_CODE.items()}, 405: "UNIMPLEMENTED",
                  413: "RESOURCE_EXHAUSTED"}
_OPENAI_TYPES = {
    "UNAUTHENTICATED": "authentication_error",
    "PERMISSION_DENIED": "permission_error",
    "NOT_FOUND": "not_found_error",
    "RESOURCE_EXHAUSTED": "rate_limit_error",
    "UNAVAILABLE": "service_unavailable_error",
    INTERNAL: "server_error",
}
MAX_REPORTED_PROBLEMS = 3


class ModelNotFoundError(NotFoundError):
    """The request named a model this server does not serve."""

    param = "model"


def code_name(status: int) -> str:
    """The Kiln code name of an HTTP status, as request metrics count it."""
    if status < 400:
        return "OK"
    return CODE_BY_STATUS.get(status, INTERNAL if status >= 500 else "INVALID_ARGUMENT")


def envelope(message: str, code: str, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(code, "invalid_request_error"),
                      "param": param, "code": code}}


def too_large_response(message: str) -> JSONResponse:
    """413 for an oversized body: RESOURCE_EXHAUSTED as gRPC reports an oversized message, but an
    invalid request to OpenAI clients rather than a rate limit."""
    body = envelope(message, "RESOURCE_EXHAUSTED")
    body["error"]["type"] = "invalid_request_error"  # type: ignore[index]
    return JSONResponse(body, status_code=413)


def error_status(error: Exception) -> tuple[int, dict[str, object]]:
    """HTTP status and envelope for any exception; a non-Kiln exception is a bug, answered without
    its details (whoever catches it makes sure it is logged)."""
    if isinstance(error, ModelNotFoundError):
        body = envelope(str(error), "model_not_found", error.param)
        body["error"]["type"] = "invalid_request_error"  # type: ignore[index]
        return 404, body
    if isinstance(error, KilnError) and error.code in STATUS_BY_CODE:
        return STATUS_BY_CODE[error.code], envelope(str(error), error.code, getattr(error, "param", None))
    return 500, envelope("internal server error (logged by the server)", INTERNAL)


def error_response(error: Exception) -> JSONResponse:
    """The envelope response, with `Retry-After` for an error that knows when a retry can succeed."""
    status, body = error_status(error)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    if (seconds := retry_after(error)) is not None:
        headers["Retry-After"] = seconds
    return JSONResponse(body, status_code=status, headers=headers or None)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(HTTPException, _http_exception)
    app.add_exception_handler(KilnError, _kiln_error)
    app.add_exception_handler(Exception, _bug)


async def _kiln_error(_: Request, error: Exception) -> JSONResponse:
    """Answered here and not re-raised, so one without an HTTP meaning is logged here."""
    response = error_response(error)
    if response.status_code == 500:
        logger.error("Kiln error without an HTTP status while serving a request", exc_info=error)
    return response


async def _bug(_: Request, error: Exception) -> JSONResponse:
    """Starlette sends this answer, then re-raises the error to the server, which logs its traceback
    and closes the connection: the answer says so, so clients do not reuse it."""
    response = error_response(error)
    response.headers["Connection"] = "close"
    return response


async def _http_exception(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route 404, wrong method 405) and an oversized body (413)."""
    if error.status_code == 413:
        return too_large_response(str(error.detail))
    if error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "")
        message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
    elif error.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    else:
        message = str(error.detail)
    return JSONResponse(envelope(message, code_name(error.status_code)), status_code=error.status_code,
                        headers=error.headers)


async def _invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
    problems = [_problem(item) for item in error.errors()]
    param = problems[0][0] if problems else None
    message = "; ".join(text for _, text in problems[:MAX_REPORTED_PROBLEMS])
    if len(problems) > MAX_REPORTED_PROBLEMS:
        message += f" (and {len(problems) - MAX_REPORTED_PROBLEMS} more)"
    return JSONResponse(envelope(message or "invalid request", "INVALID_ARGUMENT", param), status_code=400)


def _problem(item: dict) -> tuple[str | None, str]:
    """(param, message) of one pydantic error, with the field path as the OpenAI `param`."""
    path = [str(part) for part in item.get("loc", ()) if part != "body"]
    param = ".".join(path) or None
    if item.get("type") == "extra_forbidden":
        return param, f"unknown field {param!r}"
    if item.get("type") == "missing" and param is None:
        return None, "the request body is missing: send a JSON object"
    if item.get("type") == "json_invalid":
        return None, f"malformed JSON: {item.get('ctx', {}).get('error', item.get('msg'))}"
    if item.get("type") == "model_attributes_type" and param is None:
        return None, "the request body must be a JSON object, sent as Content-Type: application/json"
    message = str(item.get("msg", "invalid value")).removeprefix("Value error, ")
    return param, f"{param}: {message}" if param else message
