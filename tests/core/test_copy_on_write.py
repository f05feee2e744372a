"""n > 1 forks share every prompt block; the first divergent write copies one block each."""
from raypaged.core.sampling_params import SamplingParams

from core_engine import make_engine, run_to_completion
from fake_runner import next_token


def expected_sample(prompt, index, max_tokens):
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        t = next_token(seq, index)
        out.append(t)
        seq.append(t)
    return out


def test_fork_shares_every_prompt_block_then_copies_one_block_per_child():
    eng = make_engine(num_blocks=32, block_size=4)
    prompt = list(range(10))  # blocks 0 1 2; block 2 is partial (positions 8, 9)
    eng.add_request("r", prompt, SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=5))
    outs = {}

    def collect(deltas):
        for d in deltas:
            outs.setdefault(d.request_id, []).extend(d.new_token_ids)

    collect(eng.step())  # prefill, 4 samples, fork
    kv = eng.scheduler.kv
    tables = {rid: list(kv.block_ids[rid]) for rid in ("r", "r#1", "r#2", "r#3")}
    assert all(t == [0, 1, 2] for t in tables.values())
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2)] == [4, 4, 4]
    assert kv.pool.num_free == 29  # the prompt is stored once

    collect(eng.step())  # every sequence writes position 10 into shared block 2
    batch = eng.runner.batches[-1]
    assert batch.block_copies == ((2, 3), (2, 4), (2, 5))  # the last writer keeps block 2
    assert [list(kv.block_ids[r]) for r in ("r", "r#1", "r#2", "r#3")] == \
        [[0, 1, 3], [0, 1, 4], [0, 1, 5], [0, 1, 2]]
    assert eng.stats().memory.cow_copies == 3

    for rid, toks in run_to_completion(eng).items():
        outs[rid].extend(toks)
    assert eng.stats().memory.cow_copies == 3  # no further copies: blocks are private now
    assert kv.pool.num_free == 32  # nothing leaked
    # Each sample continues its own sequence: the copies carried the right KV (the fake runner
    # checks every cached position it reads) and the samples diverge.
    assert [outs[rid] for rid in ("r", "r#1", "r#2", "r#3")] == \
        [expected_sample(prompt, i, 5) for i in range(4)]


def test_fork_on_a_block_boundary_needs_no_copy():
    eng = make_engine(num_blocks=32, block_size=4)
    eng.add_request("r", list(range(8)), SamplingParams(n=3, temperature=0.8, max_tokens=3))
    run_to_completion(eng)
    assert eng.stats().memory.cow_copies == 0
    assert eng.scheduler.kv.pool.num_free == 32


def test_n4_uses_fewer_blocks_than_four_requests():
    def peak_used(add):
        eng = make_engine(num_blocks=64, block_size=4)
        add(eng)
        peak = 0
        while eng.has_unfinished():
            eng.step()
            peak = max(peak, eng.stats().memory.blocks_used)
        return peak

    prompt = list(range(30))
    sp = SamplingParams(temperature=0.7, max_tokens=4)
    forked = peak_used(lambda e: e.add_request("r", prompt, SamplingParams(n=4, temperature=0.7, max_tokens=4)))
    separate = peak_used(lambda e: [e.add_request(f"r{i}", prompt, sp) for i in range(4)])
    assert forked < separate
