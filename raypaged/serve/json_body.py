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
    and key encodable. The stack holds one iterator per open container (never more than
    MAX_JSON_DEPTH), so the walk allocates nothing per element: a body of millions of elements
    costs its parsed value and no more. A path is spelled out only for the element refused."""
    if not isinstance(value, (dict, list)):
        _check_leaf(value, [], None)
        return
    if _plain_list(value):
        return
    stack = [_children(value, [])]
    path: list = []  # path[i]: the key, in the container stack[i] walks, of stack[i + 1]'s
    while stack:
        for key, child in stack[-1]:
            if isinstance(child, (dict, list)):
                if not child:  # nothing inside to check
                    continue
                if len(stack) >= MAX_JSON_DEPTH:
                    raise bad_request(f"the request body nests deeper than {MAX_JSON_DEPTH} "
                                      "levels")
                if _plain_list(child):  # every element passes
                    continue
                path.append(key)
                stack.append(_children(child, path))
                break
            if child is not None and type(child) is not int and type(child) is not bool:
                _check_leaf(child, path, key)
        else:  # this container is done
            stack.pop()
            if path:
                path.pop()


NO_CHECK = frozenset({int, bool, type(None)})
NUMBERS = frozenset({int, float, bool})


def _plain_list(value) -> bool:
    """A list of scalars that all pass, found by C loops (map) instead of the walk's Python
    loop per element (docs/limits.md). False: walk it (and name the element that fails)."""
    if not isinstance(value, list):
        return False
    kinds = set(map(type, value))
    if kinds <= NO_CHECK:
        return True
    if kinds <= NUMBERS:
        try:
            return all(map(math.isfinite, value))
        except OverflowError:  # an int past float's range: fine, but walk it
            return False
    return kinds == {str} and all(map(str.isascii, value))


def _children(container, path: list):
    """(key or index, child) of a dict or list; a dict's keys are checked as they come."""
    if isinstance(container, dict):
        for key, child in container.items():
            _check_text(key, path, None)
            yield key, child
    else:
        yield from enumerate(container)


def _check_leaf(item: object, path: list, key) -> None:
    if isinstance(item, str):
        _check_text(item, path, key)
    elif isinstance(item, float) and not math.isfinite(item):  # 1e400 parses as inf
        raise _refused(path, key, f"{item} is out of range: numbers must be finite")


def _check_text(text: str, path: list, key) -> None:
    if text.isascii():  # O(1) in CPython: the string's kind says so
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _refused(path, key, f"contains an unpaired surrogate ({text[exc.start]!r} at "
                                  f"{exc.start}), which is not valid Unicode text: send UTF-8 "
                                  "text") from None


def _refused(path: list, key, problem: str) -> APIError:
    """A 400 naming the element by its JSON path, as 'messages.0.content'."""
    where = ".".join(str(k) for k in (*path, *(() if key is None else (key,))))
    return bad_request(f"{where or 'the request body'}: {problem}", param=where or None)
