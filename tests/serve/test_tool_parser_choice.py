"""Which tool-call parser tool_choice "auto" uses: chosen from the model's chat template (the
snippets below are the parts of the real templates that tell), or set by --tool-call-parser."""
from __future__ import annotations

import argparse

import pydantic
import pytest

from fake_engine import FakeEngine
from local_fleet import LocalFleet
from raypaged.chat import tool_call_format
from raypaged.serve.cli import add_serve_parser, serve_args_from
from raypaged.serve.config import ServeArgs, ServeOptions
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.routing import Router

# Qwen2.5-Instruct (Hermes format)
QWEN25 = ('{%- if tools %}\n    {{- \'<|im_start|>system\\n\' }}\n    ...\n'
          '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function '
          'name and arguments within '
          '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
          '\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- endif %}')
# Llama 3.1-Instruct: the ipython environment, the JSON instruction, <|python_tag|> for builtins
LLAMA31 = ('{%- if builtin_tools is defined or tools is not none %}\n    {{- "Environment: '
           'ipython\\n" }}\n{%- endif %}\n...\n        {{- \'Respond in the format {"name": '
           'function name, "parameters": dictionary of argument name and its value}.\' }}\n...'
           '\n            {{- "<|python_tag|>" + tool_call.name + ".call(" }}\n...\n    {%- elif '
           'message.role == "tool" or message.role == "ipython" %}\n        {{- "<|start_header_'
           'id|>ipython<|end_header_id|>\\n\\n" }}')
# Llama 3.2-Instruct: no builtin tools, so no <|python_tag|>; the ipython role remains
LLAMA32 = ('{%- if tools is not none %}\n    {{- "Environment: ipython\\n" }}\n{%- endif %}\n'
           '...\n    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
           '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}')
# Mistral-7B-Instruct-v0.3
MISTRAL = ('{%- if tools is not none and (message == user_messages[-1]) %}\n            {{- "['
           'AVAILABLE_TOOLS] [" }}\n...\n    {%- elif message.tool_calls is defined and message.'
           'tool_calls is not none %}\n        {{- "[TOOL_CALLS] [" }}\n        {%- for tool_call '
           'in message.tool_calls %}\n...\n            {%- if not tool_call.id is defined or '
           'tool_call.id|length != 9 %}\n                {{- raise_exception("Tool call IDs should '
           'be alphanumeric strings with length 9!") }}')
# SmolLM2-Instruct, the default model: no tool section
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
           "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\\n' }}{% endif %}")


class Tok:
    def __init__(self, chat_template=None, added=()):
        self.chat_template, self.added = chat_template, added

    def get_added_vocab(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.added)}


@pytest.mark.parametrize("template, parser", [
    (QWEN25, "hermes"), (LLAMA31, "llama3_json"), (LLAMA32, "llama3_json"),
    (MISTRAL, "mistral"), (SMOLLM2, "hermes"), (None, "hermes"),
    ({"default": SMOLLM2, "tool_use": QWEN25}, "hermes"),
    ({"default": LLAMA31}, "llama3_json")])
def test_the_chat_template_names_the_parser(template, parser):
    assert tool_call_format(Tok(template)) == parser


def test_a_special_token_in_the_vocabulary_names_it_when_the_template_does_not():
    assert tool_call_format(Tok(SMOLLM2, ["[TOOL_CALLS]", "[ARGS]"])) == "mistral"
    assert tool_call_format(Tok(None, ["<|python_tag|>", "<|eom_id|>"])) == "llama3_json"


def frontend(**kw) -> OpenAIFrontend:
    engine = FakeEngine()
    engine.tokenizer.chat_template = MISTRAL  # on this instance only
    fleet = LocalFleet(n=0)
    dispatcher = Dispatcher(fleet, Router(ServeOptions(), engine.block_size), RequestMetrics())
    return OpenAIFrontend(dispatcher, engine.tokenizer, ModelInfo("m", 64, 257, 0), **kw)


def test_the_setting_overrides_the_template():
    assert frontend().tool_parser == "mistral"
    assert frontend(tool_call_parser="llama3_json").tool_parser == "llama3_json"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="raypaged")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_the_flag_reaches_the_options_and_an_unknown_name_is_refused_naming_it(capsys):
    options, _ = serve_args_from(parse("--tool-call-parser", "llama3_json",
                                       "--max-tool-calls", "3")).split()
    assert (options.tool_call_parser, options.max_tool_calls) == ("llama3_json", 3)
    assert serve_args_from(parse()).split()[0].tool_call_parser is None  # from the template
    with pytest.raises(SystemExit):
        parse("--tool-call-parser", "pythonic")
    err = capsys.readouterr().err
    assert "argument --tool-call-parser: invalid choice: 'pythonic' (choose from hermes, " \
           "llama3_json, mistral)" in err or \
           "argument --tool-call-parser: invalid choice: 'pythonic' (choose from 'hermes', " \
           "'llama3_json', 'mistral')" in err
    with pytest.raises(pydantic.ValidationError, match="tool_call_parser"):
        ServeArgs(tool_call_parser="pythonic")  # a Serve config file's args
    with pytest.raises(ValueError, match=r"tool_call_parser must be one of \['hermes', "
                                         r"'llama3_json', 'mistral'\], got 'pythonic'"):
        ServeOptions(tool_call_parser="pythonic")
    with pytest.raises(ValueError, match="max_tool_calls must be a positive integer, got 0"):
        ServeOptions(max_tool_calls=0)
