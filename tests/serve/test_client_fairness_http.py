"""Per-client fairness at the router, over real HTTP (uvicorn in a thread, one slow fake worker
whose KV cache holds 4 of the load requests, no Ray). Clients are told apart by their address:
each sends from a loopback address of its own (127.0.0.2, 127.0.0.3).

- fair admission: 8 requests of one client, then 2 of another: the second client's go to the
  worker ahead of the first's waiting ones (its share of the cache), not after all 8 (first come
  first served, the same run with fair_admission off);
- the cap: a client at max_requests_per_client gets 429 + Retry-After naming the setting, while
  another client is served;
- a request never closed (its stream never started) gives its place back once collected;
- one past its deadline while it waits gets 504 and leaves the gate.
"""
from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from starlette.applications import Starlette
from starlette.routing import Mount

from http_server import serving
from local_fleet import LocalFleet
from serve_testing import wait_for
from raypaged.core.sampling_params import SamplingParams
from raypaged.serve.client_gate import ClientGate
from raypaged.serve.config import ServeOptions
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.frontend import ModelInfo, OpenAIFrontend
from raypaged.serve.generation import Generation
from raypaged.serve.http_app import build_http_app
from raypaged.serve.metrics import RequestMetrics, render
from raypaged.serve.routing import Router

A, B = "127.0.0.2", "127.0.0.3"


def body(letter: str, max_tokens: int = 40) -> dict:
    # 200 prompt + 40 output tokens: 16 of the fake engine's 64 blocks, so 4 fit at once
    return {"model": "fake-model", "prompt": letter * 200, "max_tokens": max_tokens,
            "ignore_eos": True}


def make_app(fleet: LocalFleet, options: ServeOptions, dispatcher: Dispatcher | None = None,
             request_timeout_s: float | None = None):
    metrics = RequestMetrics()
    engine = next(iter(fleet.workers.values())).engine
    info = ModelInfo("fake-model", engine.max_model_len, len(engine.tokenizer), 0)
    if dispatcher is None:
        gate = ClientGate(options.max_requests_per_client, options.fair_admission,
                          fleet.snapshot, metrics)
        dispatcher = Dispatcher(fleet, Router(options, engine.block_size), metrics, gate=gate)
    frontend = OpenAIFrontend(dispatcher, engine.tokenizer, info,
                              request_timeout_s=request_timeout_s)
    app = build_http_app(frontend, fleet.snapshot, metrics,
                         lambda: render(fleet.snapshot(), metrics.snapshot(), info.name),
                         None, 1 << 20)
    return app, dispatcher.gate


def recording(fleet: LocalFleet) -> list[str]:
    """The letters of the prompts, in the order the worker's engine was given them."""
    order: list[str] = []
    engine = next(iter(fleet.workers.values())).engine
    add, lock = engine.add_request, threading.Lock()

    def add_request(request_id, prompt_token_ids, *args, **kw):
        with lock:
            order.append(chr(prompt_token_ids[0]))
        return add(request_id, prompt_token_ids, *args, **kw)
    engine.add_request = add_request
    return order


def post(url: str, source: str, payload: dict) -> httpx.Response:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60) as c:
        return c.post(url + "/v1/completions", json=payload)


def worker_order(fair: bool) -> tuple[list[str], list[int]]:
    """8 requests of A (letters a-h) sent one after another, then 2 of B (x, y): the order the
    worker got them in, and every status."""
    # 50 ms a step: the first requests run >= 2 s, long past the last one's arrival
    fleet = LocalFleet(n=1, step_delay_s=0.05)
    order = recording(fleet)
    app, gate = make_app(fleet, ServeOptions(fair_admission=fair))
    arrived, arrive = [], gate.admission.arrive
    gate.admission.arrive = lambda client, blocks: arrived.append(client) or arrive(client, blocks)
    try:
        with serving(app) as url, ThreadPoolExecutor(10) as pool:
            sent = []
            for i, (source, letter) in enumerate([(A, c) for c in "abcdefgh"] + [(B, "x")]
                                                 + [(B, "y")]):
                sent.append(pool.submit(post, url, source, body(letter)))
                # each in the gate before the next leaves: the arrival order is this one
                assert wait_for(lambda: len(arrived) == i + 1, 30, 0.005), "timed out"
            statuses = [f.result().status_code for f in sent]
    finally:
        fleet.shutdown()
    return order, statuses


