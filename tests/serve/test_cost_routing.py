"""Cache-aware routing on constructed snapshots: exact choices (no Ray)."""
from __future__ import annotations

from raypaged.core.cache_summary import CacheView, SummaryDelta
from raypaged.serve.cost_routing import COLD, CACHED, WorkerLoad, prompt_block_keys, rank_by_cost

BS = 16
PROMPT = list(range(1000, 1065))           # 65 tokens: 4 blocks can hit (never the last token)
KEYS = prompt_block_keys(PROMPT, BS)
ORDER = ["w2", "w0", "w1"]                 # the prompt's rendezvous order


def view(keys) -> CacheView:
    v = CacheView()
    v.apply(SummaryDelta(1, tuple(keys), full=True))
    return v


def rank(workers, factor=1.5):
    return rank_by_cost(len(PROMPT), KEYS, BS, workers, ORDER, factor)


def test_prompt_keys_cover_full_blocks_before_the_last_token():
    assert len(KEYS) == 4 and len(prompt_block_keys(PROMPT[:64], BS)) == 3
    assert prompt_block_keys(PROMPT, BS, "salt") != KEYS


def test_a_prompt_nobody_holds_goes_to_its_rendezvous_first():
    idle = {w: WorkerLoad(0) for w in ORDER}
    assert rank(idle) == (["w2", "w0", "w1"], COLD)


def test_the_worker_holding_the_longest_prefix_wins():
    workers = {"w2": WorkerLoad(0, cache=view(KEYS[:1])), "w0": WorkerLoad(0),
               "w1": WorkerLoad(0, cache=view(KEYS[:3]))}
    assert rank(workers) == (["w1", "w2", "w0"], CACHED)


def test_a_long_queue_outweighs_a_cache_hit():
    # w1 would save 48 prefill tokens but has 500 queued; w0 computes all 65 with nothing ahead
    workers = {"w2": WorkerLoad(1, queued_tokens=200), "w0": WorkerLoad(1),
               "w1": WorkerLoad(1, queued_tokens=500, cache=view(KEYS[:3]))}
    assert rank(workers) == (["w0", "w2", "w1"], COLD)


def test_the_concurrency_cap_passes_over_a_full_worker_whatever_it_caches():
    # 5 in flight + this one over 3 workers, factor 1.5: at most ceil(1.5 * 6 / 3) = 3 each
    workers = {"w2": WorkerLoad(0), "w0": WorkerLoad(2, cache=view(KEYS[:2])),
               "w1": WorkerLoad(3, cache=view(KEYS))}
    assert rank(workers) == (["w0", "w2", "w1"], CACHED)


def test_equal_costs_fall_back_to_rendezvous_order():
    workers = {w: WorkerLoad(0, cache=view(KEYS[:2])) for w in ORDER}
    assert rank(workers) == (["w2", "w0", "w1"], CACHED)


def test_a_cold_prompt_skips_its_rendezvous_first_when_that_one_is_full():
    workers = {"w2": WorkerLoad(4), "w0": WorkerLoad(0), "w1": WorkerLoad(0)}
    assert rank(workers) == (["w0", "w2", "w1"], COLD)
