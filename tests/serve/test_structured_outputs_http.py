"""Structured outputs and tool calls over HTTP: an in-process fleet of two workers on the real
default model (fp32, greedy; no Ray), driven by raw HTTP and by the official OpenAI client."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState
import pydantic
import pytest

from local_fleet import MID_STREAM, LocalFleet, client_for, local_app
from raypaged.engine import Engine
from raypaged.config import EngineArgs
from raypaged.serve.worker import Worker

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Give me a person as JSON with name and age."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}, "required": ["zone"]}}}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def engines(default_model_dir):
    return [Engine.from_args(EngineArgs(model=str(default_model_dir), dtype="float32",
                                    kv_memory_mb=64, max_model_len=1024)) for _ in range(2)]


def fleet_of(engines) -> LocalFleet:
    fleet = LocalFleet(n=0)
    fleet.workers = {f"worker-{i}": Worker(e, f"worker-{i}") for i, e in enumerate(engines)}
    return fleet


def run(engines, test, failing: dict | None = None):
    fleet = fleet_of(engines)
    fleet.failing.update(failing or {})
    app, _ = local_app(fleet)

    async def main():
        async with client_for(app) as client:
            return await test(client)
    try:
        return asyncio.run(main())
    finally:
        fleet.shutdown()


def chat(**body) -> dict:
    return {"model": "fake-model", "messages": ASK, "temperature": 0, "max_tokens": 60, **body}


def post(engines, path, body):
    return run(engines, lambda c: c.post(path, json=body))


def events(r) -> list[dict]:
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- constraints on both routes --------------------------------------------------------------
def test_chat_response_format_json_schema_gives_the_exact_json(engines):
    r = post(engines, "/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                               "strict": True}}))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == '{\n  "name": "John",\n  "age": 25\n}'
    assert choice["finish_reason"] == "stop"


def test_completions_take_structured_outputs_and_response_format(engines):
    prompt = "A phone number: "
    r = post(engines, "/v1/completions", {"model": "fake-model", "prompt": prompt,
                                          "temperature": 0, "max_tokens": 20,
                                          "structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "123-4567"
    r = post(engines, "/v1/completions", {"model": "fake-model", "prompt": "A JSON object: ",
                                          "temperature": 0, "max_tokens": 40,
                                          "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["text"]), dict)


def test_choice_constraint_streams_one_of_the_choices(engines):
    r = post(engines, "/v1/chat/completions",
             chat(stream=True, structured_outputs={"choice": ["yes", "no"]}))
    chunks = events(r)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "no"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_openai_clients_parse_helper_gets_a_validated_model(engines):
    async def test(client):
        oai = openai.AsyncOpenAI(base_url="http://local/v1", api_key="x", http_client=client)
        done = await oai.beta.chat.completions.parse(
            model="fake-model", messages=ASK, temperature=0, max_tokens=60,
            response_format=Person)
        return done.choices[0].message.parsed
    assert run(engines, test) == Person(name="John", age=25)


# -- tool calls ------------------------------------------------------------------------------
def test_tool_choice_required_returns_tool_calls(engines):
    r = post(engines, "/v1/chat/completions", chat(messages=WEATHER_ASK, tools=[WEATHER, TIME],
                                                   tool_choice="required"))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def sdk_stream(engines, **body):
    """(chunks, the OpenAI SDK's accumulation of them) for one streamed chat request."""
    async def test(client):
        oai = openai.AsyncOpenAI(base_url="http://local/v1", api_key="x", http_client=client)
        stream = await oai.chat.completions.create(
            model="fake-model", temperature=0, max_tokens=60, stream=True, **body)
        state, chunks = ChatCompletionStreamState(), []
        async for chunk in stream:
            chunks.append(chunk)
            state.handle_chunk(chunk)
        return chunks, state.get_final_completion().choices[0]
    return run(engines, test)


def tool_deltas(chunks) -> list[dict]:
    return [tc.model_dump(exclude_none=True) for c in chunks
            for tc in c.choices[0].delta.tool_calls or ()]


def test_a_named_tool_choice_streams_id_and_name_then_its_arguments_in_pieces(engines):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = post(engines, "/v1/chat/completions", chat(
        messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice=named)).json()["choices"][0]
    [call] = whole["message"]["tool_calls"]
    # the arguments are the model's own text (constrained to the parameters' schema)
    assert call["function"] == {"name": "get_weather", "arguments": '{\n    "city": "Paris"\n}'}
    chunks, final = sdk_stream(engines, messages=WEATHER_ASK, tools=[WEATHER, TIME],
                               tool_choice=named)
    deltas = tool_deltas(chunks)
    first, rest = deltas[0], deltas[1:]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": "{"}
    # then one piece per token, index only: {, \n, "city, ": ... as the model wrote them
    assert len(rest) >= 4 and all(d.keys() == {"index", "function"} and d["index"] == 0
                                  and d["function"].keys() == {"arguments"} for d in rest)
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert final.finish_reason == "tool_calls" and not final.message.content
    [got] = final.message.tool_calls
    assert got.id == first["id"]
    assert (got.function.name, got.function.arguments) == ("get_weather",
                                                           call["function"]["arguments"])
    assert not any(c.choices[0].delta.content for c in chunks)


def test_the_openai_client_streams_a_required_tool_call_as_the_whole_message_has_it(engines):
    body = dict(messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice="required")
    whole = post(engines, "/v1/chat/completions", chat(**body)).json()["choices"][0]
    [call] = whole["message"]["tool_calls"]
    chunks, final = sdk_stream(engines, **body)
    deltas = tool_deltas(chunks)
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    assert len(deltas) > 2  # the arguments came in pieces, not at the end in one
    assert final.finish_reason == "tool_calls"
    [got] = final.message.tool_calls
    assert {"name": got.function.name, "arguments": got.function.arguments} == call["function"]
    assert json.loads(got.function.arguments) == {"city": "Paris"}


# -- failover mid-constraint -----------------------------------------------------------------
def test_a_constrained_stream_whose_worker_dies_continues_with_valid_json(engines):
    body = chat(stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON}})
    r = post(engines, "/v1/chat/completions", body)
    home = r.headers["x-raypaged-worker"]
    whole = "".join(c["choices"][0]["delta"].get("content", "") for c in events(r))
    r = run(engines, lambda c: c.post("/v1/chat/completions", json=body), {home: MID_STREAM})
    assert r.headers["x-raypaged-worker"] == home  # the header names who started it
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in events(r))
    assert text == whole == '{\n  "name": "John",\n  "age": 25\n}'
    assert Person.model_validate_json(text) == Person(name="John", age=25)


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("route, body, param, says", [
    ("/v1/chat/completions", chat(structured_outputs={"regex": "a("}), "structured_outputs",
     "parenthesis is not closed"),
    ("/v1/chat/completions", chat(structured_outputs={"json": {"type": "foo"}}),
     "structured_outputs", 'structured_outputs.json cannot be compiled: Unsupported type "foo"'),
    ("/v1/completions", {"model": "fake-model", "prompt": "x",
                         "structured_outputs": {"grammar": "root ::= x"}},
     "structured_outputs", 'Rule "x" is not defined'),
    ("/v1/chat/completions", chat(structured_outputs={"regex": "a" * 70000}),
     "structured_outputs", "max_structured_output_chars"),
    ("/v1/chat/completions", chat(structured_outputs={"regex": "a", "choice": ["b"]}),
     "structured_outputs", "exactly one of"),
    ("/v1/chat/completions", chat(structured_outputs={"regexp": "a"}),
     "structured_outputs.regexp", "Extra inputs are not permitted"),
    ("/v1/chat/completions", chat(structured_outputs={"regex": "a"},
                                  response_format={"type": "json_object"}),
     "structured_outputs", "not both"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema"}),
     "response_format.json_schema", "needs json_schema.schema"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "foo"}}}), "response_format.json_schema.schema",
     'response_format.json_schema.schema cannot be compiled: Unsupported type "foo"'),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "foo"}}}], tool_choice="required"), "tools",
     'tools cannot be compiled: Unsupported type "foo"'),
    ("/v1/chat/completions", chat(logit_bias={str(i): 1.0 for i in range(301)}), "logit_bias",
     "max_logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"99999999": 1.0}), "logit_bias", "token ids in"),
    ("/v1/chat/completions", chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "nope"}}), "tool_choice", "not in tools"),
    ("/v1/chat/completions", chat(tools=[WEATHER], tool_choice={
        "type": "function", "function": "get_weather"}), "tool_choice", "a named tool_choice"),
    ("/v1/chat/completions", chat(tool_choice="required"), "tool_choice", "needs tools"),
    ("/v1/chat/completions", chat(tools=[WEATHER], tool_choice="required",
                                  response_format={"type": "json_object"}), "tool_choice",
     "constrains the output itself"),
], ids=["bad_regex", "bad_schema", "bad_grammar", "too_large", "two_kinds", "unknown_key",
        "both_fields", "schema_missing", "format_bad_schema", "tool_bad_schema", "bias_too_many", "bias_bad_id", "unknown_tool",
        "function_not_an_object", "required_without_tools", "tools_and_format"])
def test_bad_constraints_are_refused_with_400_naming_the_problem(engines, route, body, param,
                                                                  says):
    r = post(engines, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"]
    assert error["param"] == param
    assert not any(e.has_unfinished() for e in engines)
