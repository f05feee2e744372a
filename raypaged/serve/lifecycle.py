"""Worker lifecycle rules, as small pure functions (the controller and the worker's Ray shell
apply them; tests check them on numbers).

    unresponsive for worker_unresponsive_timeout_s  -> killed (ray.kill); Ray starts a new process
    a process restarted after a crash               -> waits restart_delay_s(crashes in a row)
                                                       before it loads the model again

Crashes count "in a row" while each incarnation lived less than HEALTHY_S: a worker that served
for five minutes and then crashed restarts at once, as the first time. The delays (0, 1, 2, 4,
... 60 s) are Kubernetes' CrashLoopBackOff shape (10 s doubling to 5 min) scaled to a model
reload: one crash costs no wait, a crash loop costs at most one reload a minute.
"""
from __future__ import annotations

BACKOFF_FIRST_S = 1.0   # the wait before the second restart in a row
BACKOFF_CAP_S = 60.0    # the longest wait
HEALTHY_S = 300.0       # an incarnation that lived this long ends a crash streak


def restart_delay_s(crashes_in_a_row: int) -> float:
    """0 for the first crash, then 1, 2, 4, ... capped at BACKOFF_CAP_S."""
    if crashes_in_a_row <= 1:
        return 0.0
    return min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2.0 ** (crashes_in_a_row - 2))


def next_start(ledger: dict | None, now: float) -> tuple[float, dict]:
    """(seconds to wait, the ledger to keep) for a worker process starting at `now`.

    `ledger` is what the previous incarnation of the same actor kept ({"crashes", "started"}),
    None for the actor's first start. A start that follows one means the last process died."""
    if ledger is None:
        return 0.0, {"crashes": 0, "started": now}
    lived = now - ledger["started"]
    crashes = ledger["crashes"] + 1 if lived < HEALTHY_S else 1
    delay = restart_delay_s(crashes)
    return delay, {"crashes": crashes, "started": now + delay}


def overdue(state_since: float, killed_at: float | None, now: float, timeout_s: float) -> bool:
    """An unresponsive worker is killed once it has been silent `timeout_s`, counted from when
    it turned unresponsive or from the last kill, whichever is later (a kill takes a few
    seconds to land on a stopped process: it is not repeated meanwhile)."""
    return now - max(state_since, killed_at or 0.0) >= timeout_s
