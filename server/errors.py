"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
from fastapi.responses import JSONResponse
from pydantic import ValidationError

# status -> (OpenAI error type, code)
_KINDS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", None),
    503: ("service_unavailable", "service_unavailable"),
}


class APIError(Exception):
    """Raised anywhere in a handler; rendered by the app's exception handler."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    etype, default_code = _KINDS.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
    return {"error": {"message": message, "type": etype, "param": param, "code": code or default_code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def api_error_response(e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.param, e.code, e.headers)


def from_validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field."""
    errs = e.errors(include_url=False)
    if not errs:
        return APIError(400, str(e))
    def loc(err):
        return ".".join(str(x) for x in err.get("loc", ()) if not _is_union_tag(x)) or None

    def msg(err):
        m = err.get("msg", "invalid value")
        return m[len("Value error, "):] if m.startswith("Value error, ") else m

    param = loc(errs[0])
    same = [e for e in errs if (loc(e) or "").split(".")[0] == (param or "").split(".")[0]]
    if len(same) > 1 and any(_is_union_tag(x) for x in errs[0].get("loc", ())):
        # A union (e.g. prompt: str | list[str] | list[int] | list[list[int]]) that no form matched.
        param = (param or "").split(".")[0] or None
        msgs = list(dict.fromkeys(msg(e) for e in same))
        message = f"{param}: no accepted form matches ({'; '.join(msgs[:4])})"
    else:
        message = f"{param}: {msg(errs[0])}" if param else msg(errs[0])
    rest = len(errs) - (len(same) if message.startswith(f"{param}: no accepted") else 1)
    if rest > 0:
        message += f" (and {rest} more error{'s' if rest > 1 else ''})"
    return APIError(400, message, param=param)


def _is_union_tag(x) -> bool:
    # pydantic puts the tried union member in the location ("str", "list[int]", "TextPart", ...)
    return isinstance(x, str) and (x[:1].isupper() or "[" in x or x in ("str", "int", "float", "bool"))
