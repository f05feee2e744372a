"""The faults and attacks of benchmarks/chaos.py, one function each, and the fleet queries they
share. Each takes the server's URL and returns what it measured (a dict for the JSON)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time

import httpx

from benchmarks.limits_probe import ATTACKS, slow_body
from benchmarks.serve_process import descendants

BODY_TIMEOUT_S = 5
CLIENT_TIMEOUT_S = 120
# Loopback addresses of their own (Linux routes all of 127/8 to lo), so that the server tells
# the 400-stream flood, the probe and the load clients (127.0.0.1) apart as clients: a router
# identifies a client by its address (raypaged/serve/client_gate.py)
FLOOD_ADDRESS, PROBE_ADDRESS = "127.0.0.2", "127.0.0.3"

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


def fleet(url: str) -> list[dict]:
    try:
        return httpx.get(f"{url}/fleet", timeout=5).json()["workers"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


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

    async def send(client) -> tuple[int, float]:
        r = await client.post(f"{url}/v1/completions", content=big,
                              headers={"content-type": "application/json"})
        return r.status_code, round(time.monotonic() - t, 2)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:
        answers = await asyncio.gather(*(send(client) for _ in range(n)))
    return {"bodies": n, "statuses": sorted({status for status, _ in answers}),
            "seconds": round(time.monotonic() - t, 2),
            "each_answered_s": sorted(s for _, s in answers)}


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
    # a long prompt (~280 tokens): the worker the stream moves to is the one whose prefix
    # cache is asked about that many more tokens (with 3+ workers it is not known otherwise)
    prompt = "Chaos: a request that crashes workers. " + " ".join(f"bird {i}," for i in range(70))
    body = {"prompt": prompt, "max_tokens": 150, "ignore_eos": True, "temperature": 0,
            "stream": True}
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
            workers = await asyncio.to_thread(fleet, url)
            pids = {w["worker_id"]: w.get("pid") for w in workers}
            asked = {w["worker_id"]: w.get("memory", {}).get("prefix_queries", 0) for w in workers}
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
                def growth(w):
                    return w.get("memory", {}).get("prefix_queries", 0) - asked.get(w["worker_id"], 0)

                waited = time.monotonic()
                while True:  # the fleet's stats lag a poll behind the stream
                    others = [w for w in await asyncio.to_thread(fleet, url)
                              if w["worker_id"] != first and w.get("state") == "ready"]
                    second = max(others, key=growth)
                    if growth(second) >= 200 or time.monotonic() - waited > 10:
                        break
                    await asyncio.sleep(0.1)
                os.kill(second["pid"], signal.SIGKILL)
                out["second_kill"] = second["worker_id"]
                out["second_kill_prefix_tokens_asked"] = {w["worker_id"]: growth(w)
                                                          for w in others}
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


class Probe:
    """A small request (streamed, 4 tokens) sent every `every_s` while the benchmark runs: its
    time to first token and total, to compare each phase with the idle service (issue 24: a
    small request's latency during each attack within 3x of idle)."""

    BODY = {"prompt": "Probe: say hi.", "max_tokens": 4, "ignore_eos": True, "temperature": 0,
            "stream": True}

    def __init__(self, url: str, every_s: float = 0.5):
        self.url, self.every_s = url, every_s
        self.samples: list[dict] = []   # started, ttft_s, total_s, status
        self._stop = asyncio.Event()

    async def once(self, client: httpx.AsyncClient) -> dict:
        t = time.monotonic()
        sample = {"started": t, "ttft_s": None, "total_s": None, "status": "?"}
        try:
            async with client.stream("POST", f"{self.url}/v1/completions", json=self.BODY) as r:
                sample["status"] = str(r.status_code)
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and sample["ttft_s"] is None:
                        sample["ttft_s"] = time.monotonic() - t
            sample["total_s"] = time.monotonic() - t
        except httpx.HTTPError as exc:
            sample["status"] = type(exc).__name__
        return sample

    @staticmethod
    def client() -> httpx.AsyncClient:
        """A client that sends from the probe's own address (a client apart from the load)."""
        return httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, transport=httpx.AsyncHTTPTransport(
            local_address=PROBE_ADDRESS))

    async def idle(self, n: int = 8) -> dict:
        """p50 of n probes one after another, nothing else running."""
        async with self.client() as client:
            got = [await self.once(client) for _ in range(n)]
        ok = [s for s in got if s["status"] == "200"]
        return {"n": len(ok), "ttft_p50_s": statistics.median(s["ttft_s"] for s in ok),
                "total_p50_s": statistics.median(s["total_s"] for s in ok)}

    async def run(self) -> None:
        async with self.client() as client:
            while not self._stop.is_set():
                self.samples.append(await self.once(client))
                await asyncio.sleep(self.every_s)

    def stop(self) -> None:
        self._stop.set()


