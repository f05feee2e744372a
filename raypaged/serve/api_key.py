"""The API key: from the arguments (flag, Serve args), else $RAYPAGED_API_KEY, else None (no
auth: the caller's choice). A key that is set but empty or blank, in either place, is an error,
never "no key": an empty Secret or a mistyped `export` must not open the API.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "RAYPAGED_API_KEY"


def check_api_key(key: str | None, source: str) -> None:
    """Refuse a key that is set but blank, naming where it came from and the fix."""
    if key is not None and not key.strip():
        raise ValueError(
            f"{source} is set but empty, which would serve without authentication: give a "
            f"non-empty key, or unset {source} to serve without one (only where no one else "
            "can reach the port)")


def resolve_api_key(configured: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    source, key = ("api_key", configured) if configured is not None else (ENV, environ.get(ENV))
    check_api_key(key, source)
    return key
