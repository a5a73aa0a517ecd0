"""Errors in OpenAI's JSON shape, and the handlers that turn every failure into one.

Every error the server sends looks like OpenAI's:
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}` with the
matching HTTP status. User input never yields a 500 and no response carries a traceback: the
catch-all handler logs the traceback on the server and answers a plain "internal error".
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sits.runtime.engine.errors import EngineDiedError, EngineError, InvalidRequestError, PromptTooLongError
from sits.runtime.engine.request import SamplingParamsError
from sits.runtime.models.chat_template import ChatTemplateError

logger = logging.getLogger("sits.server")

FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"

# OpenAI's error `type` per HTTP status (the official client maps the status to its exception class).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error to send as OpenAI error JSON with the given HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 error_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def to_sse(self) -> str:
        """The error as one server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 for a parameter the client got wrong."""
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")


def service_unavailable(message: str) -> OpenAIError:
    return OpenAIError(503, message, code="service_unavailable", headers={"Retry-After": "5"})


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """`("body", "messages", 0, "role")` -> `"messages[0].role"`; None when the whole body is at fault."""
    # Union members add a tag such as "str" or "list[int]" to the location: not a parameter name.
    parts = [part for part in loc if part != "body" and not (isinstance(part, str) and _is_type_tag(part))]
    param = ""
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += ("." if param else "") + str(part)
    return param or None


def _is_type_tag(part: str) -> bool:
    return "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")


def validation_error(error: RequestValidationError, content_type: str = "application/json") -> OpenAIError:
    """FastAPI's 422 as OpenAI's 400, naming the first parameter at fault."""
    first = error.errors()[0] if error.errors() else {"type": "", "loc": (), "msg": "invalid request"}
    kind = first.get("type", "")
    if kind == "json_invalid":
        context = first.get("ctx")
        detail = context.get("error", "") if isinstance(context, dict) else ""
        return invalid_request(f"The request body is not valid JSON: {detail}".rstrip(": "), code="invalid_json")
    param = _param_from_loc(tuple(first.get("loc", ())))
    if param is None:  # the body itself is not an object (a field that is not one is named below)
        if "json" not in content_type:
            return invalid_request("The request body must be JSON, sent with Content-Type: application/json.",
                                   code="invalid_body")
        return invalid_request("The request body must be a JSON object.", code="invalid_body")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "missing":
        message = f"Missing required parameter: '{param}'."
        return invalid_request(message, param=param, code="missing_required_parameter")
    if kind == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param=param)
    return invalid_request(f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


def http_error(request: Request, error: StarletteHTTPException) -> OpenAIError:
    """Starlette's own errors (unknown route, wrong method, ...) in OpenAI's shape."""
    if error.status_code == 404:
        return OpenAIError(404, f"Unknown request URL: {request.method} {request.url.path}.",
                           code="unknown_url", error_type="invalid_request_error")
    if error.status_code == 405:
        return OpenAIError(405, f"Method {request.method} is not allowed for {request.url.path}.",
                           code="method_not_allowed", headers=dict(error.headers or {}))
    if error.status_code == 400 and error.detail == FASTAPI_BODY_PARSE_ERROR:
        # FastAPI's answer for bytes that are not UTF-8, or JSON its parser refuses (e.g. nested too deep)
        return invalid_request("The request body is not valid JSON in UTF-8 (or is nested too deeply).",
                               code="invalid_json")
    status = error.status_code if 400 <= error.status_code < 600 else 500
    return OpenAIError(status, str(error.detail), headers=dict(error.headers or {}) or None)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception the app can raise to an OpenAI-shaped JSON response."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return error.to_response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error, request.headers.get("content-type", "")).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return http_error(request, error).to_response()

    # Known failures get their status here, below Starlette's server-error layer (which would log a
    # traceback for every bad request); anything else is a bug: a logged 500 without details.
    async def _known(request: Request, error: Exception) -> JSONResponse:
        return as_openai_error(error).to_response()

    for known in (SamplingParamsError, InvalidRequestError, ChatTemplateError, EngineError):
        app.add_exception_handler(known, _known)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        return as_openai_error(error).to_response()


def as_openai_error(error: BaseException) -> OpenAIError:
    """Any exception from request handling as an OpenAIError (logging the unexpected ones)."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, SamplingParamsError):
        return invalid_request(str(error), param=error.param, code="invalid_value")
    if isinstance(error, PromptTooLongError):
        return invalid_request(str(error), param="prompt", code="context_length_exceeded")
    if isinstance(error, InvalidRequestError):
        return invalid_request(str(error), param="prompt")
    if isinstance(error, ChatTemplateError):
        return invalid_request(f"The messages cannot be rendered: {error}", param="messages")
    if isinstance(error, EngineDiedError):
        logger.error("engine died: %s", error)
        return OpenAIError(500, f"The engine failed while serving this request: {error}", code="engine_died")
    if isinstance(error, EngineError):
        logger.error("engine error: %s", error)
        return service_unavailable(f"The engine cannot serve requests right now: {error}")
    logger.exception("unexpected error while handling a request", exc_info=error)
    return OpenAIError(500, "The server had an internal error while processing the request.",
                       code="internal_error")
