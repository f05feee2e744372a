"""A 400 from the request's shape names the JSON path the client wrote and what was wrong there.

`prompt`, `stop` and a message's `content` each take one of several shapes; pydantic reports one
failure per shape, with the shape's name (`str`, `list[TextPart]`) inside the path. The client
never wrote those names, and the first shape's complaint ("should be a valid string") is wrong
about a list that went astray three levels deeper."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from raypaged.serve.errors import APIError, from_validation_error
from raypaged.serve.protocol import ChatCompletionRequest, CompletionRequest


def error_of(model, body: dict):
    with pytest.raises(ValidationError) as info:
        model.model_validate({"model": "m", **body})
    err = from_validation_error(info.value)
    return err.status, err.param, err.message


def chat(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


def test_an_image_part_is_named_by_its_json_path_and_told_its_type_must_be_text():
    assert error_of(ChatCompletionRequest, chat([{"type": "image_url", "image_url": {}}])) == (
        400, "messages.0.content.0.type", "messages.0.content.0.type: Input should be 'text'")


def test_a_text_part_without_text_is_told_so_not_that_content_should_be_a_string():
    assert error_of(ChatCompletionRequest, chat([{"type": "text"}])) == (
        400, "messages.0.content.0.text", "messages.0.content.0.text: Field required")


def test_content_of_no_shape_at_all_is_told_every_shape_it_may_take():
    assert error_of(ChatCompletionRequest, chat(3)) == (
        400, "messages.0.content",
        "messages.0.content: Input should be a valid string, or a valid list")


def test_a_prompt_element_of_no_accepted_type_names_its_index_and_the_types():
    assert error_of(CompletionRequest, {"prompt": [1.5]}) == (
        400, "prompt.0",
        "prompt.0: Input should be a valid string, or a valid integer, or a valid list")


def test_a_plain_field_keeps_its_single_error():
    status, param, message = error_of(CompletionRequest, {"prompt": "hi", "stop": 5})
    assert (status, param) == (400, "stop")
    assert message == "stop: Input should be a valid string, or a valid list"
    status, param, message = error_of(CompletionRequest, {"prompt": "hi", "temperature": "hot"})
    assert (status, param) == (400, "temperature")


def test_vllm_fields_not_implemented_are_refused_unless_they_ask_for_nothing():
    neutral = {"use_beam_search": False, "bad_words": [], "priority": 0, "length_penalty": 1,
               "prompt_logprobs": None, "echo": False, "chat_template": None}
    ChatCompletionRequest.model_validate({**chat("hi"), **neutral})
    for field, value in (("use_beam_search", True), ("bad_words", ["x"]), ("priority", 2),
                         ("echo", True), ("chat_template", "{{ messages }}")):
        with pytest.raises(APIError) as refused:
            ChatCompletionRequest.model_validate({**chat("hi"), field: value})
        assert (refused.value.status, refused.value.param) == (400, field)
        assert refused.value.message.startswith(f"{field} is not supported by this server")


def test_chat_template_kwargs_reach_the_template_but_not_its_own_arguments(default_model_dir):
    from transformers import AutoTokenizer

    from raypaged.chat import render_chat
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages, template_kwargs={"greeting": "yo: "}) == "yo: hi"
    request = ChatCompletionRequest.model_validate(
        {**chat("hi"), "chat_template_kwargs": {"tokenize": True}})
    with pytest.raises(APIError) as refused:
        request.check()
    assert refused.value.param == "chat_template_kwargs"
