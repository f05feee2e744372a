"""A stream whose client leaves while a chunk is being sent is closed at once.

Starlette cancels the sending task when the client leaves; a body generator suspended at its
`yield` is then left open until the garbage collector finalizes it, which for a generator in
a reference cycle can take longer than the whole generation (CI saw a request run all 200 of
its tokens after its client had gone). The SSE response closes it itself."""
from __future__ import annotations

import asyncio
import gc

from raypaged.serve.responses import sse_response


def _run(spec_version: str) -> list[str]:
    log: list[str] = []

    async def events():
        try:
            while True:
                log.append("yield")
                yield "data: {}\n\n"
        finally:
            log.append("closed")  # where the real stream aborts its requests

    async def main():
        sent_once = asyncio.Event()
        never = asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body":
                sent_once.set()
                await never.wait()  # a client that stopped reading: the send hangs

        async def receive():
            await sent_once.wait()
            return {"type": "http.disconnect"}

        response = sse_response(events(), {})
        scope = {"type": "http", "asgi": {"spec_version": spec_version}}
        task = asyncio.create_task(response(scope, receive, send))
        await sent_once.wait()
        if spec_version != "2.3":  # 2.4: no disconnect listener, the server cancels the task
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        log.append("returned")

    gc.disable()  # a cycle must not be what closes it
    try:
        asyncio.run(main())
    finally:
        gc.enable()
    return log


def test_a_client_gone_during_a_send_closes_the_stream_before_the_response_returns():
    assert _run("2.3") == ["yield", "closed", "returned"]


def test_a_cancelled_response_closes_its_stream_before_it_returns():
    assert _run("2.4") == ["yield", "closed", "returned"]
