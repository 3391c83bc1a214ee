"""The OpenAPI document: request bodies, error responses and content types of every route.

The POST handlers read the raw body themselves (serving_common.parse_body), so that a bad body is an
OpenAI-shaped 400 naming the field rather than FastAPI's 422; FastAPI therefore cannot see their request models.
`body_docs` declares them through `openapi_extra` and `install_openapi` adds their JSON schemas to the
document's components, so /docs and generated clients know every field and its bounds.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from ironlm.server.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"
_ERRORS = {
    400: "invalid request: the body's `error.param` names the field",
    401: "missing or wrong API key",
    404: "unknown model or route",
    413: "request body over --max-request-bytes",
    415: "Content-Type is not application/json",
    500: "the engine failed the request",
    503: "overloaded, queue full, circuit breaker open, timed out or shutting down (see Retry-After)",
}
_GET_ERRORS = (401, 404, 500)
_POST_ERRORS = (400, 401, 404, 413, 415, 500, 503)


def error_responses(statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}


def body_docs(request: type[BaseModel], response: type[BaseModel] | None = None,
              streams: bool = False) -> dict[str, Any]:
    """Decorator kwargs of a POST route whose handler parses `request` itself."""
    ok: dict[str, Any] = {"description": "success"}
    if response is not None:
        ok["model"] = response
    if streams:
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"},
                                               "description": "with `stream: true`: server-sent events"}}
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": _REF.format(model=request.__name__)}}}}},
        "responses": {200: ok, **error_responses(_POST_ERRORS)},
    }


def get_docs() -> dict[str, Any]:
    return {"responses": error_responses(_GET_ERRORS)}


METRICS_DOCS: dict[str, Any] = {"responses": {200: {"description": "Prometheus text exposition format",
                                                    "content": {"text/plain": {"schema": {"type": "string"}}}}}}


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]]) -> None:
    """Build the document once, with the request models' schemas (and their nested ones) in components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in request_models:
                schema = model.model_json_schema(ref_template=_REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
