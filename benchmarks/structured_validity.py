"""Structured outputs validity through the official OpenAI client, a worker killed mid-stream.

    .venv/bin/python benchmarks/structured_validity.py [--rounds 2] [--concurrency 8]
                                                       [--kill-streams 16] [--max-tokens 200]

Issue 29's target: on a private set of schemas and prompts sent through the official OpenAI
client (`response_format` with a pydantic model, `tools` with `tool_choice="required"`), 100%
of the outputs parse and validate against their schema, including requests whose worker is
killed mid-stream.

One `raypaged serve --workers 2` (the default model, fp32). The set: SCHEMAS below, nine pydantic
models of varied shape (nested objects, enums and literals, lists with bounds, optional fields,
numbers with bounds, a date pattern), each with its prompt, sampled (temperature 0.7, a seed per
request) so the constraint and not greedy luck decides the shape. Each is sent four ways:

    parse          client.chat.completions.parse(response_format=Model)
    parse_stream   client.chat.completions.stream(response_format=Model), the SDK's accumulation
    tools          parse(tools=[pydantic_function_tool(Model)], tool_choice="required")
    tools_stream   the same, streamed

Phase `steady`: every (model, way) --rounds times at --concurrency. Phase `kill`: --kill-streams
streamed requests (both streamed ways, over the models) at once; when most have their first
chunks, the worker that serves the most of them is SIGKILLed (its pid from /fleet, as
benchmarks/chaos.py does); they must go on on the other worker (the continuation mechanism:
grammar state replayed from the output tokens) and still validate.

Each request counts once: ok (parsed, and every output validates with Model.model_validate_json
on the raw text), failed (the reason: invalid JSON/schema, cut by max_tokens, an error), or
refused (4xx). Writes benchmarks/results/structured_validity.json and .png.
"""
from __future__ import annotations

import argparse
import asyncio
import enum
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Literal, Optional

import httpx
import openai
import pydantic
from pydantic import Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.serve_process import launch, stop  # noqa: E402

SERVED = "default-model"
WORKER_HEADER = "x-raypaged-worker"
Name = Field(max_length=40)  # bounded strings: a 135M model sampled may otherwise ramble
Short = Annotated[str, Field(max_length=30)]


class Person(pydantic.BaseModel):
    name: str = Name
    age: int = Field(ge=0, le=120)
    email: Optional[str] = Field(default=None, max_length=40)


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Weather(pydantic.BaseModel):
    city: str = Name
    unit: Unit
    temperature: float = Field(ge=-60, le=60)
    conditions: Literal["sunny", "cloudy", "rain", "snow"]


class Item(pydantic.BaseModel):
    sku: str = Field(max_length=12)
    quantity: int = Field(ge=1, le=10)


class Order(pydantic.BaseModel):
    order_id: int = Field(ge=1)
    items: list[Item] = Field(min_length=1, max_length=3)
    total: float = Field(ge=0, le=10000)
    paid: bool


class Event(pydantic.BaseModel):
    title: str = Name
    date: str = Field(pattern=r"^\d{4}-\d{2}-\d{2}$")
    attendees: list[Short] = Field(max_length=3)
    location: Optional[str] = Field(default=None, max_length=40)


class Review(pydantic.BaseModel):
    rating: int = Field(ge=1, le=5)
    pros: list[Short] = Field(max_length=2)
    cons: list[Short] = Field(max_length=2)
    recommended: bool


class Ingredient(pydantic.BaseModel):
    name: str = Name
    grams: float = Field(ge=0, le=2000)


class Recipe(pydantic.BaseModel):
    name: str = Name
    servings: int = Field(ge=1, le=12)
    ingredients: list[Ingredient] = Field(min_length=1, max_length=3)
    vegetarian: bool


class Stats(pydantic.BaseModel):
    strength: int = Field(ge=1, le=20)
    agility: int = Field(ge=1, le=20)
    intellect: int = Field(ge=1, le=20)


