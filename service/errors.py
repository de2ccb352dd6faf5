"""Every error leaves as `{"error": {"message", "type", "param", "code"}}`, OpenAI style.

Pydantic's 422 becomes a 400 naming the offending field (`param`), as the
OpenAI API does; so do malformed JSON and undecodable bodies. An unknown field reads as
OpenAI words it: "Unrecognized request argument supplied: foo".
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.validation import InvalidRequest

logger = logging.getLogger("kvsentry.http")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


def from_value_error(exc: ValueError, default_param: str | None = None) -> APIError:
    """engine ValueErrors read "field: why"; the field becomes `param`."""
    if isinstance(exc, InvalidRequest):
        return bad_request(str(exc), exc.field, exc.code)
    text = str(exc)
    field, sep, _ = text.partition(":")
    param = field.strip() if sep and field.strip().isidentifier() else default_param
    return bad_request(text, param)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _is_union_tag(part: object) -> bool:
    # pydantic names the member of a union that failed: "str", "list[int]", "ContentPart", ...
    return isinstance(part, str) and ("[" in part or part[:1].isupper()
                                      or part in ("str", "int", "float", "bool", "none"))


def validation_param(loc: tuple) -> tuple[str | None, list[str]]:
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    path: list[str] = []
    tags: list[str] = []
    for part in parts:
        if _is_union_tag(part):
            tags.append(str(part))
            break
        path.append(str(part))
    return (".".join(path) or None), tags


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request body", None, "invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(400, f"request body is not valid JSON: {detail}".rstrip(": "), None, "invalid_json")
    unknown = [_full_path(tuple(e.get("loc", ()))) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        return _unrecognized(unknown)
    param, _ = validation_param(tuple(first.get("loc", ())))
    if param is None and first.get("type") == "missing":
        return error_response(400, "request body is required (a JSON object)", None, "missing_body")
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return error_response(400, "request body must be a JSON object", None, "invalid_request")
    same_field = [e for e in errors if validation_param(tuple(e.get("loc", ())))[0] == param]
    tags = [t for e in same_field for t in validation_param(tuple(e.get("loc", ())))[1]]
    if len(same_field) > 1 and tags:
        message = f"{param}: invalid value; expected one of: {', '.join(dict.fromkeys(tags))}"
    else:
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid value")
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_type"
    if first.get("type", "").startswith(("greater", "less", "too_", "finite")):
        code = "invalid_value"
    return error_response(400, message, param, code)


def _full_path(loc: tuple) -> str | None:
    """The field's whole path, the union members pydantic names on the way left out."""
    parts = loc[1:] if loc and loc[0] == "body" else loc
    return ".".join(str(part) for part in parts if not _is_union_tag(part)) or None


def _unrecognized(fields: list[str | None]) -> JSONResponse:
    names = list(dict.fromkeys(name for name in fields if name)) or ['""']  # {"": 1}: a key with no name
    plural = "s" if len(names) > 1 else ""
    return error_response(400, f"Unrecognized request argument{plural} supplied: {', '.join(names)}", names[0],
                          "unknown_parameter")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404 and detail == "Not Found":
            detail = f"no route for {request.method} {request.url.path}"
        return error_response(exc.status_code, detail, None, None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")
