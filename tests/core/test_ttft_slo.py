"""TTFT-SLO shedding: the queue-drain counter, the online drain rate, and exact shed decisions."""
import math

from raypaged.core.sampling_params import SamplingParams
from raypaged.core.ttft_slo import DrainRate, Shed, WorkerQueue, best_worker, decide

from core_engine import make_engine


def shed(slo_s: float, prompt_tokens: int, workers: list[WorkerQueue]
         ) -> tuple[int, Shed] | None:
    """decide()'s best worker and Shed when it sheds: None to admit."""
    decision = decide(slo_s, prompt_tokens, workers)
    return None if decision is None or decision[1] is None else decision


def test_prefill_counter_counts_what_leaves_the_queue_not_decode_tokens():
    eng = make_engine(num_blocks=300, block_size=16, max_num_batched_tokens=256)
    eng.add_request("long", list(range(600)), SamplingParams(temperature=0, max_tokens=5))
    counts = []
    while eng.has_unfinished():
        eng.step()
        s = eng.stats()
        counts.append((s.num_prefill_tokens, s.num_queued_tokens))
    # chunks of 256, 256, 88 (the last samples one token: its placeholder stays queued), then
    # four decode steps that drain nothing; the queue reads 600 - counter + the one placeholder
    assert [c for c, _ in counts] == [256, 512, 599, 599, 599, 599, 599]
    assert [q for _, q in counts[:3]] == [344, 88, 1]


def test_drain_rate_is_tokens_over_time_while_requests_wait():
    rate = DrainRate(window_s=2.0, min_s=1.0)
    assert rate.observe(0.0, 0, 4, "a") is None           # first poll: nothing to compare
    assert rate.observe(1.0, 400, 3, "a") == 400.0        # 400 drained in 1 s, still waiting
    assert rate.observe(2.0, 400, 3, "a") == 200.0        # KV full, nothing admitted: 400 / 2 s
    assert rate.observe(3.0, 1000, 0, "a") == 200.0       # the queue emptied: says nothing
    assert rate.observe(4.0, 1000, 0, "a") == 200.0       # idle: sticky
    assert rate.observe(5.0, 1000, 2, "a") == 200.0       # waiting again from here
    assert rate.observe(5.5, 1300, 2, "a") == 280.0       # (400 + 0 + 300) / 2.5 s
    # the window: the fewest latest intervals that cover 2 s (the 400 falls out)
    assert rate.observe(6.5, 1300, 1, "a") == 120.0       # (0 + 300 + 0) / 2.5 s
    assert rate.observe(9.0, 1300, 1, "a") == 0.0         # 2.5 s, none started: measured zero
    assert rate.observe(9.5, 10, 5, "b") is None          # a new process: measured afresh
    assert rate.observe(10.0, 110, 4, "b") is None        # 0.5 s of backlog: too little yet
    assert rate.observe(10.5, 210, 4, "b") == 200.0


def test_a_worker_measured_at_zero_is_predicted_never_to_start():
    assert shed(1.0, 10, [WorkerQueue(500, 0.0)]) == (0, Shed(math.inf, 60))
    # an idle worker not measured yet takes the others' mean, 0 too: the shorter queue wins
    assert shed(1.0, 10, [WorkerQueue(500, 0.0), WorkerQueue(0, None)]) is None


def test_no_measured_rate_sheds_nothing():
    assert shed(0.5, 100, [WorkerQueue(100_000, None), WorkerQueue(50_000, None)]) is None
    assert best_worker(100, []) is None


def test_the_best_worker_decides_and_retry_after_is_when_its_queue_has_room():
    workers = [WorkerQueue(1000, 500.0),  # (1000 + 50) / 500 = 2.1 s
               WorkerQueue(400, 100.0)]   # (400 + 50) / 100 = 4.5 s
    assert best_worker(50, workers)[:2] == (0, 2.1)
    assert shed(2.5, 50, workers) is None
    # over a 1 s SLO: the queue may hold 1 x 500 - 50 = 450 tokens; 550 more drain in 1.1 s
    assert shed(1.0, 50, workers) == (0, Shed(2.1, 2))


def test_an_unmeasured_worker_is_predicted_at_the_mean_measured_rate():
    workers = [WorkerQueue(900, 100.0), WorkerQueue(900, 300.0), WorkerQueue(100, None)]
    # mean 200 tok/s: the idle-ish third worker starts 100 tokens in (100 + 100) / 200 = 1 s
    assert best_worker(100, workers)[:2] == (2, 1.0)
    assert shed(1.0, 100, workers) is None
    assert shed(0.5, 100, workers) == (2, Shed(1.0, 1))


def test_a_prompt_alone_on_an_idle_worker_is_never_shed_however_long():
    # 8,000 tokens at 1,000 tok/s is 8 s against a 1 s SLO, but nothing is queued: retrying
    # could not make it faster, so it is admitted
    assert shed(1.0, 8000, [WorkerQueue(0, 1000.0), WorkerQueue(5000, 1000.0)]) is None


def test_retry_after_is_capped_at_a_minute():
    assert shed(1.0, 10, [WorkerQueue(1_000_000, 100.0)]) == (0, Shed(10000.1, 60))
