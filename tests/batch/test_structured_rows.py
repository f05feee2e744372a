"""Batch rows with constraints: the same fields as HTTP (they go through the same frontend), on
the real default model (fp32, greedy) in this process, no Ray."""
from __future__ import annotations

import asyncio
import json

from batch_inputs import read_output, write_lines
from raypaged.batch import BatchOptions
from raypaged.batch.job import BatchJob
from raypaged.config import EngineArgs
from raypaged.engine import Engine
from raypaged.serve.config import ServeOptions
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.metrics import RequestMetrics
from raypaged.serve.routing import Router
from raypaged.serve.fleet import READY, FleetSnapshot, WorkerView
from raypaged.serve.worker import Worker
from tests.serve.local_link import LocalLink, LocalLinks

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Give me a person as JSON with name and age."}]


class OneWorker:
    """A FleetClient over one in-process Worker (local_pool's FlakyWorker assumes the fake
    engine's byte tokenizer)."""

    def __init__(self, worker: Worker):
        self.worker, self._links = worker, LocalLinks()

    def snapshot(self) -> FleetSnapshot:
        return FleetSnapshot(1, (WorkerView("w0", READY, self.worker, self.worker.stats()),))

    def link(self, view) -> LocalLink:
        return self._links.link(view, LocalLink)


class RealPool:
    def __init__(self, model_dir):
        engine = Engine.from_args(EngineArgs(model=str(model_dir), dtype="float32",
                                         kv_memory_mb=64, max_model_len=1024))
        self.worker = Worker(engine, "w0")
        info = ModelInfo(engine.model_name, engine.max_model_len, len(engine.tokenizer), 0)
        dispatcher = Dispatcher(OneWorker(self.worker),
                                Router(ServeOptions(), engine.block_size), RequestMetrics())
        self.frontend = OpenAIFrontend(dispatcher, engine.tokenizer, info)
        self.block_size = engine.block_size

    def check_alive(self) -> None:
        pass

    async def stop(self) -> None:
        self.worker.shutdown()


def test_batch_rows_take_response_format_structured_outputs_and_tools(tmp_path,
                                                                        default_model_dir):
    rows = [
        {"custom_id": "schema", "messages": ASK, "temperature": 0, "max_tokens": 60,
         "response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                                                    "schema": PERSON}}},
        {"custom_id": "choice", "messages": ASK, "temperature": 0, "max_tokens": 8,
         "sampling_params": {"structured_outputs": {"choice": ["yes", "no"]}}},
        {"custom_id": "regex", "prompt": "A phone number: ", "temperature": 0,
         "max_tokens": 20, "structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
        {"custom_id": "bad", "prompt": "x", "structured_outputs": {"regex": "a("}},
    ]
    inp = write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in rows])
    job = BatchJob(inp, tmp_path / "out.jsonl",
                   options=BatchOptions(workers=1, max_inflight=4, prefix_grouping=False))
    pool = RealPool(default_model_dir)

    async def start(serve_args):
        return pool
    job.start_pool = start
    asyncio.run(job.run())
    out = {o["custom_id"]: o for o in read_output(tmp_path / "out.jsonl")}
    body = {k: o["response"]["body"] for k, o in out.items()}
    assert body["schema"]["choices"][0]["message"]["content"] == \
        '{\n  "name": "John",\n  "age": 25\n}'
    assert body["choice"]["choices"][0]["message"]["content"] == "no"
    assert body["regex"]["choices"][0]["text"] == "123-4567"
    assert out["bad"]["response"]["status_code"] == 400
    assert "parenthesis is not closed" in out["bad"]["response"]["body"]["error"]["message"]