class Character(pydantic.BaseModel):
    name: str = Name
    role: Literal["warrior", "mage", "rogue"]
    stats: Stats
    inventory: list[Short] = Field(max_length=3)
    level: Optional[int] = Field(default=None, ge=1, le=99)


class Classification(pydantic.BaseModel):
    label: Literal["spam", "not_spam"]
    confidence: float = Field(ge=0, le=1)
    reasons: list[Short] = Field(max_length=2)


SCHEMAS: list[tuple[type[pydantic.BaseModel], str]] = [
    (Person, "Invent a person: a name, an age and maybe an email."),
    (Weather, "Report the weather in Oslo today."),
    (Order, "Create an order of two products for a small shop."),
    (Event, "Plan a team lunch next month with up to three attendees."),
    (Review, "Review a pair of running shoes."),
    (Recipe, "Give a short pancake recipe."),
    (Character, "Create a fantasy game character."),
    (Classification, "Is this email spam? 'You won a free cruise, click here now!'"),
    (Ingredient, "Name one baking ingredient and its weight in a cake."),
]
WAYS = ("parse", "parse_stream", "tools", "tools_stream")


async def one(client: openai.AsyncOpenAI, model: type[pydantic.BaseModel], prompt: str,
              way: str, seed: int, args, started: dict | None = None) -> dict:
    """One request, counted: {"outcome": ok | failed | refused, "why", "chunks", ...}."""
    body = dict(model=SERVED, messages=[{"role": "user", "content": prompt}],
                max_tokens=args.max_tokens, temperature=args.temperature, seed=seed,
                extra_headers={"x-bench-id": str(seed)})
    if way.startswith("tools"):
        body.update(tools=[openai.pydantic_function_tool(model)], tool_choice="required",
                    parallel_tool_calls=args.parallel_tool_calls)
    else:
        body.update(response_format=model)
    out = {"schema": model.__name__, "way": way, "seed": seed, "chunks": 0}
    t0 = time.monotonic()
    try:
        if way.endswith("stream"):
            body["stream_options"] = {"include_usage": True}
            async with client.chat.completions.stream(**body) as stream:
                async for event in stream:
                    if event.type == "chunk":
                        out["chunks"] += 1
                        if started is not None:
                            started[seed] = out["chunks"]
                completion = await stream.get_final_completion()
        else:
            completion = await client.chat.completions.parse(**body)
        choice = completion.choices[0]
        out["finish_reason"] = choice.finish_reason
        out["tokens"] = completion.usage.completion_tokens if completion.usage else None
        out["tail"] = (choice.message.content or "")[-80:] or [
            c.function.arguments[-80:] for c in choice.message.tool_calls or ()]
        if choice.finish_reason == "length":  # the stream helper does not raise for it
            raise openai.LengthFinishReasonError(completion=completion)
        if way.startswith("tools"):
            calls = choice.message.tool_calls or []
            if not calls:
                raise ValueError(f"no tool call (content {choice.message.content!r:.80})")
            texts = [c.function.arguments for c in calls]
        else:
            texts = [choice.message.content or ""]
        for text in texts:  # the raw text, not only the SDK's parse of it
            model.model_validate_json(text)
        out["outcome"], out["why"] = "ok", ""
    except openai.LengthFinishReasonError as exc:
        out["outcome"], out["why"] = "failed", f"cut at max_tokens {args.max_tokens}"
        message = exc.completion.choices[0].message
        out["tail"] = (message.content or "")[-80:] or [
            c.function.arguments[-80:] for c in message.tool_calls or ()]
    except pydantic.ValidationError as exc:
        out["outcome"], out["why"] = "failed", f"invalid: {str(exc).splitlines()[0][:120]}"
    except openai.APIStatusError as exc:
        kind = "refused" if 400 <= exc.status_code < 500 else "failed"
        out["outcome"], out["why"] = kind, f"{exc.status_code}: {str(exc.message)[:160]}"
    except Exception as exc:  # noqa: BLE001 - every request is counted, with its reason
        out["outcome"], out["why"] = "failed", f"{type(exc).__name__}: {str(exc)[:160]}"
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


