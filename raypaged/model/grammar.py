"""Constraints -> xgrammar grammars: checked at the edge, compiled once per worker, off the step.

xgrammar was chosen by measurement (docs/structured_outputs.md): on SmolLM2's 49,152-token
vocabulary a nested JSON schema compiled in 3 ms and cost 126 us per token (mask + apply +
accept) on one CPU core; llguidance 1.9.1 compiled as fast but cost 38 ms per token for the same
schema and tokens (first visits of each state only). xgrammar is also what vLLM's CPU server
uses (same grammar dialect, same masks).

    check(spec)            no tokenizer needed: the router refuses a bad schema/regex/EBNF (400)
    GrammarCache.prepare   at admission: start compiling on the cache's own thread (once per key)
    GrammarCache.get       at the request's first sampled token: the compiled grammar (waits)
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from raypaged.core.structured_outputs import StructuredOutputsParams


def build_grammar(spec: StructuredOutputsParams):
    """The spec as an xgrammar Grammar (no tokenizer involved); ValueError names what is wrong."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec.json,
                                                any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":  # EBNF string literals take JSON's escapes
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alts}")
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_reason(exc)}") from None


def check(spec: StructuredOutputsParams) -> None:
    if spec.kind == "json":
        try:
            schema = json.loads(spec.json)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
    build_grammar(spec)


def _reason(exc: Exception) -> str:
    # xgrammar prefixes "[time] /project/cpp/file.cc:83: "; the rest is the useful part
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if text[:1] == "/" or ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return text


class GrammarCache:
    """Compiled grammars by spec key, at most `max_entries` (least recently used leave first).

    Compiling runs on one thread of its own, so a large schema delays only the request that
    brought it (which waits at its first sampled token) and not the steps of everyone else;
    the tokenizer's vocabulary table is built on that thread too, with the first compile.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_entries: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size        # the logits' width (may exceed the tokenizer's)
        self.stop_token_ids = list(stop_token_ids)
        self.max_entries = max_entries
        self._compiler = None
        self._entries: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()       # prepare (step thread) vs whoever else asks
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self.num_compiles = 0

    def prepare(self, spec: StructuredOutputsParams) -> Future:
        with self._lock:
            future = self._entries.get(spec.key)
            if future is None:
                future = self._pool.submit(self._compile, spec)
                self._entries[spec.key] = future
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(spec.key)
            return future

    def get(self, spec: StructuredOutputsParams):
        return self.prepare(spec).result()

    def _compile(self, spec: StructuredOutputsParams):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.num_compiles += 1
        return self._compiler.compile_grammar(build_grammar(spec))
