"""Incremental detokenization: multi-byte characters and stop strings, token by token."""
from raypaged.detokenizer import IncrementalDetokenizer


def stream(tok, text, stop=(), prompt="Say:"):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), stop)
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