async def gather_limited(jobs, concurrency: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)

    async def run(job):
        async with sem:
            return await job
    return await asyncio.gather(*(run(j) for j in jobs))


def fleet(url: str) -> list[dict]:
    return httpx.get(f"{url}/fleet", timeout=10).json()["workers"]


async def kill_phase(client, url: str, args, workers: dict[str, str], base_seed: int) -> dict:
    """--kill-streams streams at once; SIGKILL the worker serving most of them mid-stream."""
    started: dict[int, int] = {}
    jobs = []
    for k in range(args.kill_streams):
        model, prompt = SCHEMAS[k % len(SCHEMAS)]
        way = ("parse_stream", "tools_stream")[k % 2]
        jobs.append(asyncio.create_task(one(client, model, prompt, way, base_seed + k, args,
                                            started)))
    deadline = time.monotonic() + args.kill_wait_s
    while (sum(n >= 3 for n in started.values()) < args.kill_streams // 2
           and time.monotonic() < deadline and not all(j.done() for j in jobs)):
        await asyncio.sleep(0.2)
    by_worker = Counter(workers.get(str(s)) for s, n in started.items()
                        if n and not jobs[s - base_seed].done())
    by_worker.pop(None, None)
    kill = {"streams_started": len(started), "streams_running_by_worker": dict(by_worker)}
    if by_worker:
        victim = by_worker.most_common(1)[0][0]
        pid = {w["worker_id"]: w.get("pid") for w in await asyncio.to_thread(fleet, url)}[victim]
        os.kill(pid, signal.SIGKILL)
        kill.update(worker=victim, pid=pid, at_s=round(time.monotonic(), 2),
                    streams_on_it=by_worker[victim],
                    chunks_before_kill={s: started[s] for s in started
                                        if workers.get(str(s)) == victim})
        print(f"killed {victim} (pid {pid}) with {by_worker[victim]} of the streams on it",
              flush=True)
    else:
        kill["worker"] = None
        print("no stream was running when the kill was due: nothing killed", flush=True)
    results = await asyncio.gather(*jobs)
    for r in results:
        r["on_killed_worker"] = kill["worker"] is not None and \
            workers.get(str(r["seed"])) == kill["worker"]
    return {"kill": kill, "results": results}


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for phase in dict.fromkeys(r["phase"] for r in results):
        for way in WAYS:
            rs = [r for r in results if r["phase"] == phase and r["way"] == way]
            if rs:
                rows.append(row(phase, way, rs))
        rows.append(row(phase, "all", [r for r in results if r["phase"] == phase]))
    killed = [r for r in results if r.get("on_killed_worker")]
    if killed:
        rows.append(row("kill", "on the killed worker", killed))
    return rows


def row(phase: str, way: str, rs: list[dict]) -> dict:
    n = Counter(r["outcome"] for r in rs)
    return {"phase": phase, "way": way, "requests": len(rs), "ok": n["ok"],
            "failed": n["failed"], "refused": n["refused"],
            "valid_pct": round(100 * n["ok"] / len(rs), 1),
            "mean_tokens": round(sum(r.get("tokens") or 0 for r in rs) / len(rs), 1)}


