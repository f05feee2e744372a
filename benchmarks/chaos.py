"""Chaos benchmark: steady mixed load on `raypaged serve` while the fleet is broken on purpose.

    python benchmarks/chaos.py [--workers 2] [--concurrency 6] [--phase-s 20] [--phases ...]

Launches `raypaged serve` (default model, small KV budget), keeps --concurrency clients sending
greedy requests (alternately streaming and not, `max_tokens` 24, ignore_eos; after a failure a
client waits 1 s, as Retry-After says) and, one phase after another, with --phase-s of load
between them:
    kill_worker        SIGKILL of the busiest worker's process (Ray restarts it)
    freeze_worker      SIGSTOP of the busiest worker for 10 s, then SIGCONT
    poison             the issue's poison requests (stop token id out of the vocabulary, huge
                       top_k) and malformed ones, sent beside the load
    expensive          well-formed requests that ask too much (benchmarks/limits_probe.py's:
                       20,000 prompts, a million stop_token_ids, ...), each refused by a limit
    big_bodies         8 parallel 8 MiB `[1,1,...]` bodies
    slow_bodies        200 connections that never finish their body (--body-timeout-s 5)
    kill_controller    SIGKILL of the fleet controller actor (its workers outlive it; Serve
                       recreates it and the new one adopts them)
    hang_worker        SIGSTOP of the busiest worker, never thawed: the controller must kill it
                       and Ray start a new process within --unresponsive-timeout-s of it
                       turning unresponsive
    crash_twice        a long stream whose worker is SIGKILLed, then the worker it moved to as
                       soon as it goes on there, as a request that crashes workers would: the
                       stream must end as a suspected poison request, and the same request sent
                       again must be refused at once with no worker touched (with 2 workers both
                       are then down for a model reload: load requests fail meanwhile)
and prints and writes (benchmarks/results/chaos.json, .png): requests sent, completed, failed by
status, lost (a 200 with fewer tokens than asked, or a stream without [DONE]), hung (no answer
in 120 s), per phase the load requests in the air that completed and that failed, collateral
failures of the poison phase (load requests failing while only poison was in the air), each
phase's recovery time (fault -> the fleet noticed it and has all its workers ready again;
fault -> the first load request started after it completing; for the controller, fault -> a
new controller process, and whether the workers kept their processes), preemptions, and the
status codes of the malformed and poison replies. Bounded: ~4 phases x (phase-s + recovery).
--phases runs a subset (write it under another --name: chaos.json holds the full run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.limits_probe import ATTACKS, slow_body  # noqa: E402
from benchmarks.serve_process import descendants, launch, stop  # noqa: E402

MAX_TOKENS = 24
PHASES = ("kill_worker", "freeze_worker", "poison", "expensive", "big_bodies", "slow_bodies",
          "kill_controller", "hang_worker", "crash_twice")
BODY_TIMEOUT_S = 5
CLIENT_TIMEOUT_S = 120
POISON = [
    {"prompt": "hi", "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [99999999]},
    {"prompt": "hi", "max_tokens": 2, "top_k": 100000000000000000000},
    {"prompt": "hi", "max_tokens": 2, "top_k": 2 ** 63},
]
MALFORMED = [
    "{not json", "[]", "null", '{"prompt": 5}', '{"prompt": "hi", "max_tokens": -1}',
    '{"prompt": "hi", "temperature": NaN}', '{"prompt": "hi", "temperature": Infinity}',
    '{"prompt": "hi", "temperature": 1e400}', '{"prompt": "hi", "n": 0}',
    '{"prompt": "hi", "top_p": 2}', '{"prompt": [[-1]]}', '{"prompt": "\\ud800"}',
    '{"prompt": "hi", "stop_token_ids": [-5]}', '{"prompt": "hi", "repetition_penalty": 1e400}',
    '{"prompt": "hi", "logprobs": 99}', '{"model": "nope", "prompt": "hi"}',
    '{"prompt": "hi", "max_tokens": 100000000}', '{"prompt": "hi", "stream": "yes"}',
    "[" * 100000 + "]" * 100000,
]


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


def fleet(url: str) -> list[dict]:
    try:
        return httpx.get(f"{url}/fleet", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def preemptions(url: str) -> float:
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "raypaged:num_preemptions" for s in f.samples)


async def wait_all_ready(url: str, n: int, since: float, limit_s: float) -> float | None:
    """Seconds from `since` until n workers are ready again, after the fleet has noticed the
    fault (None: not within limit_s). A fault the fleet never notices within 10 s counts as
    recovered when noticed-or-not is decided: at 10 s."""
    while time.monotonic() - since < 10:
        if sum(w["state"] == "ready" for w in await asyncio.to_thread(fleet, url)) < n:
            break
        await asyncio.sleep(0.1)
    while time.monotonic() - since < limit_s:
        if sum(w["state"] == "ready" for w in await asyncio.to_thread(fleet, url)) >= n:
            return time.monotonic() - since
        await asyncio.sleep(0.25)
    return None


def controller_pids(root: int) -> list[int]:
    # comm is cut at 15 characters: "ray::ControllerActor" reads "ray::Controller"
    return [p for p, n in descendants(root).items() if n.startswith("ray::Controller")]


async def new_controller(root: int, killed: list[int], since: float,
                         limit_s: float) -> float | None:
    """Seconds from `since` until a controller process other than the killed ones runs."""
    while time.monotonic() - since < limit_s:
        if set(await asyncio.to_thread(controller_pids, root)) - set(killed):
            return time.monotonic() - since
        await asyncio.sleep(0.25)
    return None


def busiest(url: str) -> dict:
    return max(fleet(url), key=lambda w: w.get("load", 0))


async def send_raw(url: str) -> dict:
    """Malformed and poison requests; status code -> count for each kind."""
    counts: dict[str, dict[str, int]] = {"malformed": {}, "poison": {}}
    async with httpx.AsyncClient(timeout=60) as client:
        for raw in MALFORMED:
            r = await client.post(f"{url}/v1/completions", content=raw.encode(),
                                  headers={"content-type": "application/json"})
            counts["malformed"][str(r.status_code)] = counts["malformed"].get(str(r.status_code), 0) + 1
        for body in POISON * 3:
            r = await client.post(f"{url}/v1/completions", json=body)
            counts["poison"][str(r.status_code)] = counts["poison"].get(str(r.status_code), 0) + 1
    return counts


async def health_max(url: str, work) -> tuple[object, float]:
    """(what `work` returns, the slowest /health answer while it ran)."""
    stop_polling = asyncio.Event()

    async def poll() -> float:
        worst = 0.0
        async with httpx.AsyncClient(timeout=60) as client:
            while not stop_polling.is_set():
                t = time.monotonic()
                await client.get(f"{url}/health")
                worst = max(worst, time.monotonic() - t)
                await asyncio.sleep(0.1)
        return worst

    poller = asyncio.create_task(poll())
    try:
        result = await work
    finally:
        stop_polling.set()
    return result, await poller


async def send_expensive(url: str) -> dict:
    """Each over-limit request once: its status and seconds."""
    out = {}
    async with httpx.AsyncClient(timeout=60) as client:
        for name, (path, body) in ATTACKS.items():
            t = time.monotonic()
            r = await client.post(f"{url}/v1/{path}", content=json.dumps(body).encode(),
                                  headers={"content-type": "application/json"})
            out[name] = {"status": r.status_code, "seconds": round(time.monotonic() - t, 3)}
    return out


async def send_big_bodies(url: str, n: int = 8) -> dict:
    big = b'{"prompt":[' + b"1," * (4 * 2**20 - 16) + b"1]}"
    t = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as client:
        rs = await asyncio.gather(*(client.post(f"{url}/v1/completions", content=big,
                                                headers={"content-type": "application/json"})
                                    for _ in range(n)))
    return {"bodies": n, "statuses": sorted({r.status_code for r in rs}),
            "seconds": round(time.monotonic() - t, 2)}


async def send_slow_bodies(url: str, n: int = 200) -> dict:
    port = int(url.rsplit(":", 1)[1])
    t = time.monotonic()
    codes = await asyncio.gather(*(slow_body(port) for _ in range(n)))
    return {"connections": n, "got_408": sum(c == 408 for c in codes),
            "closed_within_s": round(time.monotonic() - t, 2), "body_timeout_s": BODY_TIMEOUT_S}


async def hang_worker(url: str, limit_s: float) -> tuple[str, dict]:
    """SIGSTOP the busiest worker for good; when the fleet saw it unresponsive, killed and
    replaced (seconds after the SIGSTOP)."""
    victim = busiest(url)
    wid, pid = victim["worker_id"], victim["pid"]
    os.kill(pid, signal.SIGSTOP)
    t, seen = time.monotonic(), {}
    try:
        while time.monotonic() - t < limit_s and "replaced_s" not in seen:
            w = next((w for w in await asyncio.to_thread(fleet, url) if w["worker_id"] == wid),
                     {})
            now = round(time.monotonic() - t, 2)
            if w.get("state") == "unresponsive":
                seen.setdefault("unresponsive_s", now)
            if w.get("kills", 0) > victim.get("kills", 0):
                seen.setdefault("killed_s", now)
            if w.get("state") == "ready" and w.get("pid") not in (None, pid):
                seen["replaced_s"] = now
            await asyncio.sleep(0.1)
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGCONT)
    if "unresponsive_s" in seen and "killed_s" in seen:
        seen["unresponsive_for_s"] = round(seen["killed_s"] - seen["unresponsive_s"], 2)
    return wid, seen


async def crash_twice(url: str, n: int, limit_s: float) -> tuple[str, dict]:
    """A stream whose two workers are killed in turn, then the same request again."""
    out: dict = {"all_ready_before_s": await wait_all_ready(url, n, time.monotonic(), limit_s)}
    body = {"prompt": "Chaos: a request that crashes workers. Tell a long story.",
            "max_tokens": 440, "ignore_eos": True, "temperature": 0, "stream": True}
    events: list[dict] = []
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S * 3) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            first = r.headers.get("x-raypaged-worker")

            async def read():
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))

            reader = asyncio.create_task(read())
            t = time.monotonic()
            while len(events) < 3 and not reader.done():
                await asyncio.sleep(0.05)
            pids = {w["worker_id"]: w.get("pid") for w in await asyncio.to_thread(fleet, url)}
            os.kill(pids[first], signal.SIGKILL)
            at_kill = len(events)
            # a model reload takes longer than the stream: the second worker goes as soon as
            # the stream goes on there
            while len(events) < at_kill + 3 and not reader.done():
                await asyncio.sleep(0.05)
            out["tokens_after_first_kill"] = len(events) - at_kill
            if reader.done():
                out["second_kill"] = "the stream ended first"
            else:
                second = max((w for w in await asyncio.to_thread(fleet, url)
                              if w["worker_id"] != first and w.get("state") == "ready"),
                             key=lambda w: w.get("load", 0))
                os.kill(second["pid"], signal.SIGKILL)
                out["second_kill"] = second["worker_id"]
            await asyncio.wait_for(reader, CLIENT_TIMEOUT_S)
        errors = [e["error"] for e in events if "error" in e]
        out["stream_tokens"] = sum(len(c.get("text", "")) > 0 for e in events
                                   for c in e.get("choices", []))
        out["stream_error"] = errors[-1]["code"] if errors else None
        t = time.monotonic()
        again = await client.post(f"{url}/v1/completions", json={**body, "stream": False})
        out["again"] = {"status": again.status_code, "seconds": round(time.monotonic() - t, 3),
                        "code": again.json().get("error", {}).get("code")}
    return first, out


async def scenario(proc, url: str, ns) -> dict:
    load = Load(url, ns.concurrency)
    runner = asyncio.create_task(load.run())
    phases, raw_counts = [], {}
    first_preemptions = await asyncio.to_thread(preemptions, url)
    # /health over the load alone: what the attacks' /health figures compare with
    _, baseline_health_s = await health_max(url, asyncio.sleep(ns.phase_s))
    for name in ns.phases:
        at = time.monotonic()
        detail, extra = "", {}
        if name == "kill_worker":
            victim = busiest(url)
            os.kill(victim["pid"], signal.SIGKILL)
            detail = victim["worker_id"]
        elif name == "freeze_worker":
            victim = busiest(url)
            os.kill(victim["pid"], signal.SIGSTOP)
            detail = victim["worker_id"]
            await asyncio.sleep(10)
            os.kill(victim["pid"], signal.SIGCONT)
        elif name == "poison":
            raw_counts = await send_raw(url)
        elif name == "hang_worker":
            (detail, extra), health_s = await health_max(url, hang_worker(url,
                                                                          ns.recovery_limit_s))
            extra.update(deadline_s=ns.unresponsive_timeout_s, health_max_s=health_s)
        elif name == "crash_twice":
            (detail, extra), health_s = await health_max(url, crash_twice(
                url, ns.workers, ns.recovery_limit_s))
            extra["health_max_s"] = health_s
        elif name in ("expensive", "big_bodies", "slow_bodies"):
            send = {"expensive": send_expensive, "big_bodies": send_big_bodies,
                    "slow_bodies": send_slow_bodies}[name]
            extra["answers"], extra["health_max_s"] = await health_max(url, send(url))
        else:
            workers_before = {w["worker_id"]: w.get("pid") for w in fleet(url)}
            controllers = controller_pids(proc.pid)
            for pid in controllers:
                os.kill(pid, signal.SIGKILL)
            detail = f"{len(controllers)} process(es)"
            extra["controller_back_s"] = await new_controller(proc.pid, controllers, at,
                                                              ns.recovery_limit_s)
        ready_s = await wait_all_ready(url, ns.workers, at, ns.recovery_limit_s)
        await asyncio.sleep(ns.phase_s)
        if name == "kill_controller":
            # the fleet as the new controller sees it (back well within phase-s): the same
            # worker processes, or new ones
            extra["worker_pids_unchanged"] = (
                {w["worker_id"]: w.get("pid") for w in fleet(url)} == workers_before)
        after = [o for o in load.outcomes if o.started >= at and o.ok]
        phases.append({"phase": name, "target": detail, "at": at,
                       "fleet_ready_s": ready_s,
                       "first_ok_request_s": min((o.ended - at for o in after), default=None),
                       **extra})
    load.stop()
    await asyncio.wait_for(runner, CLIENT_TIMEOUT_S + 30)
    return {"outcomes": load.outcomes, "phases": phases, "raw": raw_counts,
            "baseline_health_max_s": baseline_health_s,
            "preemptions": await asyncio.to_thread(preemptions, url) - first_preemptions}


def summarize(res: dict, t0: float) -> dict:
    outs: list[Outcome] = res["outcomes"]
    failed: dict[str, int] = {}
    for o in outs:
        if o.status not in ("200", "hung"):
            failed[o.status] = failed.get(o.status, 0) + 1
    poison = next((p for p in res["phases"] if p["phase"] == "poison"), None)
    collateral = []
    if poison is not None:
        window = (poison["at"], poison["at"] + 15)  # only poison in the air
        collateral = [o for o in outs if not o.ok and o.status != "hung"
                      and o.started < window[1] and o.ended > window[0]]
    phases = [{**p, "at_s": round(p["at"] - t0, 1)} for p in res["phases"]]
    ends = [p["at"] for p in res["phases"][1:]] + [float("inf")]
    for p, start, end in zip(phases, [p["at"] for p in res["phases"]], ends):
        del p["at"]
        # load requests that were in the air during this phase and failed
        p["failed"] = sum(not o.ok for o in outs if o.ended >= start and o.started < end)
        p["completed"] = sum(o.ok for o in outs if o.ended >= start and o.started < end)
    return {
        "sent": len(outs), "completed": sum(o.ok for o in outs), "failed_by_status": failed,
        "lost": sum(o.status == "200" and not o.ok for o in outs),
        "hung": sum(o.status == "hung" for o in outs),
        "collateral_poison_failures": len(collateral) if poison is not None else None,
        "preemptions": res["preemptions"], "phases": phases, "raw_requests": res["raw"],
        "baseline_health_max_s": res["baseline_health_max_s"]}


def plot(res: dict, t0: float, summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 3.6))
    outs = res["outcomes"]
    ax.scatter([o.ended - t0 for o in outs if o.ok], [o.ended - o.started for o in outs if o.ok],
               s=8, color="#4c72b0", label="completed")
    bad = [o for o in outs if not o.ok]
    ax.scatter([o.ended - t0 for o in bad], [o.ended - o.started for o in bad], s=20,
               color="#c44e52", marker="x", label="failed / lost / hung")
    for p in summary["phases"]:
        ax.axvline(p["at_s"], color="grey", linestyle="--")
        ax.text(p["at_s"], ax.get_ylim()[1] * 0.95, p["phase"], rotation=90, fontsize=8,
                va="top")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("request latency (s)")
    ax.legend(fontsize=8)
    ax.set_title("raypaged serve under chaos: each request's latency by when it finished")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--phase-s", type=float, default=20.0, help="load between faults")
    p.add_argument("--recovery-limit-s", type=float, default=120.0)
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES),
                   help="faults to inject, in this order (default: all)")
    p.add_argument("--unresponsive-timeout-s", type=float, default=10.0,
                   help="the server's --worker-unresponsive-timeout-s (hang_worker)")
    p.add_argument("--ingress", choices=("python", "haproxy"), default=None,
                   help="the server's --ingress (default: its default, Serve's Python proxy)")
    p.add_argument("--name", default="chaos")
    ns = p.parse_args(argv)
    log = Path(tempfile.gettempdir()) / f"{ns.name}_serve.log"
    flags = ["--workers", str(ns.workers), "--kv-memory-mb", "64", "--max-model-len", "512",
             "--body-timeout-s", str(BODY_TIMEOUT_S),
             "--worker-unresponsive-timeout-s", str(ns.unresponsive_timeout_s)]
    if ns.ingress is not None:
        flags += ["--ingress", ns.ingress]
    proc, url = launch(flags, log)
    try:
        t0 = time.monotonic()
        res = asyncio.run(scenario(proc, url, ns))
    finally:
        stop(proc)
    summary = summarize(res, t0)
    cols = ["sent", "completed", "failed_by_status", "lost", "hung",
            "collateral_poison_failures", "preemptions"]
    print(table([{**summary, "failed_by_status": json.dumps(summary["failed_by_status"])}], cols))
    print(table(summary["phases"], ["phase", "target", "at_s", "completed", "failed",
                                    "fleet_ready_s", "first_ok_request_s", "controller_back_s",
                                    "worker_pids_unchanged"]))
    print("malformed / poison replies by status:", json.dumps(summary["raw_requests"]))
    print(f"/health max over the load alone (before the first phase): "
          f"{summary['baseline_health_max_s']:.2f} s")
    for ph in summary["phases"]:
        if ph["phase"] in ("hang_worker", "crash_twice"):
            print(f"{ph['phase']}:", json.dumps({k: v for k, v in ph.items() if k not in (
                "phase", "target", "at_s", "completed", "failed")}))
        if "answers" in ph:
            print(f"{ph['phase']}: /health max {ph['health_max_s']:.2f} s;",
                  json.dumps(ph["answers"]))
    path = write(ns.name, {"workload": vars(ns), **summary})
    plot(res, t0, summary, plot_path(ns.name))
    print(f"wrote {path} and {plot_path(ns.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
