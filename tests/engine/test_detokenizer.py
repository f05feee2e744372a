"""Incremental detokenization: multi-byte characters and stop strings, token by token."""
from raypaged.core.sampling_params import SamplingParams
from raypaged.output_processor import IncrementalDetokenizer


def stream(tok, text, stop=(), prompt="Say:"):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), SamplingParams(stop=stop))
    deltas = [detok.add([t], finished=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    return deltas, detok


def test_multibyte_characters_split_across_tokens(llm):
    tok = llm.get_tokenizer()
    text = " héllo 🦊 wörld — 東京 ✓"
    deltas, _ = stream(tok, text)
    assert "".join(deltas) == tok.decode(tok.encode(text))
    assert all("\ufffd" not in d for d in deltas)
    assert len(tok.encode("🦊")) > 1  # the fox really is split into byte tokens


def test_stop_string_is_cut_and_never_streamed(llm):
    tok = llm.get_tokenizer()
    deltas, detok = stream(tok, " The answer is Paris, of course.", stop=["Paris"])
    assert "".join(deltas) == " The answer is "
    assert not any("Par" in d for d in deltas)
    assert detok.stop_reason == "Paris"


def test_held_back_text_never_exceeds_the_longest_stop_string():
    """Streaming holds back only what a stop string could still complete: len(longest) - 1
    characters, which max_stop_string_chars bounds (a 1 MB stop string once held back the
    whole output)."""
    tok = _Bytes()
    for stop in (("END",), ("x" * 40, "no"), ("é" * 5,)):
        detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stop))
        hold = max(len(s) for s in stop) - 1
        for t in tok.encode("some text that never stops, " * 20):
            detok.add([t])
            assert len(detok.text) - detok.emitted <= hold
        assert len(detok.text) - detok.emitted == hold  # and the rest was streamed



def test_stop_strings_wait_for_min_tokens_as_in_vllm():
    """min_tokens holds back stop strings too (vLLM's detokenizer checks them only once the
    output is longer than min_tokens): a stop string must end in text of a token past the
    first min_tokens. Before, "o" in "one" ended a min_tokens=5 request with no text."""
    from raypaged.core.contracts import RequestDelta
    from raypaged.output_processor import OutputProcessor

    tok = _Bytes()
    ids = tok.encode("one two three")
    for min_tokens, stop, text in ((0, "o", ""), (5, "o", "one tw"), (5, "tw", "one "),
                                   (7, "o", "one two three")):
        params = SamplingParams(min_tokens=min_tokens, stop=stop, max_tokens=len(ids))
        detok = IncrementalDetokenizer(tok, [], params)
        streamed = "".join(detok.add([t], finished=i == len(ids) - 1) for i, t in enumerate(ids))
        assert (streamed, detok.text) == (text, text), (min_tokens, stop)
        assert detok.stop_reason == (None if text == "one two three" else stop)
        # the engine's output processor passes the request's min_tokens on
        proc = OutputProcessor(tok)
        proc.add("r", [], params, 0, IncrementalDetokenizer(tok, [], params))
        outs = [o for i, t in enumerate(ids) for o in proc.process(
            [RequestDelta("r", (t,), "length" if i == len(ids) - 1 else None)])[0]]
        assert "".join(o.new_text for o in outs) == text
        assert outs[-1].finish_reason == ("length" if text == "one two three" else "stop")

class _Bytes:
    """Token id = byte."""

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode(errors="replace")


def test_stop_string_in_the_stop_tokens_own_text_is_the_stop_reason_as_in_vllm():
    """include_stop_str_in_output keeps the text of the stop token that ended the sample; when
    that text completes a stop string, the stop string is the stop_reason (vLLM's output
    processor sets it over the token id), and the text ends with it. Before, the text was cut
    at the stop string while stop_reason still named the token id."""
    from raypaged.core.contracts import RequestDelta
    from raypaged.output_processor import OutputProcessor

    tok = _Bytes()
    ids = tok.encode("ab!")
    for include, text, reason in ((True, "ab!", "!"), (False, "ab", ord("!"))):
        params = SamplingParams(stop="!", stop_token_ids=[ord("!")], max_tokens=8,
                                include_stop_str_in_output=include)
        proc = OutputProcessor(tok)
        proc.add("r", [], params, 0, IncrementalDetokenizer(tok, [], params))
        outs = [o for i, t in enumerate(ids) for o in proc.process(
            [RequestDelta("r", (t,), "stop" if i == len(ids) - 1 else None,
                          stop_reason=t if i == len(ids) - 1 else None)])[0]]
        assert "".join(o.new_text for o in outs) == text
        assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", reason), include