def test_a_second_client_goes_ahead_of_the_first_clients_flood():
    order, statuses = worker_order(fair=True)
    assert statuses == [200] * 10
    # A alone holds at most 7/8 of the 64 blocks: 3 requests, and waits with the rest; B's
    # two go at once, x in the room kept for others, y within B's share (64 // 2 blocks)
    assert order == list("abc") + ["x", "y"] + list("defgh")


def test_without_fair_admission_they_are_served_first_come_first_served():
    order, statuses = worker_order(fair=False)
    assert statuses == [200] * 10
    assert order == list("abcdefgh") + ["x", "y"]


def test_a_client_at_its_cap_gets_429_with_retry_after_naming_the_setting():
    fleet = LocalFleet(n=1, step_delay_s=0.05)
    app, gate = make_app(fleet, ServeOptions(max_requests_per_client=2))
    try:
        with serving(app) as url, ThreadPoolExecutor(4) as pool:
            running = [pool.submit(post, url, A, body(c, max_tokens=50)) for c in "ab"]
            assert wait_for(lambda: gate.admission.in_flight[A] == 2, 30, 0.005), "timed out"
            refused = post(url, A, body("c"))
            other = post(url, B, body("x", max_tokens=4))  # another client: served meanwhile
            assert [f.result().status_code for f in running] == [200, 200]
            again = post(url, A, body("d", max_tokens=4))  # its requests done: room again
            metrics = httpx.get(url + "/metrics").text
    finally:
        fleet.shutdown()
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"] == {
        "message": "too many requests in flight from this client (2, the most one client may "
                   "have on this server): wait for one to finish, or raise the server's setting "
                   "max_requests_per_client (--max-requests-per-client; 0: no cap)",
        "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
    assert (other.status_code, again.status_code) == (200, 200)
    shed = 'raypaged:shed_requests_total{model_name="fake-model",reason="client_cap"} 1.0'
    assert shed in metrics
    assert gate.admission.in_flight == {}  # every ticket given back


def test_a_generation_never_closed_gives_its_place_back_once_collected():
    """A stream whose client left before its response started is never iterated, so never
    closed: its place in the gate comes back when it is collected, not never (here while it
    still runs: one finished on its worker gives it back then)."""
    fleet = LocalFleet(n=1, step_delay_s=0.05)
    gate = ClientGate(0, True, fleet.snapshot, RequestMetrics())
    dispatcher = Dispatcher(fleet, Router(ServeOptions(), 16), RequestMetrics(), gate=gate)

    async def main():
        g = Generation(dispatcher, "r", [97] * 10,
                       SamplingParams(max_tokens=200, ignore_eos=True), None, 0.0)
        await g.start()
        assert (gate.admission.num_admitted, gate.admission.admitted_blocks) == (1, 1 + 13)
        del g
        gc.collect()
        await asyncio.sleep(0)  # given back at the loop's next turn
        return gate.admission.num_admitted, gate.admission.admitted_blocks

    try:
        assert asyncio.run(main()) == (0, 0)
    finally:
        fleet.shutdown()


def test_workers_this_router_has_filled_go_last_in_the_routing_order():
    fleet = LocalFleet(n=3)  # 64 blocks each
    try:
        d = Dispatcher(fleet, Router(ServeOptions(), 16), RequestMetrics())
        snap = fleet.snapshot()
        d.opened("worker-0", 60)
        d.opened("worker-2", 64)
        order = ["worker-2", "worker-0", "worker-1"]
        assert d.room_first(order, snap, 4) == ["worker-0", "worker-1", "worker-2"]
        assert d.room_first(order, snap, 5) == ["worker-1", "worker-2", "worker-0"]
        d.opened("worker-2", 64, -1)  # its legs closed
        assert d.room_first(order, snap, 4) == order
    finally:
        fleet.shutdown()


