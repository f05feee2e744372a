"""The waiting queue: FIFO order exactly as a deque keeps it, and removal from the middle."""
from __future__ import annotations

from raypaged.core.request import Request
from raypaged.core.request_queue import RequestQueue
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler


def req(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), 4)


def ids(q) -> list[str]:
    return [r.request_id for r in q]


def test_order_after_every_operation_matches_a_deque():
    q = RequestQueue()
    a, b, c, d, e = (req(x) for x in "abcde")
    for r in (a, b, c):
        q.append(r)
    q.appendleft(d)
    assert ids(q) == ["d", "a", "b", "c"] and q[0] is d and len(q) == 4
    q.remove(a)
    assert ids(q) == ["d", "b", "c"]
    q.insert(1, e)
    assert ids(q) == ["d", "e", "b", "c"]
    assert q.popleft() is d and ids(q) == ["e", "b", "c"]


def test_aborting_queued_requests_keeps_the_rest_in_order():
    sched = Scheduler(num_blocks=4, block_size=4, max_model_len=64)
    for i in range(10):
        sched.add(Request(f"r{i}", [7] * 8, SamplingParams(max_tokens=4), 4))
    for i in (0, 5, 9, 3):
        assert [r.request_id for r in sched.abort(f"r{i}")] == [f"r{i}"]
    assert ids(sched.waiting) == ["r1", "r2", "r4", "r6", "r7", "r8"]
    assert sched.num_waiting == 6 and sched.abort("r5") == []
