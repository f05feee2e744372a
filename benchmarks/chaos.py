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
                       again must be refused at once with no worker touched (with 2 workers the
                       stream waits for the first one's restart before it moves to the second,
                       so one is always serving: failover.py, wait_for_spare)
    mass_disconnect    400 streams opened at once (max_tokens 256: most queue behind the KV
                       budget), every connection reset at the same moment: seconds until every
                       dropped stream is aborted on its worker (the fleet's load back to the load
                       clients' own) and a small request is answered within 3x of idle
The flood, the probe and the load clients each send from a loopback address of their own
(127.0.0.2, .3, .1), which the server takes as three clients: the flood is one client flooding
while another probes (--fairness off: the server admits first come first served, no cap).
Throughout, a small probe request (4 tokens, streamed) is sent every 0.5 s; its TTFT and total
are reported per phase as multiples of the same probe's p50 on the idle service, measured before
the load starts (issue 24: within 3x of idle during each attack). The phases themselves live in
benchmarks/chaos_phases.py.
and prints and writes (benchmarks/results/chaos.json, .png): requests sent, completed, failed by
status, lost (a 200 with fewer tokens than asked, or a stream without [DONE]), hung (no answer
in 120 s), per phase the load requests in the air that completed and that failed (and the
slowest that completed), collateral
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from benchmarks.report import plot_path, pyplot, table, write  # noqa: E402
from benchmarks.chaos_phases import (BODY_TIMEOUT_S, CLIENT_TIMEOUT_S,  # noqa: E402
                                     Probe, busiest, controller_pids, crash_twice, fleet,
                                     hang_worker, mass_disconnect, new_controller, send_big_bodies,
                                     ratios, send_expensive, send_raw, send_slow_bodies,
                                     wait_all_ready)
from benchmarks.chaos_load import Load, Outcome  # noqa: E402
from benchmarks.serve_process import launch, stop  # noqa: E402

PHASES = ("kill_worker", "freeze_worker", "poison", "expensive", "big_bodies", "slow_bodies",
          "kill_controller", "hang_worker", "crash_twice", "mass_disconnect")


def preemptions(url: str) -> float:
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(s.value for f in text_string_to_metric_families(text)
               if f.name == "raypaged:num_preemptions" for s in f.samples)


async def health_max(url: str, work, samples: list | None = None) -> tuple[object, float]:
    """(what `work` returns, the slowest /health answer while it ran); each answer's
    (sent at, seconds) is appended to `samples` if given."""
    stop_polling = asyncio.Event()
    samples = [] if samples is None else samples

    async def poll() -> float:
        async with httpx.AsyncClient(timeout=60) as client:
            while not stop_polling.is_set():
                t = time.monotonic()
                await client.get(f"{url}/health")
                samples.append((t, time.monotonic() - t))
                await asyncio.sleep(0.1)
        return max((s for _, s in samples), default=0.0)

    poller = asyncio.create_task(poll())
    try:
        result = await work
    finally:
        stop_polling.set()
    return result, await poller


async def all_workers_ready(url: str, n: int, limit_s: float) -> float:
    """Seconds until all n workers are ready: /health answers with one, and a fleet short of
    workers would measure another benchmark (on a 2-core machine Ray schedules 2 workers of 1
    CPU: 3 need --num-cpus 3)."""
    t = time.monotonic()
    while sum(w["state"] == "ready" for w in await asyncio.to_thread(fleet, url)) < n:
        if time.monotonic() - t > limit_s:
            raise SystemExit(f"only some of the {n} workers were ready after {limit_s:g} s: "
                             "see --num-cpus")
        await asyncio.sleep(0.5)
    return time.monotonic() - t


async def scenario(proc, url: str, ns) -> dict:
    workers_ready_s = await all_workers_ready(url, ns.workers, ns.recovery_limit_s)
    probe = Probe(url)
    probe_idle = await probe.idle()  # nothing else running yet
    load = Load(url, ns.concurrency)
    runner = asyncio.create_task(load.run())
    prober = asyncio.create_task(probe.run())
    phases, raw_counts = [], {}
    first_preemptions = await asyncio.to_thread(preemptions, url)
    load_alone_at = time.monotonic()
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
        elif name == "mass_disconnect":
            health: list[tuple[float, float]] = []
            extra["answers"], extra["health_max_s"] = await health_max(url, mass_disconnect(
                url, probe_idle, ns.concurrency, limit_s=ns.recovery_limit_s), health)
            # the flood (400 streams queued, before the drop) apart from the drop and after
            dropped = extra["answers"].pop("dropped_at")
            extra["health_max_flood_s"] = max((s for t, s in health if t < dropped), default=None)
            extra["health_max_after_drop_s"] = max((s for t, s in health if t >= dropped),
                                                   default=None)
            # when in the flood /health was slow: at the burst of connections, or throughout
            flood = [(round(t - at, 2), round(s, 3)) for t, s in health if t < dropped]
            extra["health_flood_over_1s"] = [ts for ts in flood if ts[1] > 1.0]
            extra["health_flood_p50_s"] = (sorted(s for _, s in flood)[len(flood) // 2]
                                           if flood else None)
            extra["probe_flood"] = ratios(probe.samples, probe_idle, at, dropped)
            extra["probe_after_drop"] = ratios(probe.samples, probe_idle, dropped,
                                               dropped + ns.phase_s)
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
    probe.stop()
    await asyncio.wait_for(runner, CLIENT_TIMEOUT_S + 30)
    await asyncio.wait_for(prober, CLIENT_TIMEOUT_S + 30)
    return {"outcomes": load.outcomes, "phases": phases, "raw": raw_counts,
            "baseline_health_max_s": baseline_health_s, "probe_idle": probe_idle,
            "probes": probe.samples, "load_alone_at": load_alone_at,
            "all_workers_ready_after_health_s": workers_ready_s,
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
        # the slowest of them that completed: what a failover's wait cost (a restart, when
        # the fleet spares its last ready worker)
        p["load_max_s"] = round(max((o.ended - o.started for o in outs if o.ok
                                     and o.ended >= start and o.started < end), default=0), 2)
        p.update(ratios(res["probes"], res["probe_idle"], start, end))
    first_at = res["phases"][0]["at"] if res["phases"] else float("inf")
    return {
        "sent": len(outs), "completed": sum(o.ok for o in outs), "failed_by_status": failed,
        "lost": sum(o.status == "200" and not o.ok for o in outs),
        "hung": sum(o.status == "hung" for o in outs),
        "collateral_poison_failures": len(collateral) if poison is not None else None,
        "preemptions": res["preemptions"], "phases": phases, "raw_requests": res["raw"],
        "baseline_health_max_s": res["baseline_health_max_s"],
        "probe_idle": res["probe_idle"],
        "all_workers_ready_after_health_s": res["all_workers_ready_after_health_s"],
        "probe_load_alone": ratios(res["probes"], res["probe_idle"], res["load_alone_at"],
                                   first_at),
        "load_average_at_end": os.getloadavg()}


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
                   help="the server's --ingress (default: its default, HAProxy where it can run)")
    p.add_argument("--router-replicas", type=int, default=None,
                   help="the server's --router-replicas (default: its default, 1)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="the server's --num-cpus (Ray's CPUs; default: the machine's)")
    p.add_argument("--fairness", choices=("on", "off"), default="on",
                   help="off: the server's --no-fair-admission --max-requests-per-client 0 "
                        "(first come first served, no per-client cap: the A/B of issue 24)")
    p.add_argument("--name", default="chaos")
    ns = p.parse_args(argv)
    log = Path(tempfile.gettempdir()) / f"{ns.name}_serve.log"
    flags = ["--workers", str(ns.workers), "--kv-memory-mb", "64", "--max-model-len", "512",
             "--body-timeout-s", str(BODY_TIMEOUT_S),
             "--worker-unresponsive-timeout-s", str(ns.unresponsive_timeout_s)]
    if ns.fairness == "off":
        flags += ["--no-fair-admission", "--max-requests-per-client", "0"]
    if ns.ingress is not None:
        flags += ["--ingress", ns.ingress]
    if ns.num_cpus is not None:
        flags += ["--num-cpus", str(ns.num_cpus)]
    if ns.router_replicas is not None:
        flags += ["--router-replicas", str(ns.router_replicas)]
    load_at_start = os.getloadavg()
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
                                    "load_max_s", "fleet_ready_s", "first_ok_request_s", "controller_back_s",
                                    "worker_pids_unchanged"]))
    idle = summary["probe_idle"]
    print(f"small probe request (4 tokens, streamed) idle: TTFT p50 {idle['ttft_p50_s']:.3f} s, "
          f"total p50 {idle['total_p50_s']:.3f} s; per phase as multiples of idle "
          "(target: max within 3x):")
    probe_cols = ["probes", "probes_failed", "probe_ttft_p50_x", "probe_ttft_max_x",
                  "probe_total_p50_x", "probe_total_max_x", "probe_total_max_s"]
    print(table([{"phase": "load alone", **summary["probe_load_alone"]}, *summary["phases"]],
                ["phase", *probe_cols]))
    print("malformed / poison replies by status:", json.dumps(summary["raw_requests"]))
    print(f"/health max over the load alone (before the first phase): "
          f"{summary['baseline_health_max_s']:.2f} s")
    for ph in summary["phases"]:
        if ph["phase"] == "mass_disconnect":
            print("mass_disconnect:", json.dumps({k: ph[k] for k in (
                "health_max_flood_s", "health_flood_p50_s", "health_flood_over_1s",
                "health_max_after_drop_s", "probe_flood",
                "probe_after_drop")}))
        if ph["phase"] in ("hang_worker", "crash_twice"):
            print(f"{ph['phase']}:", json.dumps({k: v for k, v in ph.items() if k not in (
                "phase", "target", "at_s", "completed", "failed")}))
        if "answers" in ph:
            print(f"{ph['phase']}: /health max {ph['health_max_s']:.2f} s;",
                  json.dumps(ph["answers"]))
    path = write(ns.name, {"workload": vars(ns), "load_average_at_start": load_at_start,
                           **summary})
    plot(res, t0, summary, plot_path(ns.name))
    print(f"wrote {path} and {plot_path(ns.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
