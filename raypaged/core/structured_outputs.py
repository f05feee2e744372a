"""What a constrained request asks for, as plain data (vLLM's `StructuredOutputsParams`).

Core only carries the constraint: it travels inside SamplingParams to whichever worker runs the
request (a continuation after a failover included), where model/grammar.py compiles it and keeps
one matcher per sample. Exactly one kind is set; `key` names the grammar for the compile cache.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None          # a JSON schema (stored as its canonical JSON text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None   # the output is exactly one of these strings
    grammar: str | None = None              # EBNF (GBNF), xgrammar's dialect
    json_object: bool | None = None         # any JSON object
    disable_any_whitespace: bool = False    # JSON without free whitespace between tokens

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):  # as text (key order kept: it is the order of the output)
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None and not isinstance(self.choice, tuple):
            if not isinstance(self.choice, list):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, str):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                             "strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What the compiled grammar depends on: equal keys share one compile per worker."""
        return (self.kind, getattr(self, self.kind), self.disable_any_whitespace)

    @property
    def size(self) -> int:
        """Characters of the constraint's text: what the size limit bounds."""
        value = getattr(self, self.kind)
        if isinstance(value, tuple):
            return sum(len(c) for c in value)
        return len(value) if isinstance(value, str) else 0
