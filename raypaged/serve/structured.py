"""The router's checks of a constraint, before anything is queued: its size (a setting), then
the grammar built from it (model/grammar.py `build_grammar`, no tokenizer needed) in a thread,
so a bad schema, regex or EBNF is a 400 that names the problem rather than a failed request
later."""
from __future__ import annotations

import asyncio

from raypaged.core.structured_outputs import StructuredOutputsParams
from raypaged.model.grammar import build_grammar
from raypaged.serve.errors import bad_request
from raypaged.settings import flag


async def check_constraint(spec: StructuredOutputsParams | None, limits
                           ) -> StructuredOutputsParams | None:
    if spec is None:
        return None
    if spec.size > limits.max_structured_output_chars:
        raise bad_request(
            f"the structured_outputs {spec.kind} is {spec.size} characters, more than the "
            f"{limits.max_structured_output_chars} this server accepts (the limit is the setting "
            f"max_structured_output_chars, {flag('max_structured_output_chars')})",
            "structured_outputs")
    try:
        await asyncio.to_thread(build_grammar, spec)
    except ValueError as exc:
        raise bad_request(str(exc), "structured_outputs") from None
    return spec
