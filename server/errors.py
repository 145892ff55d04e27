"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
from fastapi.responses import JSONResponse
from pydantic import ValidationError

# status -> (OpenAI error type, code)
_KINDS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", None),        # "model_not_found" when param is "model" (below)
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
    if status == 404 and param == "model":
        default_code = "model_not_found"         # not for an unknown route: OpenAI's code is null there
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

    def union_at(err):
        # The location up to the first union member tag, or None when not in a union.
        where = err.get("loc", ())
        for i, x in enumerate(where):
            if _is_union_tag(x):
                return tuple(where[:i])
        return None

    def msg(err):
        m = err.get("msg", "invalid value")
        return m[len("Value error, "):] if m.startswith("Value error, ") else m

    union = union_at(errs[0])
    same = [x for x in errs if union is not None and union_at(x) == union]
    if len(same) > 1:
        # A union (e.g. prompt: str | list[str] | list[int] | list[list[int]]) that no form matched:
        # name the field that holds it (messages.0.content, not just messages).
        param = ".".join(str(x) for x in union) or None
        msgs = list(dict.fromkeys(msg(x) for x in same))
        message = f"{param + ': ' if param else ''}no accepted form matches ({'; '.join(msgs[:4])})"
        rest = len(errs) - len(same)
    else:
        param = loc(errs[0])
        message = f"{param}: {msg(errs[0])}" if param else msg(errs[0])
        rest = len(errs) - 1
    if rest > 0:
        message += f" (and {rest} more error{'s' if rest > 1 else ''})"
    return APIError(400, message, param=param)


def _is_union_tag(x) -> bool:
    # pydantic puts the tried union member in the location ("str", "list[int]", "TextPart", ...)
    return isinstance(x, str) and (x[:1].isupper() or "[" in x or x in ("str", "int", "float", "bool"))
