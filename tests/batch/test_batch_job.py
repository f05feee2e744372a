"""Batch jobs on a real local Ray with the default model: formats, bad lines, bodies equal to
the HTTP API's, and exactly one line per input when an engine actor is killed mid-job."""
from __future__ import annotations

import asyncio

from batch_inputs import numbered_prompts, openai_line, read_output, write_lines
from batch_testing import ENGINE
from http_reference import http_answers
from raypaged.batch import BatchOptions, run_batch
from raypaged.batch.engines import fleet_args
from raypaged.batch.job import BatchJob
from raypaged.config import EngineArgs

C, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = {"temperature": 0, "max_tokens": 6}
HELLO = [{"role": "user", "content": "Say hello."}]

# (custom_id, url, body): rows that reach the frontend, good and bad
VIA_FRONTEND = [
    ("text", C, {"prompt": "The capital of France is", **GREEDY}),
    ("ids", C, {"prompt": [504, 3458, 282, 4649, 314], **GREEDY}),
    ("chat", CHAT, {"messages": HELLO, **GREEDY}),
    ("chat-stop", CHAT, {"messages": HELLO, "stop": ["!"], "temperature": 0, "max_tokens": 12}),
    ("bad-temperature", C, {"prompt": "x", "temperature": -1}),
    ("too-long", C, {"prompt": "hello " * 600, **GREEDY}),
    ("string-max-tokens", C, {"prompt": "x", "max_tokens": "5"}),
    ("unknown-model", C, {"prompt": "x", "model": "gpt-4o", **GREEDY}),
    ("empty-prompt", C, {"prompt": "", **GREEDY}),
    ("n-zero", CHAT, {"messages": HELLO, "n": 0}),
    ("no-messages", CHAT, {"messages": [], **GREEDY}),
]
PLAIN = [  # Ray Data LLM style rows, and the body each stands for
    ('{"prompt": "One, two, three,", "temperature": 0, "max_tokens": 6}',
     C, {"prompt": "One, two, three,", **GREEDY}),
    ('{"messages": [{"role": "user", "content": "Say hello."}], '
     '"sampling_params": {"temperature": 0, "max_tokens": 6}}', CHAT, {"messages": HELLO, **GREEDY}),
]
REFUSED_BEFORE = [  # (line, status, message) refused before the frontend
    ("not json", 400, "the line is not valid JSON: it does not parse"),
    ("[1]", 400, "a line must be a JSON object, got list"),
    ('{"url": "/v1/completions", "body": {"prompt": "x"}}', 400,
     "custom_id is required on an OpenAI batch line"),
    (openai_line("text", C, {"prompt": "again"}), 400,
     "custom_id 'text' is a duplicate of an earlier line's: give every line its own custom_id"),
    (openai_line("embed", "/v1/embeddings", {"input": "x"}), 404,
     "url '/v1/embeddings' is not supported: use one of ['/v1/completions', "
     "'/v1/chat/completions']"),
    ('{"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}', 400,
     'method must be "POST", got \'GET\''),
    ('{"prompt": "x", "temperature": NaN}', 400,
     "the line is not valid JSON: NaN is not a JSON number"),
    (openai_line("stream", C, {"prompt": "x", "stream": True}), 400,
     "stream is not supported in a batch: remove it or set it to false"),
]


def without_ids(body: dict) -> dict:
    """A response body minus what differs between any two calls (ids, time, cache state)."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    if "usage" in out:
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def test_both_formats_bad_lines_and_bodies_equal_to_the_http_api(local_ray, tmp_path):
    lines = [openai_line(cid, url, body) for cid, url, body in VIA_FRONTEND]
    lines += [line for line, _, _ in PLAIN] + [line for line, _, _ in REFUSED_BEFORE]
    inp = write_lines(tmp_path / "in.jsonl", lines)
    summary = run_batch(inp, tmp_path / "out.jsonl", EngineArgs(**ENGINE),
                        BatchOptions(workers=1, cpus_per_worker=1, max_inflight=4))

    out = {int(o["id"].removeprefix("batch_req_").split("_")[0]): o  # batch_req_<line>_<digest>
           for o in read_output(tmp_path / "out.jsonl")}
    assert sorted(out) == list(range(1, len(lines) + 1))  # one line per input line, no more

    expected = asyncio.run(http_answers(
        ENGINE, [(url, body) for _, url, body in VIA_FRONTEND] + [(u, b) for _, u, b in PLAIN]))
    n_front = len(VIA_FRONTEND)
    ids = [cid for cid, _, _ in VIA_FRONTEND] + [f"line-{n_front + 1}", f"line-{n_front + 2}"]
    for i, (status, body) in enumerate(expected, start=1):
        line = out[i]
        assert line["custom_id"] == ids[i - 1]
        assert line["response"]["status_code"] == status, (ids[i - 1], line, body)
        assert without_ids(line["response"]["body"]) == without_ids(body), ids[i - 1]
        assert (line["error"] is None) == (status == 200)
    statuses = [s for s, _ in expected]
    assert statuses == [200, 200, 200, 200, 400, 400, 400, 404, 400, 400, 400, 200, 200]
    assert out[4]["response"]["body"]["choices"][0]["finish_reason"] == "stop"

    for n, (_, status, message) in enumerate(REFUSED_BEFORE, start=len(expected) + 1):
        assert out[n]["response"]["status_code"] == status
        assert out[n]["error"]["message"] == f"line {n}: {message}"

    assert (summary.rows, summary.completed, summary.failed) == (len(lines), 6, len(lines) - 6)
    ok = [o["response"]["body"]["usage"] for o in out.values() if o["error"] is None]
    assert summary.completion_tokens == sum(u["completion_tokens"] for u in ok)
    assert summary.prompt_tokens == sum(u["prompt_tokens"] for u in ok)


def test_every_row_is_answered_once_when_an_engine_actor_is_killed(local_ray, tmp_path):
    import ray

    n = 24
    inp = write_lines(tmp_path / "in.jsonl", numbered_prompts(n, max_tokens=8))
    outp = tmp_path / "out.jsonl"
    options = BatchOptions(workers=2, cpus_per_worker=1, max_inflight=2)  # 4 of 24 in flight
    job = BatchJob(inp, outp, EngineArgs(**ENGINE), options)
    killed = {}

    async def kill_one_worker_mid_job(run: asyncio.Task):
        while not (outp.exists() and len(outp.read_text().splitlines()) >= 4):
            await asyncio.sleep(0.05)
        snap = await job.pool.controllers.handle.snapshot.remote()
        busiest = max(snap.workers, key=lambda w: w.load)
        killed["written"] = len(outp.read_text().splitlines())
        ray.kill(busiest.handle, no_restart=False)  # a crash: Ray restarts the actor
        while not run.done():  # the job may well finish on the other engine first
            try:
                snap = await job.pool.controllers.handle.snapshot.remote()
            except ray.exceptions.RayActorError:  # the job ended and stopped its engines
                return
            if snap.worker(busiest.worker_id).restarts >= 1:
                killed["restarted"] = True
                return
            await asyncio.sleep(0.2)

    async def main():
        run = asyncio.create_task(job.run(fleet_args(job.engine, options)))
        await kill_one_worker_mid_job(run)
        return await run

    summary = asyncio.run(main())
    assert killed["written"] < n  # the kill came mid-job
    lines = read_output(outp)
    assert sorted(o["custom_id"] for o in lines) == sorted(f"r{i}" for i in range(n))
    assert all(o["response"]["status_code"] == 200 for o in lines)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 8 for o in lines)
    assert (summary.completed, summary.failed) == (n, 0)
