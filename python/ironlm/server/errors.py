"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` for every failure."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ironlm.exceptions import InvalidArgumentError

logger = logging.getLogger("ironlm.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | int | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers  # e.g. Retry-After on a 503
        self.code = code if code is not None else status
        self.type = type or _TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, *, param: str | None = None, code: str | int | None = None,
               type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def error_response(status: int, message: str, headers: dict[str, str] | None = None, **kw: object) -> JSONResponse:
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(status, message, **kw), status_code=status, headers=headers)  # type: ignore[arg-type]


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """First pydantic error -> 400 with `param` = the offending field's dotted path.

    A model-level validator has no field location: its `InvalidArgumentError` (kept by pydantic as the error's
    ctx["error"]) names the parameter instead.
    """
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    loc = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
    ctx = err.get("ctx") or {}
    if err.get("type") == "json_invalid":
        return APIError(400, f"Malformed JSON body: {ctx.get('error', err.get('msg'))}")
    cause = ctx.get("error")
    # str(cause), not err["msg"]: pydantic prefixes a validator's message with "Value error, ".
    msg = str(cause) if isinstance(cause, Exception) else str(err.get("msg", "invalid value"))
    param = cause.param if isinstance(cause, InvalidArgumentError) else None
    if loc:
        msg, param = f"{loc}: {msg}", loc
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return APIError(400, msg + more, param=param)


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.headers, param=exc.param, code=exc.code, type=exc.type)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        return error_response(400, err.message, param=err.param)

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        err = validation_error(exc)
        return error_response(400, err.message, param=err.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> JSONResponse:
        # The client left while its body was read: its doing, not a fault to log. Nobody reads this answer;
        # its 499 tells the circuit breaker not to count the request (server/breaker.py).
        return error_response(499, "client disconnected", code="client_disconnected")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        # A real fault: log it with the traceback, answer 500, keep serving.
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}")
