"""tool_choice "auto" over HTTP: a worker whose model writes a fixed answer in its family's format
(Hermes; Mistral's, chosen from the chat template), a fake engine that emits the answer's bytes
one token a step, streamed and whole, through the official OpenAI client."""
from __future__ import annotations

import asyncio

import openai
from openai.lib.streaming.chat import ChatCompletionStreamState

from fake_engine import EOS, FakeEngine
from local_fleet import LocalFleet, client_for, local_app
from raypaged.core.contracts import ScheduledBatch, StepResult
from raypaged.serve.worker import Worker

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris and Lyon?"}]
CALLS = ('Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n'
         '</tool_call>')


class ScriptRunner:
    """Every sample writes `script`, one byte (token) a step, then ends (EOS)."""

    def __init__(self, script: str):
        self.tokens = list(script.encode()) + [EOS]

    def execute(self, batch: ScheduledBatch) -> StepResult:
        return StepResult(sampled={
            sr.request_id: tuple(self.tokens[min(len(sr.output_token_ids) + j,
                                                 len(self.tokens) - 1)]
                                 for j in range(sr.num_samples))
            for sr in batch.requests if sr.num_samples})


def run(script: str, test, chat_template: str | None = None, engine: FakeEngine | None = None):
    engine = engine or FakeEngine()
    engine.core.runner = ScriptRunner(script)
    engine.tokenizer.chat_template = chat_template  # the router reads the call format there
    fleet = LocalFleet(n=0)
    fleet.workers = {"worker-0": Worker(engine, "worker-0")}
    app, _ = local_app(fleet)

    async def main():
        async with client_for(app) as client:
            oai = openai.AsyncOpenAI(base_url="http://local/v1", api_key="x", http_client=client)
            return await test(oai)
    try:
        return asyncio.run(main())
    finally:
        fleet.shutdown()


def whole_and_streamed(script: str, chat_template: str | None = None):
    body = dict(model="fake-model", messages=ASK, tools=[WEATHER], max_tokens=200,
                temperature=0)

    async def test(oai):
        whole = await oai.chat.completions.create(**body)
        stream = await oai.chat.completions.create(stream=True, **body)
        state, chunks = ChatCompletionStreamState(), []
        async for chunk in stream:
            chunks.append(chunk)
            state.handle_chunk(chunk)
        return whole.choices[0], chunks, state.get_final_completion().choices[0]
    return run(script, test, chat_template)


def test_auto_streams_the_text_before_a_call_as_content_then_each_call_piece_by_piece():
    whole, chunks, final = whole_and_streamed(CALLS)
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Checking both."
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')]
    # the pieces depend on how many steps each message carries (the worker coalesces when
    # the client is slower); which delta says what does not: content, then per call its
    # header (index, id, type, name) and after it only arguments, call 0's before call 1's
    # (a chunk carrying several steps may hold the last content and the first header)
    content = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    deltas = [tc.model_dump(exclude_none=True) for c in chunks
              for tc in c.choices[0].delta.tool_calls or ()]
    assert "".join(content) == "Checking both."
    first_call = next(i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls)
    assert not any(c.choices[0].delta.content for c in chunks[first_call + 1:])
    ids = [d.pop("id") for d in deltas if "id" in d]
    assert len(ids) == 2 and ids[0] != ids[1] and all(i.startswith("call_") for i in ids)
    assert [d["index"] for d in deltas] == sorted(d["index"] for d in deltas)
    firsts = [next(d for d in deltas if d["index"] == k) for k in (0, 1)]
    assert [(d["type"], d["function"]["name"]) for d in firsts] == [("function", "get_weather")] * 2
    assert all(d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"}
               for d in deltas if d not in firsts)
    assert ["".join(d["function"]["arguments"] for d in deltas if d["index"] == k)
            for k in (0, 1)] == ['{"city": "Paris"}', '{"city": "Lyon"}']
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the SDK's accumulation of the stream is the whole message
    assert final.finish_reason == "tool_calls" and final.message.content == "Checking both."
    assert [(c.id, c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (ids[0], "get_weather", '{"city": "Paris"}'), (ids[1], "get_weather", '{"city": "Lyon"}')]


def test_auto_without_a_call_is_plain_content_streamed_as_it_comes():
    text = "It is sunny <b>in</b> Paris."
    whole, chunks, final = whole_and_streamed(text)
    assert (whole.finish_reason, whole.message.content, whole.message.tool_calls) == (
        "stop", text, None)
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert final.message.content == text and final.finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


MISTRAL = '{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}'


def test_a_mistral_template_reads_tool_calls_lists_with_mistral_ids():
    template = MISTRAL
    script = ('Checking both.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
              '"Paris"}}, {"name": "get_weather", "arguments": {"city": "Lyon"}}]')
    whole, chunks, final = whole_and_streamed(script, template)
    calls = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')]
    assert (whole.finish_reason, whole.message.content) == ("tool_calls", "Checking both.")
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == calls
    ids = [tc.id for c in chunks for tc in c.choices[0].delta.tool_calls or () if tc.id]
    assert len(ids) == 2 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking both."
    # the SDK's accumulation of the stream is the whole message
    assert (final.finish_reason, final.message.content) == ("tool_calls", "Checking both.")
    assert [(c.id, c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (i, n, a) for i, (n, a) in zip(ids, calls)]


def test_special_tokens_stay_in_the_text_only_where_the_mistral_parser_reads_it():
    """[TOOL_CALLS] is a special token: with it skipped the parser would never see where the
    calls begin (vLLM turns skip_special_tokens off for its mistral parser too)."""
    def skip(template, **fields) -> bool:
        engine = FakeEngine()

        async def test(oai):
            await oai.chat.completions.create(model="fake-model", messages=ASK, max_tokens=4,
                                              **fields)
        run("ok", test, template, engine)
        [(params, _)] = engine._meta.values()
        return params.skip_special_tokens

    assert skip(MISTRAL, tools=[WEATHER]) is False                      # auto: the parser reads it
    assert skip(MISTRAL, tools=[WEATHER], tool_choice="none") is True   # no parser
    assert skip(MISTRAL) is True                                        # no tools
    assert skip(None, tools=[WEATHER]) is True                          # hermes: tags are text
    # vLLM's request field, for any request
    assert skip(None, extra_body={"skip_special_tokens": False}) is False
