"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with a real status."""
from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error",
         500: "internal_server_error", 503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after
        self.headers = headers or {}  # e.g. the worker that refused the request

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code or self.status}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")


def too_long(max_model_len: int, prompt: str, param: str = "prompt") -> APIError:
    """A prompt that cannot fit in max_model_len tokens; `prompt`: what it is, in words."""
    return bad_request(f"This model's maximum context length is {max_model_len} tokens, but "
                       f"{prompt}: shorten it to at most {max_model_len - 1} tokens", param)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, named by its JSON path.

    A field of several shapes (`prompt`, `stop`, `content`) fails once per shape, each with the
    shape's name in its `loc` (`str`, `list[TextPart]`): the client wrote no such names, so
    they leave the path, and of that field's failures the ones that got deepest into the body
    say what is wrong (an image part: its `type`, not "content should be a string"); failures
    at the same place are joined (`prompt: [1.5]`: a string, or an integer, or a list)."""
    errors = [(_json_path(e.get("loc", ())), e.get("msg", "invalid request"))
              for e in exc.errors(include_url=False)]
    field = errors[0][0][:1]
    errors = [e for e in errors if e[0][:1] == field]
    path = max(errors, key=lambda e: len(e[0]))[0]
    first, *more = dict.fromkeys(msg for p, msg in errors if p == path)
    message = ", or ".join([first, *(m.removeprefix("Input should be ") for m in more)])
    path = ".".join(map(str, path))
    return bad_request(f"{path}: {message}" if path else message, param=path or None)


def _json_path(loc: tuple) -> tuple:
    """pydantic's `loc` without the names it gives a union's shapes (`str`, `list[int]`)."""
    return tuple(p for p in loc if not (isinstance(p, str) and (p in _SHAPES or "[" in p)))


_SHAPES = {"str", "int", "float", "bool", "dict", "list", "none"}


def from_value_error(exc: ValueError) -> APIError:
    """SamplingParams and the engine say `<name> must be ...`: the first word is the param."""
    message = str(exc)
    first = message.split(" ", 1)[0]
    return bad_request(message, param=first if first.isidentifier() else None)
