"""The quarantine (raypaged/serve/quarantine.py) without Ray: a request retried after its worker
died goes where no other such request runs, so the culprit's second victim takes nobody with it
(fake engines over HTTP in-process)."""
from __future__ import annotations

import asyncio
import json

from local_fleet import LocalFleet, client_for, local_app
from test_worker_lifecycle import BODY, events, post, record_submits, run_all


def _beside_the_culprit(monkeypatch, quarantine: bool):
    """On 2 workers a stream and a crashing request run on one worker, which the crash kills
    and the fleet restarts: (the stream's response, the crashing one's, the metrics, a clean
    run's text of the stream)."""
    import raypaged.serve.generation as generation
    if not quarantine:  # a wait that is over at once: every retry goes where the ranking says
        monkeypatch.setattr(generation, "ALONE_WAIT_S", 0.0)
    stream = {**BODY, "prompt": "an innocent prompt beside the culprit", "max_tokens": 60,
              "stream": True}
    culprit = {**BODY, "prompt": "a prompt that crashes every worker it runs on", "seed": 42,
               "max_tokens": 60}
    (clean,), _ = run_all(LocalFleet(n=2, step_delay_s=0.02), post({**stream, "stream": False}))
    fleet = LocalFleet(n=2, step_delay_s=0.02, restart_on_death=True)
    fleet.crash_seed = 42  # not fake_engine.CRASH_SEED: that one exits this process
    home, other = sorted(fleet.workers)
    fleet.drained.add(other)  # both start on home
    app, metrics = local_app(fleet)

    sent = []
    record_submits(fleet.workers[home], home, sent)

    async def main():
        async with client_for(app) as client:  # whole responses: ASGITransport buffers them
            streaming = asyncio.create_task(client.post("/v1/completions", json=stream))
            while not sent:  # it runs on home
                await asyncio.sleep(0.002)
            crashing = asyncio.create_task(client.post("/v1/completions", json=culprit))
            while not fleet.crash_sent_to:  # sent to home; it kills it CRASH_AT steps later
                await asyncio.sleep(0.002)
            fleet.drained.discard(other)
            while home not in fleet.restarting:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.5)  # both wait for home's restart (failover.py)
            fleet.restart(home)
            return await streaming, await crashing
    try:
        streamed, crashed = asyncio.run(main())
    finally:
        fleet.shutdown()
    return events(streamed), crashed, metrics, clean.json()["choices"][0]["text"]


def test_a_request_beside_the_culprit_is_retried_apart_from_it_and_served(monkeypatch):
    ev, crashed, metrics, clean_text = _beside_the_culprit(monkeypatch, quarantine=True)
    assert crashed.status_code == 400
    assert crashed.json()["error"]["code"] == "suspected_poison_request"
    assert ev[-1] == "[DONE]"
    chunks = [json.loads(e) for e in ev[:-1]]
    assert not [c for c in chunks if "error" in c]
    assert "".join(c["choices"][0]["text"] for c in chunks) == clean_text
    assert metrics.counters["suspected_poison_requests"] == {"refused": 1.0}
    assert metrics.counters["request_retries"] == {"": 2.0}  # both lost home


def test_without_the_quarantine_the_request_beside_the_culprit_is_refused_with_it(monkeypatch):
    # what the quarantine prevents: both retried on the one other worker, which the culprit
    # kills too, so both lost two workers
    ev, crashed, metrics, _ = _beside_the_culprit(monkeypatch, quarantine=False)
    assert crashed.json()["error"]["code"] == "suspected_poison_request"
    assert json.loads(ev[-2])["error"]["code"] == "suspected_poison_request"
    assert metrics.counters["suspected_poison_requests"] == {"refused": 2.0}
