"""The chaos benchmark's well-behaved load: --concurrency clients, each sending greedy requests
one after another (alternately streaming and not, `max_tokens` 24, ignore_eos; after a failure
it waits 1 s, as Retry-After says), every outcome recorded: what "0 failed among well-behaved
clients" counts (benchmarks/chaos.py)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from benchmarks.chaos_phases import CLIENT_TIMEOUT_S

MAX_TOKENS = 24


@dataclass
class Outcome:
    started: float
    ended: float
    stream: bool
    status: str          # HTTP status; "stream error: <code>" for an error event; "hung"
    tokens: int
    done: bool           # a stream ended with [DONE]

    @property
    def ok(self) -> bool:
        return self.status == "200" and self.tokens == MAX_TOKENS and (self.done or not self.stream)


async def one(client: httpx.AsyncClient, url: str, i: int) -> Outcome:
    stream = bool(i % 2)
    body = {"prompt": f"Chaos request {i}: list some birds.", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0}
    started = time.monotonic()
    try:
        if not stream:
            r = await client.post(f"{url}/v1/completions", json=body)
            tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
            return Outcome(started, time.monotonic(), False, str(r.status_code), tokens, False)
        body.update(stream=True, stream_options={"include_usage": True})
        tokens, done = 0, False
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            status = str(r.status_code)
            async for line in r.aiter_lines():
                done |= line == "data: [DONE]"
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        status = f"stream error: {event['error'].get('code')}"
                    tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
        return Outcome(started, time.monotonic(), True, status, tokens, done)
    except httpx.TimeoutException:
        return Outcome(started, time.monotonic(), stream, "hung", 0, False)
    except httpx.HTTPError as exc:
        return Outcome(started, time.monotonic(), stream, type(exc).__name__, 0, False)


class Load:
    def __init__(self, url: str, concurrency: int):
        self.url, self.concurrency = url, concurrency
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._count = 0

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
            async def loop():
                while not self._stop.is_set():
                    self._count += 1
                    outcome = await one(client, self.url, self._count)
                    self.outcomes.append(outcome)
                    if not outcome.ok:  # as a client honouring Retry-After (1 s) would
                        await asyncio.sleep(1.0)
            await asyncio.gather(*(loop() for _ in range(self.concurrency)))

    def stop(self) -> None:
        self._stop.set()