def ratios(samples: list[dict], idle: dict, start: float, end: float) -> dict:
    """The probes started in [start, end): p50 and max of TTFT and total over idle's p50."""
    got = [s for s in samples if start <= s["started"] < end]
    ok = [s for s in got if s["status"] == "200" and s["ttft_s"] is not None]
    if not ok:
        return {"probes": len(got), "probes_failed": len(got)}
    ttft = sorted(s["ttft_s"] for s in ok)
    total = sorted(s["total_s"] for s in ok)
    return {"probes": len(got), "probes_failed": len(got) - len(ok),
            "probe_ttft_p50_x": round(statistics.median(ttft) / idle["ttft_p50_s"], 2),
            "probe_ttft_max_x": round(ttft[-1] / idle["ttft_p50_s"], 2),
            "probe_total_p50_x": round(statistics.median(total) / idle["total_p50_s"], 2),
            "probe_total_max_x": round(total[-1] / idle["total_p50_s"], 2),
            "probe_total_max_s": round(total[-1], 3)}


def fleet_load(url: str) -> int:
    """Requests accepted and not finished, all workers together."""
    return sum(w.get("load", 0) for w in fleet(url))


async def _open_stream(port: int, i: int, max_tokens: int):
    """A streamed completion on a raw connection (so it can be dropped with a reset)."""
    body = json.dumps({"prompt": f"Disconnect {i}: tell a long story.", "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port,
                                                   local_addr=(FLOOD_ADDRESS, 0))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    return reader, writer


async def _status(reader) -> str:
    line = await reader.readline()
    return line.split(b" ", 2)[1].decode() if line.startswith(b"HTTP/1.1 ") else "closed"


async def mass_disconnect(url: str, probe_idle: dict, concurrency: int, n: int = 400,
                          max_tokens: int = 256, admit_s: float = 10.0,
                          limit_s: float = 60.0) -> dict:
    """n streams opened at once; after admit_s (or once all have answered with headers), every
    connection is reset at the same moment. Back: the fleet holds no more than the load
    clients' own requests (every dropped stream aborted on its worker) and a small request is
    answered within 3x its idle latency; seconds after the drop."""
    port = int(url.rsplit(":", 1)[1])
    conns = await asyncio.gather(*(_open_stream(port, i, max_tokens) for i in range(n)),
                                 return_exceptions=True)
    opened = [c for c in conns if not isinstance(c, BaseException)]
    heads = [asyncio.create_task(_status(r)) for r, _ in opened]
    await asyncio.wait(heads, timeout=admit_s)
    statuses: dict[str, int] = {}
    for h in heads:
        key = h.result() if h.done() and not h.exception() else "no headers yet"
        statuses[key] = statuses.get(key, 0) + 1
        h.cancel()
    load_at_drop = await asyncio.to_thread(fleet_load, url)
    dropped = time.monotonic()
    for _, writer in opened:
        writer.transport.abort()  # RST: the client is gone at once, mid-stream
    out = {"dropped_at": dropped, "streams": n, "opened": len(opened),
           "statuses_at_drop": statuses,
           "fleet_load_at_drop": load_at_drop, "aborted_s": None, "probe_normal_s": None}
    probe = Probe(url)
    async with probe.client() as client:
        while time.monotonic() - dropped < limit_s:
            now = round(time.monotonic() - dropped, 2)
            # + 1: the probe of the previous round may still be counted
            if out["aborted_s"] is None and await asyncio.to_thread(fleet_load, url) <= concurrency + 1:
                out["aborted_s"] = now
            if out["probe_normal_s"] is None:
                s = await probe.once(client)
                if s["status"] == "200" and s["total_s"] <= 3 * probe_idle["total_p50_s"]:
                    out["probe_normal_s"] = round(time.monotonic() - dropped, 2)
            if out["aborted_s"] is not None and out["probe_normal_s"] is not None:
                break
            await asyncio.sleep(0.25)
    done = [v for v in (out["aborted_s"], out["probe_normal_s"]) if v is not None]
    out["back_s"] = max(done) if len(done) == 2 else None
    return out