def test_a_request_past_its_deadline_while_waiting_gets_504_and_gives_its_place_up():
    fleet = LocalFleet(n=1, step_delay_s=0.05)
    # one router (one dispatcher, one gate), two frontends: /load without a deadline, / with
    gate = ClientGate(256, True, fleet.snapshot, RequestMetrics())
    dispatcher = Dispatcher(fleet, Router(ServeOptions(), 16), RequestMetrics(), gate=gate)
    load_app, _ = make_app(fleet, ServeOptions(), dispatcher)
    app, _ = make_app(fleet, ServeOptions(), dispatcher, request_timeout_s=0.3)
    try:
        with serving(Starlette(routes=[Mount("/load", app=load_app), Mount("/", app=app)])
                     ) as url, ThreadPoolExecutor(4) as pool:
            # 3 hold 7/8 of the cache (A alone may hold no more): the 4th waits in the gate
            running = [pool.submit(post, url + "/load", A, body(c, max_tokens=50)) for c in "abc"]
            assert wait_for(lambda: gate.admission.num_admitted == 3, 30, 0.005), "timed out"
            waiting = post(url, A, body("d"))
            held = (dict(gate.admission.in_flight), gate.admission.num_admitted)
            assert [f.result().status_code for f in running] == [200, 200, 200]
    finally:
        fleet.shutdown()
    assert waiting.status_code == 504
    assert waiting.json()["error"]["code"] == "request_timeout"
    assert held == ({A: 3}, 3)  # the 4th left the gate; the 3 running kept their places



def test_a_request_without_max_tokens_counts_at_the_mean_output_seen_not_at_max_model_len():
    """Counted at the rest of max_model_len, a client that never sets max_tokens could run only
    a few requests at once; the gate counts it as the worker's admission projects it: one block
    before any request has finished here, then the mean output length seen."""
    fleet = LocalFleet(n=1)
    gate = ClientGate(0, True, fleet.snapshot, RequestMetrics())
    dispatcher = Dispatcher(fleet, Router(ServeOptions(), 16), RequestMetrics(), gate=gate)

    async def run(rid: str, max_tokens, ignore_eos=False) -> tuple[int, int]:
        g = Generation(dispatcher, rid, [97] * 20,
                       SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), None, 0.0)
        await g.start()
        blocks = g._ticket.blocks
        async for _ in g.stream():  # to its end: a finished request's length is recorded
            pass
        return blocks, g.num_output_tokens

    async def main():
        first = await run("a", 40, ignore_eos=True)
        second = await run("b", 72, ignore_eos=True)
        third = await run("c", None)
        return first, second, third

    try:
        first, second, third = asyncio.run(main())
    finally:
        fleet.shutdown()
    assert first == (2 + 3, 40) and second == (2 + 5, 72)  # prompt 20 tokens: 2 blocks
    assert third[0] == 2 + 4  # open: the mean seen, 56 tokens, not max_model_len's rest


def test_a_request_with_more_prompts_than_7_8_of_the_cache_holds_is_served_not_stuck():
    """4 prompts of one request, 16 of the 64 blocks each: 3 fit in the 7/8 one client may
    hold, the 4th waits for one of them to leave the gate. A prompt whose outputs are all in
    must give its place back then, not only when its whole request is read: the request's
    first 3 prompts are not read until the 4th has started, so it would wait for ever."""
    fleet = LocalFleet(n=1, step_delay_s=0.01)
    app, gate = make_app(fleet, ServeOptions(), request_timeout_s=10)
    try:
        with serving(app) as url:
            payload = dict(body("a"), prompt=[c * 200 for c in "abcd"])
            answer = post(url, A, payload)
    finally:
        fleet.shutdown()
    assert answer.status_code == 200, answer.text
    assert [c["index"] for c in answer.json()["choices"]] == [0, 1, 2, 3]
    assert gate.admission.in_flight == {} and gate.admission.num_admitted == 0
