"""Constraints -> xgrammar grammars: checked at the edge, compiled once per worker, off the step.

xgrammar was chosen by measurement (docs/structured_outputs.md: far cheaper per token than
llguidance) and is what vLLM's CPU server uses (same grammar dialect, same masks).

    build_grammar(spec)    at the edge, no tokenizer needed: a bad schema/regex/EBNF is a 400
                           before anything is queued (the router; the offline LLM in-process)
    GrammarCache.prepare   at the worker's admission: build + compile on the cache's own thread,
                           once per key; the request is held out of the scheduler meanwhile
    GrammarCache.get       at each matcher's creation: the compiled grammar (already done)
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from raypaged.core.structured_outputs import StructuredOutputsParams


# The most whitespace a JSON constraint allows between two tokens of the JSON (xgrammar's
# max_whitespace_cnt). Unbounded, a small model sampled at temperature 0.7 falls into "\n" after
# "\n" inside an object until max_tokens cuts it (benchmarks/structured_validity.py); a bound
# forces the next token to be JSON, so it changes only the layout, never validity. 20 fits
# pretty-printing 9 levels deep at indent 2.
MAX_JSON_WHITESPACE = 20


def build_grammar(spec: StructuredOutputsParams):
    """The spec as an xgrammar Grammar (no tokenizer involved); ValueError names what is wrong.
    The edge's check: an in-process caller hands the result on to GrammarCache.prepare, so it is
    not built again."""
    import xgrammar as xgr

    kind = spec.kind
    if kind == "json":
        try:
            schema = json.loads(spec.json)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec.json,
                                                any_whitespace=not spec.disable_any_whitespace,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":  # EBNF string literals take JSON's escapes
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
            return xgr.Grammar.from_ebnf(f"root ::= {alts}")
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _cannot_compile(kind, exc) from None


def _cannot_compile(kind: str, exc: Exception) -> ValueError:
    # xgrammar prefixes "[time] /project/cpp/file.cc:83: "; the rest is the useful part
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if text[:1] == "/" or ".cc:" in text.split(" ", 1)[0]:
            text = text.split(": ", 1)[-1]
    return ValueError(f"structured_outputs.{kind} cannot be compiled: {text}")


class Compile:
    """One grammar's compile: a future for the compiled grammar, and when its compile began
    (None while it waits behind others on the cache's thread: waiting does not count against
    the time limit)."""

    def __init__(self) -> None:
        self.future: Future = Future()
        self.started: float | None = None

    def overdue(self, now: float, limit_s: float) -> bool:
        return not self.future.done() and self.started is not None and now - self.started > limit_s


class GrammarCache:
    """Compiled grammars by spec key, at most `max_entries` (least recently used leave first).

    Compiling (building the grammar from the spec included) runs on one thread of its own:
    xgrammar releases the GIL while it works, so the step thread goes on decoding everyone else
    while a request whose grammar is not ready waits out of the scheduler (engine.py). The
    tokenizer's vocabulary table is built on that thread too, before the first compile.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_entries: int = 256, max_compile_s: float = 10.0) -> None:
        self.tokenizer = tokenizer
        self.max_compile_s = max_compile_s  # EngineArgs.max_structured_output_compile_s
        self.vocab_size = vocab_size        # the logits' width (may exceed the tokenizer's)
        self.stop_token_ids = list(stop_token_ids)
        self.max_entries = max_entries
        self._compiler = None
        self._entries: OrderedDict[tuple, Compile] = OrderedDict()
        self._lock = threading.Lock()       # the step thread vs an edge checking in-process
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")

    def prepare(self, spec: StructuredOutputsParams, grammar=None) -> Compile:
        """The compile of `spec`'s grammar, started now unless it already was (once per key).
        `grammar`: the xgrammar Grammar an in-process edge already built while checking it."""
        with self._lock:
            entry = self._entries.get(spec.key)
            if entry is None:
                entry = self._entries[spec.key] = Compile()
                self._pool.submit(self._run, entry, spec, grammar)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(spec.key)
            return entry

    def check(self, spec: StructuredOutputsParams) -> None:
        """The edge's check for a caller in this process (the offline LLM): a grammar not
        cached yet is built here (ValueError if bad) and compiled from that build."""
        with self._lock:
            known = spec.key in self._entries
        if not known:
            self.prepare(spec, build_grammar(spec))

    def get(self, spec: StructuredOutputsParams):
        """The compiled grammar (the engine asks only once its compile is done)."""
        return self.prepare(spec).future.result()

    def give_up(self, spec: StructuredOutputsParams, why: str) -> None:
        """The compile ran past the limit: later requests with the same spec fail at once with
        `why` (the thread cannot be interrupted; its result, when it comes, is dropped)."""
        failed = Compile()
        failed.future.set_exception(ValueError(why))
        with self._lock:
            self._entries[spec.key] = failed

    def _run(self, entry: Compile, spec: StructuredOutputsParams, grammar) -> None:
        try:
            compiler = self._compiler_once()
            entry.started = time.monotonic()
            try:  # build_grammar raises ValueError only
                compiled = compiler.compile_grammar(grammar or build_grammar(spec))
            except RuntimeError as exc:
                raise _cannot_compile(spec.kind, exc) from None
            entry.future.set_result(compiled)
        except BaseException as exc:  # noqa: BLE001 - the request waiting for it reports it
            entry.future.set_exception(exc)

    def _compiler_once(self):
        import xgrammar as xgr

        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler
