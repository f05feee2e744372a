"""Overlapped scheduling (async_scheduling) gives exactly the tokens, finish reasons and block
accounting of the synchronous loop: stops, max_tokens, aborts mid-stream, preemption under a
tiny KV budget, forks. The fake runner checks every KV read, so a block reused while a step
still needed it shows up as a wrong read."""
import threading
import time

import pytest

from core_engine import make_engine
from fake_runner import FakeRunner, next_token
from raypaged.core.contracts import PLACEHOLDER
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduling_policy import FIRST_RULES, FITS, SchedulingPolicy


def run(engine, max_steps=10_000):
    """Step until idle: each sequence's tokens, finish and stop reasons; nothing after a finish."""
    tokens, finish = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return tokens, finish
        for d in engine.step():
            assert d.request_id not in finish, f"{d.request_id} produced after finishing"
            tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finished:
                finish[d.request_id] = (d.finish_reason, d.stop_reason)
    raise AssertionError("engine did not finish")


def add_mix(engine, stops=None):
    """Prompts of several lengths (chunked at a small budget), n > 1, stop ids, max_tokens."""
    for i in range(8):
        prompt = [(i * 37 + j * 11) % 1000 for j in range(5 + 5 * i)]
        engine.add_request(f"m{i}", prompt, SamplingParams(
            max_tokens=4 + 2 * i, n=1 + (i % 3 == 1), temperature=0,
            stop_token_ids=(stops[f"m{i}"],) if stops and f"m{i}" in stops else ()))


def both(stops=None, **kw):
    """The mix run synchronously, then overlapped: [(outputs, engine), (outputs, engine)]."""
    out = []
    for overlap in (False, True):
        engine = make_engine(overlap=overlap, **kw)
        add_mix(engine, stops)
        out.append((run(engine), engine))
    return out


# tiny_kv: admitting what fits makes the tiny budget preempt; with the first rules' victim
# (the newest) and with the bounded one (least work, requeued by arrival)
@pytest.mark.parametrize("kv", [
    dict(num_blocks=200, max_num_batched_tokens=24),
    dict(num_blocks=20, max_num_batched_tokens=64, policy=FIRST_RULES),
    dict(num_blocks=20, max_num_batched_tokens=64, policy=SchedulingPolicy(admission_policy=FITS)),
], ids=["roomy", "tiny_kv_preempts_newest", "tiny_kv_preempts_bounded"])
def test_overlap_gives_the_same_tokens_and_finish_reasons(kv):
    (sync, sync_engine), (over, over_engine) = both(**kv)
    assert over == sync
    assert over_engine.scheduler.kv.pool.num_free == kv["num_blocks"]  # every block back
    assert not over_engine.scheduler.kv.tables
    if kv["num_blocks"] == 20:  # the budget really did preempt, in both modes
        assert sync_engine.stats().num_preemptions > 0
        assert over_engine.stats().num_preemptions > 0


def test_stop_token_ends_at_the_same_token_and_its_queued_step_is_dropped():
    (free_run, _), _ = both(num_blocks=200)
    # the third output token of each single-sample request becomes its stop token
    stops = {rid: toks[2] for rid, toks in free_run[0].items() if "#" not in rid and len(toks) > 3}
    (sync, sync_engine), (over, engine) = both(stops, num_blocks=200)
    assert over == sync
    stopped = [rid for rid, (why, _) in over[1].items() if why == "stop"]
    assert stopped, "the stop ids ended some requests"
    for rid in stopped:  # ends at the first occurrence of its stop id, which is emitted once
        toks = over[0][rid]
        assert toks[-1] == stops[rid] and stops[rid] not in toks[:-1]
        assert over[1][rid] == ("stop", stops[rid])

        def sampling_steps(e):
            return sum(1 for b in e.runner.batches for r in b.requests
                       if r.request_id == rid and r.num_samples)
        # overlapped, the step after the stop was already queued with it: run, then dropped
        assert sampling_steps(sync_engine) == len(toks)
        assert sampling_steps(engine) == len(toks) + 1


def test_max_tokens_requests_are_not_scheduled_past_their_last_token():
    engine = make_engine(overlap=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    tokens, finish = run(engine)
    assert len(tokens["a"]) == 3 and finish["a"] == ("length", None)
    # prefill + 2 decodes: the step that would feed the 3rd token is never scheduled
    assert [len(b.requests) for b in engine.runner.batches] == [1, 1, 1]


def test_placeholders_are_filled_with_the_previous_steps_token():
    engine = make_engine(overlap=True)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # queues the prefill
    engine.step()  # queues decode 1 with a placeholder, applies the prefill
    run(engine)
    fed = [list(r.token_ids) for b in engine.runner.batches for r in b.requests]
    assert PLACEHOLDER not in sum(fed, [])
    t1 = next_token([5, 6, 7])
    assert fed[:2] == [[5, 6, 7], [t1]]


class GatedRunner(FakeRunner):
    """Holds each step until the test lets it go, so the test acts while a step is running."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate = threading.Semaphore(0)

    def execute(self, batch):
        assert self.gate.acquire(timeout=10)
        return super().execute(batch)


def test_abort_while_its_next_step_is_queued_frees_every_block_and_emits_nothing_more():
    runner = GatedRunner(32, 4)
    engine = make_engine(num_blocks=32, overlap=True, runner=runner)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(1, 10)), params)
    engine.add_request("b", list(range(20, 29)), params)
    got = {"a": [], "b": []}
    for _ in range(4):  # a few tokens each; step N+1 is always queued behind step N
        runner.gate.release()
        for d in engine.step():
            got[d.request_id] += d.new_token_ids
    assert len(got["a"]) >= 2
    aborted = engine.abort("a")
    assert [(d.request_id, d.finish_reason) for d in aborted] == [("a", "abort")]
    assert "a" not in engine.scheduler.kv.tables  # freed at once, while a's queued step waits
    for _ in range(100):
        runner.gate.release()
    tokens, finish = run(engine)
    assert "a" not in tokens and finish["b"] == ("length", None)
    assert len(got["b"]) + len(tokens["b"]) == 20
    assert engine.stats().memory.blocks_used == 0


def test_a_reused_request_id_never_gets_the_dropped_slot_of_its_predecessor():
    engine = make_engine(overlap=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("x", [1, 2, 3], params)
    engine.step()
    engine.step()
    engine.abort("x")  # its decode step is queued
    engine.add_request("x", [9, 9, 9, 9], params)
    tokens, finish = run(engine)
    clean = make_engine()
    clean.add_request("x", [9, 9, 9, 9], params)
    assert (tokens, finish) == run(clean)


class SlowRunner(FakeRunner):
    """Each step takes `seconds` of wall time without using the CPU (a device step)."""

    def __init__(self, *args, seconds: float) -> None:
        super().__init__(*args)
        self.seconds = seconds

    def execute(self, batch):
        time.sleep(self.seconds)
        return super().execute(batch)


def test_the_step_thread_sleeps_while_it_waits_for_the_running_step():
    """Waiting for step N blocks on the future: no polling loop that would take CPU (and the
    GIL) from the executor and the output stage while the device works."""
    engine = make_engine(overlap=True, runner=SlowRunner(64, 4, seconds=0.25))
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # queues the prefill
    wall, cpu = time.perf_counter(), time.thread_time()
    engine.step()  # queues the first decode, waits ~0.25 s for the prefill
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    assert wall >= 0.2
    assert cpu < 0.05, f"the step thread used {cpu:.3f} s of CPU in {wall:.3f} s of waiting"
    run(engine)


def test_a_sequence_that_ends_while_no_step_is_queued_is_still_announced_to_the_runner():
    """Runners keep per-request state (model/input_buffers.py: a block-table row per id) until
    a batch's finished_request_ids says the request left. "b" ends (length) at the update of
    the step in which "a"'s last step is scheduled; the next schedule() has nothing to run ("a"
    waits for that step), so its batch never reaches the runner: b's id must ride on the next
    batch that does, or the runner keeps b's row for ever (max_num_seqs such leaks and it has no
    row for a new request)."""
    engine = make_engine(overlap=True)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    tokens, finish = run(engine)
    assert finish == {"a": ("length", None), "b": ("length", None)}
    engine.add_request("c", [7, 8, 9], SamplingParams(max_tokens=1, temperature=0))
    run(engine)
    batches = engine.runner.batches
    assert [[r.request_id for r in b.requests] for b in batches] == \
        [["a", "b"], ["a", "b"], ["a"], ["c"]]
    assert [sorted(b.finished_request_ids) for b in batches] == [[], [], [], ["a", "b"]]
