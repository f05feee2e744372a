"""Chat messages -> the prompt the model reads, one way for every entry point (`raypaged
generate`, `LLM.chat`, the HTTP router, a batch job's prefix grouping), so a conversation is
the same tokens, and so the same cached prefix, whichever way it arrives.
"""
from __future__ import annotations


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, continue_final_message: bool = False,
                template_kwargs: dict | None = None) -> str:
    """The conversation through the tokenizer's chat template, as text; with
    `continue_final_message` the final message is left open (transformers cuts the template's
    end-of-turn after its content), for the model to go on with; `template_kwargs`: more
    variables the template reads (e.g. `enable_thinking`)."""
    check_turn(add_generation_prompt, continue_final_message)
    extra = dict(template_kwargs or {})
    if continue_final_message:
        extra["continue_final_message"] = True
    return tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **extra)


def check_turn(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """The two ways a rendered conversation may end, refused together (ValueError naming
    `continue_final_message` first, for the server's 400)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message goes on with the final message, and "
                         "add_generation_prompt starts a new one: set add_generation_prompt "
                         "to false")


def encode_chat(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of a rendered conversation. By default no special tokens are added: the
    template wrote the ones it wants (BOS included), as transformers'
    apply_chat_template(tokenize=True) does."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def chat_token_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                   tools: list[dict] | None = None) -> list[int]:
    return encode_chat(tokenizer, render_chat(tokenizer, messages, add_generation_prompt, tools))


def tool_call_format(tokenizer) -> str:
    """The tool-call parser for the model family, read from its chat template (and vocabulary):
    the template shows the model how to write calls, so it names the format. Hermes when
    nothing tells (a template without tools, such as SmolLM2's)."""
    # named templates ({"default": ..., "tool_use": ...}, or a list of {"name", "template"}):
    # searched in their repr, names and all, which keeps the markers below as they are (none
    # has a quote or a backslash to escape)
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if "<tool_call>" in template:  # Qwen2.5, Hermes 2/3, SmolLM3
        return "hermes"
    try:
        vocab = set(tokenizer.get_added_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without an added vocabulary
        vocab = set()
    if "[TOOL_CALLS]" in template or "[TOOL_CALLS]" in vocab:  # Mistral
        return "mistral"
    # Llama 3.1-3.3: tool results come back in the "ipython" role; <|python_tag|> opens a call
    if "<|python_tag|>" in template or "ipython" in template or "<|python_tag|>" in vocab:
        return "llama3_json"
    return "hermes"
