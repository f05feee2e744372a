"""A request's SSE stream:

    Generation.stream(deadline) (several prompts: merged, samples numbered across the request)
    ─> a batch: every output that arrived since the last one
        ─> plain chunk (one sample, no logprobs, no tool-call parsing, not finished):
               the request's Frame with the text spliced in (one json.dumps of a string)
        ─> any other chunk: its choices' dicts
    ─> usage (if asked) ─> [DONE]

The frame saves, per token, the chunk's dicts and their serialisation; outputs that queued up
while the router was busy go out as one chunk (docs/performance.md).
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import replace
from typing import AsyncIterator, Callable

from raypaged.outputs import SequenceOutput
from raypaged.serve.errors import APIError
from raypaged.serve.failover import DeadlinePassed
from raypaged.serve.generation import Generation
from raypaged.serve.responses import Choice, json_line, sse_data, usage

# Stands for the text while a request's frame is made; unique, so it cannot occur elsewhere in
# the chunk (the head's fields are an id, a time, the model's name and the object's name).
_MARK = f"raypaged-text-{uuid.uuid4().hex}"


class Frame:
    """The SSE event of one plain chunk of one request, made once: sse_data of the chunk's
    dict with the marker as its text, split where the marker's JSON string stands."""

    def __init__(self, head: dict, chunk: Callable):
        choice = chunk(0, Choice(text=[_MARK]))
        self.prefix, mark, self.suffix = sse_data({**head, "choices": [choice]}).partition(
            json.dumps(_MARK))
        assert mark and _MARK not in self.suffix, "the text must appear once in a chunk"

    def __call__(self, text: str) -> str:
        return self.prefix + json_line(text) + self.suffix


async def sse_events(gens: list[Generation], n: int, chunk: Callable, head: dict,
                     first_delta: dict | None, plain: bool, include_usage: bool,
                     continuous_usage: bool, deadline: float | None,
                     timed_out: Callable[[], APIError], prompt_ids: list[list[int]] | None = None
                     ) -> AsyncIterator[str]:
    """The request's SSE events: `n` samples of each generation, until `deadline`. `plain`:
    `chunk` is Shapes' completion or chat choice without logprobs, so a chunk that is only text
    is the frame with its text in. `prompt_ids` (return_token_ids): each generation's prompt,
    sent once per choice with its first chunk, where vLLM sends it: chat's beside the choice in
    the role chunk, a completion's in the choice."""
    stream = gens[0].stream(deadline) if len(gens) == 1 else merged(gens, n, deadline)
    try:
        # choice -> its prompt ids, popped by the first chunk that sends the choice
        due = ({i: {"prompt_token_ids": prompt_ids[i // n]} for i in range(len(gens) * n)}
               if prompt_ids is not None else {})
        if first_delta is not None:
            for i in range(len(gens) * n):
                choice = {"index": i, "delta": first_delta, "logprobs": None, "finish_reason": None}
                yield sse_data({**head, **due.pop(i, {}), "choices": [choice]})
        one = plain and len(gens) * n == 1 and not continuous_usage
        frame = Frame(head, chunk) if one else None
        sent: dict[int, int] = {}  # choice -> characters of its text sent (logprobs' offsets)
        async for batch in stream:
            if frame is not None and all(out.finish_reason is None for out in batch):
                yield frame("".join([out.new_text for out in batch]))
                continue
            by_choice: dict[int, Choice] = {}
            for out in batch:
                if out.index not in by_choice:
                    by_choice[out.index] = Choice(offset=sent.get(out.index, 0))
                by_choice[out.index].add(out)
            if not plain:  # only logprobs' text_offset reads it
                for i, c in by_choice.items():
                    sent[i] = c.offset + sum(map(len, c.text))
            choices = [{**chunk(i, c), **due.pop(i, {})} for i, c in sorted(by_choice.items())]
            # vLLM's continuous_usage_stats: the running usage on every chunk
            extra = {"usage": usage(gens)} if continuous_usage else {}
            yield sse_data({**head, "choices": choices, **extra})
        if include_usage:
            yield sse_data({**head, "choices": [], "usage": usage(gens)})
    except (APIError, DeadlinePassed) as exc:  # e.g. every worker tried was lost: 503
        error = exc if isinstance(exc, APIError) else timed_out()
        # counted as http_app counts the errors answered before a stream starts
        gens[0].d.metrics.inc("request_errors", str(error.status))
        yield sse_data(error.body())
    finally:
        await stream.aclose()  # a client gone: the abort is counted before the close
        await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)
    yield "data: [DONE]\n\n"


async def merged(gens: list[Generation], n: int, deadline: float | None
                 ) -> AsyncIterator[list[SequenceOutput]]:
    """The batches of several generations as they arrive, generation i's sample j as i * n + j."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for batch in g.stream(deadline):
                await queue.put((i, batch))
            await queue.put((i, None))  # this generation is done
        except Exception as exc:  # noqa: BLE001 - re-raised by the reader
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield [replace(out, index=i * n + out.index) for out in item]
    finally:
        for t in tasks:
            t.cancel()
