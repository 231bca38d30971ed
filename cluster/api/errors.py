"""OpenAI-shaped errors: the exception the ingress raises and the handlers that render it.

Every error body is built here from a typed error: an ``APIError`` (status, type, code,
param, a message written for the client). An exception from a replica is mapped by its type
(``engine_error``): the engine's ``InvalidRequestError`` by its own fields, a replica that
died or is gone as a 503. Nothing else is ever rendered from an exception's text: anything
unexpected is a 500 with a generic message and a request id, and the server logs that id
with the full traceback.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from replica.errors import InvalidRequestError, RequestFailedError


class APIError(Exception):
    """An error for the client, rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


log = logging.getLogger("ray.serve")


def internal_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """A 500 for the client (an id, no detail), the traceback in the server's log."""
    request_id = request_id or uuid.uuid4().hex
    log.error("internal error in request %s", request_id, exc_info=exc)
    return APIError(
        500,
        f"The server had an internal error; it logged it as request {request_id}",
        "server_error",
        code="internal_error",
    )


async def _api_error_response(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


# pydantic's names for the branches of a union ("str", "list[constrained-int]"): not fields
_BRANCH = re.compile(r"[\[\-]|^(str|int|float|bool|list|dict)$")


def _most_specific(errors: Sequence[Any]) -> dict[str, Any]:
    """Of a union's per-branch errors, the first that is not merely "wrong type" (a list
    too long says more than "not a string")."""
    specific = [e for e in errors if not str(e.get("type", "")).endswith(("_type", "_required"))]
    return (specific or list(errors) or [{}])[0]


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    first = _most_specific(exc.errors())
    loc = [
        str(p)
        for p in first.get("loc", ())
        if p != "body" and not (isinstance(p, str) and _BRANCH.search(p))
    ]
    message = str(first.get("msg", "invalid request"))
    if first.get("type") == "value_error" and not loc:
        # a rule across fields, whose message starts with the field it names
        message = message.removeprefix("Value error, ")
        return APIError(
            400, message, code="invalid_value", param=message.partition(":")[0]
        ).response()
    message = f"{'.'.join(loc) or 'body'}: {message}"
    code = "json_invalid" if first.get("type") == "json_invalid" else "invalid_value"
    return APIError(400, message, code=code, param=".".join(loc) or None).response()


async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (404 for an unknown path, 405 with its ``Allow`` header for a
    wrong method) in OpenAI form, their headers kept."""
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type_, headers=exc.headers).response()


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    return internal_error(exc, request.headers.get("x-request-id")).response()


def overloaded() -> APIError:
    return APIError(
        503,
        "The server is overloaded; retry later",
        "overloaded_error",
        code="overloaded",
        headers={"retry-after": "1"},
    )


def replica_failed(message: str = "No engine replica could serve the request") -> APIError:
    return APIError(503, f"{message}; retry", "server_error", code="replica_failed")


def engine_error(exc: BaseException, request_id: str) -> APIError | None:
    """The API error for a request's failure in the engines, by type: what the replica
    raised (Ray wraps it, with the replica's traceback in its text, which is never shown),
    or Ray's own failure (a replica gone). None for a cancellation, which is no error."""
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
    if isinstance(cause, InvalidRequestError):
        return APIError(400, cause.message, code=cause.code, param=cause.param)
    if isinstance(cause, RequestFailedError):  # this request alone: logged, never resent
        return internal_error(cause, request_id)
    if isinstance(cause, ray.exceptions.RayError):
        return replica_failed()
    if isinstance(cause, Exception):
        return internal_error(cause, request_id)
    return None


def install_handlers(app: FastAPI) -> None:
    """Every error the app can raise leaves as an OpenAI error body, never a stack trace."""
    app.add_exception_handler(APIError, _api_error_response)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
