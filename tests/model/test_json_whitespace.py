"""JSON constraints bound the whitespace between tokens (a sampled small model otherwise loops on
newlines until max_tokens), without refusing ordinary pretty-printed JSON."""
import json

from xgrammar.testing import _is_grammar_accept_string

from raypaged.core.structured_outputs import StructuredOutputsParams
from raypaged.model.grammar import MAX_JSON_WHITESPACE, build_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "object", "properties": {
    "b": {"type": "array", "items": {"type": "integer"}}}, "required": ["b"]}},
    "required": ["a"]}


def test_pretty_json_is_accepted_and_a_run_past_the_bound_is_not():
    g = build_grammar(StructuredOutputsParams(json=SCHEMA))
    value = {"a": {"b": [1, 2]}}
    assert _is_grammar_accept_string(g, json.dumps(value, indent=2))
    assert _is_grammar_accept_string(g, json.dumps(value, indent=4))
    gap = "\n" * MAX_JSON_WHITESPACE
    assert _is_grammar_accept_string(g, '{' + gap + '"a": {"b": []}}')
    assert not _is_grammar_accept_string(g, '{' + gap + '\n"a": {"b": []}}')
    assert MAX_JSON_WHITESPACE == 20
