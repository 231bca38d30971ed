"""OpenAI-shaped errors: the exception the ingress raises and the handlers that render it."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from replica.messages import InvalidRequestError


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

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


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


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    return APIError(500, "internal error", "server_error").response()


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


def engine_error(exc: BaseException) -> APIError | None:
    """The API error for what can go wrong before a request's first token, if any."""
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc))
    if isinstance(exc, ray.exceptions.RayError):
        return replica_failed()
    return None


def install_handlers(app: FastAPI) -> None:
    """Every error the app can raise leaves as an OpenAI error body, never a stack trace."""
    app.add_exception_handler(APIError, _api_error_response)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
