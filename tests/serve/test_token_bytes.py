"""Chat logprobs' `bytes` are the token's own bytes, so that a client joining them gets the text
back even where one character spans several tokens (what OpenAI documents `bytes` for)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from raypaged.core.contracts import TokenLogprobs
from raypaged.serve.responses import Choice, Shapes

TEXT = "naïve café 日本語 🙂 — done"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def chat_logprobs(tokenizer, token_ids, top=()):
    choice = Choice(logprobs=[TokenLogprobs(t, -0.5, 1, top) for t in token_ids])
    return Shapes(tokenizer).chat_choice(True, 0, choice, whole=True)["logprobs"]["content"]


def test_the_bytes_of_tokens_that_split_a_character_join_into_the_text(tokenizer):
    ids = tokenizer.encode(TEXT)
    entries = chat_logprobs(tokenizer, ids)
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == TEXT
    # " 日" is three tokens in SmolLM2's vocabulary: a space and 0xE6, then 0x97, then 0xA5
    split = [e for e in entries if e["token"].endswith("\ufffd")]
    assert [e["bytes"] for e in split[:3]] == [[32, 0xE6], [0x97], [0xA5]]


def test_top_logprobs_carry_the_same_bytes_as_the_token_itself(tokenizer):
    ids = tokenizer.encode(" 日")
    [entry] = chat_logprobs(tokenizer, ids[:1], top=((ids[0], -0.5), (ids[1], -2.0)))
    assert entry["bytes"] == [32, 0xE6]
    assert [t["bytes"] for t in entry["top_logprobs"]] == [[32, 0xE6], [0x97]]


def test_a_special_token_is_its_text(tokenizer):
    [entry] = chat_logprobs(tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    assert entry["token"] == "<|im_end|>" and bytes(entry["bytes"]) == b"<|im_end|>"
