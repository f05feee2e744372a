"""The SSE stream (Generation.stream + sse_stream.py): the events a client reads, the frame
that splices text into a chunk made once, outputs that queued up while the router was busy
going out as one chunk; failover, deadlines and the abort accounting."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from local_fleet import MID_STREAM, LocalFleet, post_once
from raypaged.core.sampling_params import SamplingParams
from raypaged.outputs import SequenceOutput
from raypaged.serve.errors import APIError
from raypaged.serve.fleet import READY
from raypaged.serve.frontend import CHAT, COMPLETIONS
from raypaged.serve.generation import Generation
from raypaged.serve.leg import Leg
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.responses import Choice, Shapes, sse_data
from raypaged.serve.sse_stream import Frame, sse_events

PROMPT = "a prompt long enough for a block or two of bytes"
COMPLETION = {"model": "fake-model", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True,
              "temperature": 0}
CHAT_BODY = {"model": "fake-model", "messages": [{"role": "user", "content": PROMPT}],
             "max_tokens": 8, "ignore_eos": True, "temperature": 0}


def served(path: str, body: dict, failing: dict | None = None):
    """(response, metrics) of one request on a fresh 2-worker in-process fleet; `failing`:
    worker id -> how it fails (local_fleet's modes)."""
    fleet = LocalFleet(step_delay_s=0.02)  # one step at a time reaches the router: no coalescing
    fleet.failing.update(failing or {})
    return post_once(fleet, body, path)


def events(r) -> tuple[dict, list]:
    """(text per choice, the other events with their text taken out, repeats collapsed), the
    per-request id and time dropped. How tokens split into chunks is not compared: the worker
    sends a router's steps that queued up as one message, and the router sends outputs that
    queued up in it as one chunk, so on a loaded machine either may join steps.
    A chunk's bytes: test_a_frame_is_byte_for_byte_the_chunk_sse_data_makes."""
    texts: dict[int, str] = {}
    shapes: list = []
    for e in r.text.split("\n\n"):
        if not e:
            continue
        if e == "data: [DONE]":
            shapes.append(e)
            continue
        event = json.loads(e[len("data: "):])
        event.pop("id"), event.pop("created")
        for c in event["choices"]:
            if "text" in c:
                texts[c["index"]] = texts.get(c["index"], "") + c.pop("text")
            elif "content" in c.get("delta", {}) and "role" not in c["delta"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["delta"].pop("content")
            if c.get("logprobs") is not None:  # as many as the chunk's tokens
                c["logprobs"] = sorted(c["logprobs"])
        text_only = "usage" not in event and all(
            c["finish_reason"] is None and not c.get("delta", {}) for c in event["choices"])
        if not text_only and (not shapes or shapes[-1] != event):
            shapes.append(event)
    return texts, shapes


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", COMPLETION),
    ("/v1/chat/completions", CHAT_BODY),
    ("/v1/completions", {**COMPLETION, "n": 2, "logprobs": 1}),  # not plain: the dict path
    ("/v1/completions", {**COMPLETION, "prompt": [PROMPT, PROMPT[::-1]]}),  # two generations
], ids=["completions", "chat", "n2_logprobs", "two_prompts"])
def test_a_stream_sends_every_token_of_every_choice_then_usage_and_done(path, body):
    whole, _ = served(path, body)
    r, _ = served(path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    texts, shapes = events(r)
    choices = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list)
                                  else 1)
    assert [len(texts[i]) for i in range(choices)] == [8] * choices  # one character a token
    if "messages" not in body:
        assert [texts[i] for i in range(choices)] == [c["text"] for c in whole.json()["choices"]]
    assert shapes[-1] == "data: [DONE]"
    assert shapes[-2]["usage"]["completion_tokens"] == 8 * choices


