"""Large bodies parsed in child processes (serve/body_parser.py): the same value or the same
refusal as in the router, the route's limits applied there, and a dead child replaced by the
in-process parse."""
from __future__ import annotations

import asyncio
import functools
import json

import pytest

from raypaged.serve import json_body
from raypaged.serve.body_parser import BodyParsers
from raypaged.serve.errors import APIError
from raypaged.serve.limits import RequestLimits

LIMITS = RequestLimits()
COMPLETION = functools.partial(LIMITS.check_completion, max_model_len=512)


def run(coro):
    return asyncio.run(coro)


def refusal(exc: APIError) -> tuple:
    return exc.status, exc.message, exc.param, exc.code


def test_a_large_body_comes_back_parsed_from_a_child(monkeypatch):
    body = json.dumps({"prompt": [1] * 300, "max_tokens": 3, "stop": ["\u00e9t\u00e9"]}).encode()
    parsers = BodyParsers(threshold=100)

    def not_here(_):
        raise AssertionError("parsed in the router")

    async def main():
        first = await parsers.parse(body, COMPLETION)
        monkeypatch.setattr(json_body, "parse_json_body", not_here)
        return first, await parsers.parse(body, COMPLETION)  # the same child, started once

    first, second = run(main())
    assert first == second == {"prompt": [1] * 300, "max_tokens": 3, "stop": ["\u00e9t\u00e9"]}


@pytest.mark.parametrize("body, precheck", [
    (b'{"prompt": [' + b"1," * 5000 + b'1]}', COMPLETION),          # a limit: too long
    (b'{"prompt": "hi", "stop": [' + b'"a",' * 40 + b'"a"]}', COMPLETION),  # max_stop_strings
    (b'{"messages": [' + b'{"role": "user", "content": "x"},' * 3000
     + b'{"role": "user", "content": "x"}]}', LIMITS.check_chat),  # max_messages
    (b'{"prompt": "' + b"a" * 500 + b'", "temperature": 1e400}', None),  # the body check
    (b'{"prompt": "' + b"a" * 500 + b'\\ud800"}', None),
    (b'{"prompt": "' + b"a" * 500 + b'"' + b" " * 10, None),          # not JSON
])
def test_a_child_refuses_exactly_as_the_router_would(body, precheck):
    with pytest.raises(APIError) as here:
        value = json_body.parse_json_body(body)
        precheck(value)
    with pytest.raises(APIError) as there:
        run(BodyParsers(threshold=100).parse(body, precheck))
    assert refusal(there.value) == refusal(here.value)
    assert there.value.status == 400


@pytest.mark.parametrize("reaped", [True, False])
def test_a_child_killed_between_bodies_costs_no_answer(reaped):
    body = json.dumps({"prompt": "a" * 200}).encode()
    parsers = BodyParsers(threshold=100, processes=1)

    async def main():
        assert await parsers.parse(body) == {"prompt": "a" * 200}
        child = await parsers._idle.get()
        child.kill()
        if reaped:  # known dead: a new child; else the write or read fails: parsed here
            await child.wait()
        parsers._idle.put_nowait(child)
        return await parsers.parse(body), await parsers.parse(body)

    assert run(main()) == ({"prompt": "a" * 200}, {"prompt": "a" * 200})


def test_a_child_that_cannot_start_leaves_the_parse_to_the_router(monkeypatch):
    from raypaged.serve import body_parser

    monkeypatch.setattr(body_parser.sys, "executable", "/nonexistent/python")
    body = b'{"prompt": [' + b"1," * 5000 + b'1]}'
    parsers = BodyParsers(threshold=100)
    # parsed in the router (a thread); its limit is the frontend's to apply
    assert run(parsers.parse(body, COMPLETION)) == {"prompt": [1] * 5001}


def test_bodies_parsed_in_the_router_are_parsed_one_at_a_time(monkeypatch):
    """json.loads holds the GIL for a whole body: two at once would keep the event loop (and
    /health) waiting behind both in turn. Small bodies do not queue behind a large one."""
    import threading

    from raypaged.serve import body_parser

    running, most, gate = [0], [0], threading.Event()

    def parse(body):
        if len(body) <= 10:  # a small one, on the loop: beside a large one, not behind it
            return len(body)
        running[0] += 1
        most[0] = max(most[0], running[0])
        gate.wait(0.05)  # long enough for the others to start, were they allowed to
        running[0] -= 1
        return len(body)

    monkeypatch.setattr(body_parser.sys, "executable", "/nonexistent/python")  # no child
    monkeypatch.setattr(body_parser, "parse_json_body", parse)
    bodies = BodyParsers(threshold=10)

    async def main():
        return await asyncio.gather(*(bodies.parse(b"x" * 11) for _ in range(4)),
                                    bodies.parse(b"x" * 10))

    assert asyncio.run(main()) == [11, 11, 11, 11, 10]
    assert most[0] == 1


