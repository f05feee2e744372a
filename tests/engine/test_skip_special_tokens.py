"""skip_special_tokens (vLLM's SamplingParams field): special tokens are left out of the text
unless it is off, as the mistral tool-call parser needs, whose [TOOL_CALLS] is one; the token
that ended the sample (EOS, a stop_token_ids one) stays out either way unless
include_stop_str_in_output, as in vLLM."""
from __future__ import annotations

import pytest

from raypaged.core.contracts import RequestDelta
from raypaged.core.sampling_params import SamplingParams
from raypaged.output_processor import IncrementalDetokenizer, OutputProcessor

ANSWER = 'Let me check.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]'


@pytest.fixture(scope="module")
def tok(default_model_dir):
    """The default model's tokenizer with Mistral's [TOOL_CALLS] added as a special token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    return tok


def text_of(tok, ids: list[int], **params) -> tuple[str, list[str]]:
    """The sample's text, one token a step, the last one ending it (finish_reason "stop")."""
    out = OutputProcessor(tok)
    prompt, sp = tok.encode("Weather?"), SamplingParams(**params)
    out.add("r", prompt, sp, 0, IncrementalDetokenizer(tok, prompt, sp))
    pieces = []
    for i, t in enumerate(ids):
        [o], _ = out.process([RequestDelta("r", (t,), "stop" if i == len(ids) - 1 else None)])
        pieces.append(o.new_text)
    return "".join(pieces), pieces


def test_the_marker_is_one_special_token(tok):
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert marker in tok.all_special_ids and tok.encode("[TOOL_CALLS]") == [marker]


def test_off_keeps_the_marker_and_leaves_out_the_eos_that_ended_the_sample(tok):
    ids = tok.encode(ANSWER) + [tok.eos_token_id]
    assert text_of(tok, ids, skip_special_tokens=False)[0] == ANSWER
    # the default leaves it out, so the parser could not see where the calls begin
    assert text_of(tok, ids)[0] == ANSWER.replace("[TOOL_CALLS]", "")


@pytest.mark.parametrize("skip", [True, False])
def test_a_stop_token_is_left_out_unless_include_stop_str_in_output(tok, skip):
    ids = tok.encode(ANSWER.replace("[TOOL_CALLS]", ""))
    stop = ids[-1]  # a plain token (its text ends the answer) the request names a stop
    text = text_of(tok, ids, skip_special_tokens=skip, stop_token_ids=[stop])[0]
    assert text == tok.decode(ids[:-1]) != tok.decode(ids)
    assert text_of(tok, ids, skip_special_tokens=skip, stop_token_ids=[stop],
                   include_stop_str_in_output=True)[0] == tok.decode(ids)
