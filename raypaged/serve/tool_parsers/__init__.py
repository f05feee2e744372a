"""tool_choice "auto": the model's own tool-call format, read as its text streams, one parser per
model family (chosen from the chat template by raypaged.chat.tool_call_format, or by the setting
tool_call_parser, vLLM's --tool-call-parser names):

    hermes       <tool_call>{"name", "arguments"}</tool_call>    Qwen2.5, Hermes 2/3, SmolLM3
    llama3_json  <|python_tag|>{"name", "parameters"}; {...}     Llama 3.1-3.3
    mistral      [TOOL_CALLS][{"name", "arguments"}, ...]        Mistral v0.3 / Nemo / Small

Each is a CallsStream (tool_call_stream.py); the whole message runs the same stream over the
whole text (`parse_whole`), so the OpenAI SDK's accumulation of a stream is the non-streamed
message however the text was split. The rule every parser follows: once a call's header went
out, the message is the calls whose headers went out (with the arguments sent, partial if
max_tokens cut them) and the content before them; if none went out, the whole text is content.
"""
from __future__ import annotations

from raypaged.serve.tool_parsers.hermes import HermesStream
from raypaged.serve.tool_parsers.llama3_json import Llama3JsonStream
from raypaged.serve.tool_parsers.mistral import MistralStream

PARSERS = {"hermes": HermesStream, "llama3_json": Llama3JsonStream, "mistral": MistralStream}


def parse_whole(parser: str, text: str, tool_names=None
                ) -> tuple[str | None, list[tuple[str, str]] | None]:
    """A finished sample's (content, calls) as its stream sends them; calls None: no call (the
    content then is the text, "" included), content None: the calls alone. `tool_names`: the
    request's tools (None: any name)."""
    stream = PARSERS[parser](tool_names)
    content = stream.feed(text)[0] + stream.finish()[0]
    calls = stream.calls()
    return (content if calls is None else content or None), calls
