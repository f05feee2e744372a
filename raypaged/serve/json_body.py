"""Request bodies: JSON only, finite numbers, bounded nesting, strings that encode.

Everything refused here gets a 4xx naming the problem; nothing that passes can make the
tokenizer, pydantic or the error handler itself fail later (a lone surrogate such as "\\ud800"
cannot be encoded, and a 100,000-deep array overflows the recursion of whoever walks it).
"""
from __future__ import annotations

import json
import math

from raypaged.serve.errors import APIError, bad_request

# Deeper than any OpenAI request needs (chat content parts are ~5 levels; tool schemas ~20).
MAX_JSON_DEPTH = 64
JSON_TYPES = ("application/json", "application/*+json")


def check_content_type(content_type: str | None) -> None:
    """No header is read as JSON (as curl --json and most clients send it); anything else
    that is not JSON is refused rather than guessed at."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(415, f"Content-Type {media or '(empty)'!r} is not supported: send the body as "
                        "JSON with 'Content-Type: application/json'", code="unsupported_media_type")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json_body(body: bytes) -> object:
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except RecursionError:
        raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        detail = str(exc) if "JSON number" in str(exc) else "it does not parse"
        raise bad_request(f"the request body is not valid JSON: {detail}") from None
    _check(value)
    return value


def _check(value: object) -> None:
    """Walk iteratively (no recursion to overflow): depth, finite numbers, and every string
    and key encodable."""
    stack = [(value, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, float) and not math.isfinite(item):  # 1e400 parses as inf
            raise bad_request(f"{path or 'the request body'}: {item} is out of range: numbers "
                              "must be finite", param=path or None)
        elif isinstance(item, dict):
            for key, child in item.items():
                _check_text(key, path)
                stack.append((child, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, f"{path}.{i}", depth + 1) for i, child in enumerate(item))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = path or "the request body"
        raise bad_request(f"{where}: contains an unpaired surrogate ({text[exc.start]!r} at "
                          f"{exc.start}), which is not valid Unicode text: send UTF-8 text",
                          param=path or None) from None