def test_small_bodies_are_parsed_in_the_router_with_no_child():
    parsers = BodyParsers(threshold=100)
    assert run(parsers.parse(b'{"prompt": "hi"}', COMPLETION)) == {"prompt": "hi"}
    assert parsers._idle is None


def test_only_the_fields_the_request_model_knows_cross_back():
    from raypaged.serve.body_parser import model_fields
    from raypaged.serve.protocol import ChatCompletionRequest, CompletionRequest

    junk = [{"a": 1}] * 100  # the model ignores it: 8 MiB of it would be unpickled for nothing
    parsers = BodyParsers(threshold=100)
    completion = {"prompt": "hi", "max_tokens": 3, "stop": ["x"], "cache_salt": "s", "junk": junk}
    chat = {"messages": [{"role": "user", "content": "hi", "extra": 1}], "tools": [],
            "extra_body": junk}

    async def main():
        return (await parsers.parse(json.dumps(completion).encode(), COMPLETION,
                                    model_fields(CompletionRequest)),
                await parsers.parse(json.dumps(chat).encode(), LIMITS.check_chat,
                                    model_fields(ChatCompletionRequest)),
                await parsers.parse(json.dumps([completion]).encode(), None,
                                    model_fields(CompletionRequest)))

    got_completion, got_chat, got_list = run(main())
    assert got_completion == {"prompt": "hi", "max_tokens": 3, "stop": ["x"], "cache_salt": "s"}
    # only top-level keys are dropped: a message keeps what it carries
    assert got_chat == {"messages": [{"role": "user", "content": "hi", "extra": 1}], "tools": []}
    assert got_list == [completion]  # not an object: the frontend refuses it whole


def _stop(parsers: BodyParsers):
    """Stop the pool's one child (SIGSTOP): it holds its pipes open and never answers."""
    import os
    import signal

    async def stop():
        child = await parsers._idle.get()
        os.kill(child.pid, signal.SIGSTOP)
        parsers._idle.put_nowait(child)
        return child
    return stop()


def test_a_child_that_does_not_answer_is_killed_and_the_body_parsed_in_the_router():
    body = json.dumps({"prompt": "a" * 200, "junk": 1}).encode()
    parsers = BodyParsers(threshold=100, processes=1, timeout_s=60)
    fields = frozenset({"prompt"})

    async def main():
        # the first exchange starts the child: a busy machine may take seconds for that
        assert await parsers.parse(body, None, fields) == {"prompt": "a" * 200}
        parsers.timeout_s = 0.3
        stopped = await _stop(parsers)
        try:
            # without a deadline this waits for ever: bounded here so the test fails instead
            late = await asyncio.wait_for(parsers.parse(body, None, fields), 5)
            killed = await asyncio.wait_for(stopped.wait(), 5)
            parsers.timeout_s = 60
            fresh = await parsers.parse(body, None, fields)  # a new child answers the next
            child = await parsers._idle.get()
            return late, killed, fresh, child is not stopped and child.returncode is None
        finally:
            if stopped.returncode is None:
                stopped.kill()

    late, killed, fresh, new_child = run(main())
    assert late == {"prompt": "a" * 200, "junk": 1}  # the router's own parse: every field
    assert killed == -9
    assert fresh == {"prompt": "a" * 200} and new_child


def test_a_child_whose_exchange_is_cancelled_is_killed_not_reused():
    body = json.dumps({"prompt": "a" * 200}).encode()
    parsers = BodyParsers(threshold=100, processes=1, timeout_s=60)

    async def main():
        await parsers.parse(body)
        stopped = await _stop(parsers)
        try:
            task = asyncio.ensure_future(parsers._in_child(body, None, None))
            await asyncio.sleep(0.2)  # written, waiting on the stopped child's answer
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            returned = await parsers._idle.get()
            return returned, await asyncio.wait_for(stopped.wait(), 5)
        finally:
            if stopped.returncode is None:
                stopped.kill()

    assert run(main()) == (None, -9)  # the slot starts a fresh child next time