def plot(rows: list[dict], name: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in rows if r["way"] != "all"]
    labels = [f"{r['phase']}\n{r['way']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    bottom = [0] * len(rows)
    for key, color in (("ok", "tab:green"), ("failed", "tab:red"), ("refused", "tab:orange")):
        vals = [r[key] for r in rows]
        ax.bar(labels, vals, bottom=bottom, color=color, label=key)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("requests")
    ax.set_title("structured outputs through the OpenAI client: parsed and valid")
    ax.legend()
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(plot_path(name))


async def run_all(url: str, args) -> dict:
    workers: dict[str, str] = {}  # x-bench-id -> the worker that answered it

    async def seen(response: httpx.Response) -> None:
        bench_id = response.request.headers.get("x-bench-id")
        if bench_id is not None and WORKER_HEADER in response.headers:
            workers[bench_id] = response.headers[WORKER_HEADER].split(",")[0]

    http = httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s),
                             event_hooks={"response": [seen]})
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", http_client=http,
                                max_retries=0)
    t0 = time.monotonic()
    jobs = [one(client, model, prompt, way, seed=args.seed_base + 1000 * r + 10 * i + k,
                args=args)
            for r in range(args.rounds) for i, (model, prompt) in enumerate(SCHEMAS)
            for k, way in enumerate(WAYS)]
    steady = await gather_limited(jobs, args.concurrency)
    for r in steady:
        r["phase"] = "steady"
    steady_s = time.monotonic() - t0
    print(f"steady: {len(steady)} requests in {steady_s:.0f} s", flush=True)
    t1 = time.monotonic()
    killed = await kill_phase(client, url, args, workers, base_seed=args.seed_base + 100_000) \
        if args.kill_streams else {"kill": None, "results": []}
    for r in killed["results"]:
        r["phase"] = "kill"
    await http.aclose()
    for r in steady + killed["results"]:
        r["worker"] = workers.get(str(r["seed"]))
    return {"results": steady + killed["results"], "kill": killed["kill"],
            "steady_s": round(steady_s, 1), "kill_s": round(time.monotonic() - t1, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="steady: each (schema, way) this often")
    ap.add_argument("--concurrency", type=int, default=8, help="steady phase")
    ap.add_argument("--kill-streams", type=int, default=16, help="0: no kill phase")
    ap.add_argument("--kill-wait-s", type=float, default=300,
                    help="kill once half the streams have 3 chunks, or after this long")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--request-timeout-s", type=float, default=900)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-parallel-tool-calls", dest="parallel_tool_calls", action="store_false",
                    help="send parallel_tool_calls=false: one call per tools request")
    ap.add_argument("--seed-base", type=int, default=0,
                    help="added to every request's seed: another sample of the same workload")
    ap.add_argument("--name", default="structured_validity")
    args = ap.parse_args()

    from raypaged.model.setup import resolve_model_dir
    model_dir = str(resolve_model_dir(None))
    log = Path(tempfile.mkdtemp(prefix="structured_validity-")) / "serve.log"
    load_before = os.getloadavg()
    proc, url = launch(["--model", model_dir, "--dtype", args.dtype, "--served-model-name",
                        SERVED, "--max-model-len", "1024", "--workers", str(args.workers)], log)
    try:
        out = asyncio.run(run_all(url, args))
    finally:
        stop(proc)
    load_after = os.getloadavg()
    rows = summarize(out["results"])
    print(f"\n{len(SCHEMAS)} schemas x {len(WAYS)} ways, {args.rounds} round(s) at concurrency "
          f"{args.concurrency}, then {args.kill_streams} streams with a worker killed; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; log {log}")
    print(table(rows, ["phase", "way", "requests", "ok", "failed", "refused", "valid_pct",
                       "mean_tokens"]))
    bad = [r for r in out["results"] if r["outcome"] != "ok"]
    for r in bad:
        print(f"  {r['phase']} {r['way']} {r['schema']} seed {r['seed']}: {r['outcome']}: "
              f"{r['why']}")
    if out["kill"]:
        print(f"kill: {out['kill'].get('worker')} with {out['kill'].get('streams_on_it', 0)} "
              f"streams on it; {sum(r['outcome'] == 'ok' for r in out['results'] if r.get('on_killed_worker'))}"
              " of those valid")
    path = write(args.name, {"args": vars(args), "schemas": [m.__name__ for m, _ in SCHEMAS],
                             "load_avg_before": load_before, "load_avg_after": load_after,
                             "rows": rows, **out})
    plot(rows, args.name)
    print(f"wrote {path} and {plot_path(args.name)}")


if __name__ == "__main__":
    main()