def test_a_stream_fails_over_mid_stream_with_the_text_of_an_unbroken_answer():
    whole, _ = served("/v1/completions", COMPLETION)
    home = whole.headers["x-raypaged-worker"]  # routing is deterministic: the same one again
    r, metrics = served("/v1/completions", {**COMPLETION, "stream": True},
                        failing={home: MID_STREAM})
    chunks = [json.loads(e[len("data: "):]) for e in r.text.split("\n\n")
              if e.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.json()["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert metrics.counters["request_retries"] == {"": 1.0}
    assert whole.json()["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("text", ["", "plain", 'quote " and \\ backslash', "line\nbreak\t",
                                  "héllo ✓ 日本", "\u2028\x00"])
@pytest.mark.parametrize("route", [COMPLETIONS, CHAT], ids=["completions", "chat"])
def test_a_frame_is_byte_for_byte_the_chunk_sse_data_makes(route, text):
    shapes = Shapes(tokenizer=None)
    chunk = (shapes.completion_choice if route is COMPLETIONS else shapes.chat_choice)
    head = {"id": "cmpl-1", "object": route.chunk_object, "created": 7, "model": 'm "x"'}
    c = Choice()
    c.text.append(text)
    expected = sse_data({**head, "choices": [chunk(False, 0, c)]})
    assert Frame(head, lambda i, c: chunk(False, i, c))(text) == expected


@pytest.mark.parametrize("text", ["a\u2028b", "a\u2029b", "a\x85b"])
def test_an_event_is_one_line_for_httpx_iter_lines_whatever_the_text(text):
    """httpx's iter_lines() (str.splitlines()) also ends a line at U+2028, U+2029 and U+0085:
    sent raw, a chunk holding one was cut in two and its JSON no longer parsed."""
    from httpx._decoders import LineDecoder

    shapes = Shapes(tokenizer=None)
    head = {"id": "cmpl-1", "object": COMPLETIONS.chunk_object, "created": 7, "model": "m"}
    c = Choice()
    c.text.append(text)
    for event in (Frame(head, lambda i, c: shapes.completion_choice(False, i, c))(text),
                  sse_data({**head, "choices": [shapes.completion_choice(False, 0, c)]})):
        decoder = LineDecoder()
        lines = decoder.decode(event) + decoder.flush()
        assert lines == [event.split("\n")[0], ""]
        assert json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text


# -- Generation.stream and sse_events, fed by hand -------------------------------------------
class _Fleet:
    """Its one worker stays ready: the fleet watch (every WATCH_S) finds nothing to fail over."""

    def snapshot(self):
        class Snap:
            def worker(self, worker_id):
                return SimpleNamespace(state=READY, stats=None)
        return Snap()


class _Dispatcher:
    def __init__(self):
        self.metrics = RequestMetrics()
        self.fleet = _Fleet()
        self.closed_workers: list[str] = []

    def opened(self, worker_id: str, blocks: int = 0, n: int = 1) -> None:
        if n < 0:
            self.closed_workers.append(worker_id)


def _out(text: str, finish: str | None = None) -> list[SequenceOutput]:
    return [SequenceOutput("r", 0, (1,), text, finish_reason=finish)]


def _generation(steps: list[list[SequenceOutput]]) -> Generation:
    """A generation with an open leg whose first outputs were taken and whose next `steps`
    messages are already queued: the router was busy while the worker ran those steps."""
    g = Generation(_Dispatcher(), "r", [5, 6, 7], SamplingParams(max_tokens=4), None, 0.0)
    leg = Leg("worker-0", None, (0,), False)
    g._legs.append(leg)
    for outs in steps:
        g._queue.put_nowait((leg, outs))
    return g


async def _read(agen) -> list:
    return [item async for item in agen]


def test_outputs_queued_while_the_router_was_busy_go_out_as_one_chunk():
    steps = [_out("a"), _out("b"), _out("c"), _out("d", "length")]
    batches = asyncio.run(_read(_generation(steps).stream()))
    assert [[o.new_text for o in b] for b in batches] == [["a", "b", "c", "d"]]

    shapes = Shapes(tokenizer=None)
    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
    async def first_event():
        events = sse_events([_generation(steps[:3])], 1,
                            lambda i, c: shapes.completion_choice(False, i, c), head, None, True,
                            False, False, None, None)
        try:
            return await anext(events)
        finally:
            await events.aclose()
    assert asyncio.run(first_event()) == sse_data({**head, "choices": [{
        "index": 0, "text": "abc", "logprobs": None, "finish_reason": None, "stop_reason": None}]})


def test_a_stream_past_its_deadline_ends_with_a_timeout_event_and_counts_an_abort():
    g = _generation([_out("a")])  # then nothing more comes
    timed_out = APIError(504, "too slow", code="request_timeout")
    shapes = Shapes(tokenizer=None)
    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}

    async def main():
        deadline = asyncio.get_running_loop().time() + 0.05
        return await _read(sse_events([g], 1, lambda i, c: shapes.completion_choice(False, i, c),
                                      head, None, True, False, False, deadline,
                                      lambda: timed_out))
    sent = asyncio.run(main())
    assert len(sent) == 3 and '"text": "a"' in sent[0]
    assert sent[1] == sse_data(timed_out.body()) and sent[2] == "data: [DONE]\n\n"
    assert g.d.metrics.counters["request_success"] == {"abort": 1.0}
    assert g.d.closed_workers == ["worker-0"]

