"""Chat messages -> the prompt the model reads, one way for every entry point (`raypaged
generate`, `LLM.chat`, the HTTP router, a batch job's prefix grouping), so a conversation is
the same tokens, and so the same cached prefix, whichever way it arrives.
"""
from __future__ import annotations


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """The conversation through the tokenizer's chat template, as text."""
    return tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                         add_generation_prompt=add_generation_prompt)


def encode_chat(tokenizer, text: str) -> list[int]:
    """Token ids of a rendered conversation. No special tokens are added: the template wrote
    the ones it wants (BOS included), as transformers' apply_chat_template(tokenize=True) does."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_token_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list[dict] | None = None) -> list[int]:
    return encode_chat(tokenizer, render_chat(tokenizer, messages, add_generation_prompt, tools))
