"""The trace loader: block ids become fixed tokens, so shared prefixes hash alike; lengths exact."""
import itertools
from pathlib import Path

import pytest

from raypaged.core.block_hash import hash_block_tokens
from benchmarks.sim.trace import (TRACE_BLOCK, block_tokens, find_trace, load_mooncake,
                                time_scaled, trace_prompt)

ROOT = Path(__file__).resolve().parents[2]


def test_prompts_that_share_leading_block_ids_share_exactly_those_block_hashes():
    a = trace_prompt([0, 14, 15], 3 * TRACE_BLOCK)
    b = trace_prompt([0, 14, 99], 2 * TRACE_BLOCK + 40)
    ha, hb = hash_block_tokens(a, 16), hash_block_tokens(b, 16)
    shared = 2 * TRACE_BLOCK // 16  # two trace blocks = 64 engine blocks
    assert ha[:shared] == hb[:shared]
    assert ha[shared] != hb[shared]


def test_distinct_block_ids_give_distinct_blocks_and_the_same_id_the_same_tokens():
    ids = [0, 1, 30_000, 30_001, 182_789, 7 * 30_000 + 7]
    blocks = [tuple(block_tokens(i)) for i in ids]
    assert len(set(blocks)) == len(ids)
    assert block_tokens(182_789) == block_tokens(182_789)
    assert all(len(b) == TRACE_BLOCK for b in blocks)


def test_the_last_block_holds_what_input_length_leaves():
    prompt = trace_prompt([3, 4], 512 + 210)
    assert len(prompt) == 722
    assert prompt[512:] == block_tokens(4)[:210]


@pytest.mark.parametrize("ids, length", [([1, 2], 512), ([1, 2], 1025), ([], 5)])
def test_a_length_that_does_not_fit_its_blocks_is_refused_with_the_rule(ids, length):
    with pytest.raises(ValueError, match="does not fit"):
        trace_prompt(ids, length)


def mooncake():
    path = find_trace(ROOT)
    if path is None:
        pytest.skip("shared/traces/mooncake_conversation_trace.jsonl is not inside or beside "
                    "the checkout (see docs/fleet_sim.md)")
    return path


def test_mooncake_requests_have_the_traces_exact_lengths_and_arrivals():
    import json

    path = mooncake()
    rows = [json.loads(line) for line in itertools.islice(open(path), 200)]
    reqs = load_mooncake(path, limit=200)
    assert [len(r.prompt()) for r in reqs] == [row["input_length"] for row in rows]
    assert [r.output_len for r in reqs] == [row["output_length"] for row in rows]
    assert [r.arrival_s for r in reqs] == [(row["timestamp"] - rows[0]["timestamp"]) / 1000
                                           for row in rows]
    assert [r.arrival_s for r in time_scaled(reqs, 4)] == [r.arrival_s / 4 for r in reqs]


def test_mooncake_requests_that_share_block_ids_share_their_real_block_hashes():
    import json

    path = mooncake()
    rows = [json.loads(line) for line in itertools.islice(open(path), 50)]
    reqs = load_mooncake(path, limit=50)
    pairs = 0
    for (ra, a), (rb, b) in itertools.combinations(zip(rows, reqs), 2):
        common = 0
        for x, y in zip(ra["hash_ids"], rb["hash_ids"]):
            if x != y:
                break
            common += 1
        # full trace blocks shared by both and full in both prompts
        full = min(common, len(ra["hash_ids"]) - 1, len(rb["hash_ids"]) - 1)
        ha, hb = hash_block_tokens(a.prompt(), 16), hash_block_tokens(b.prompt(), 16)
        n = full * TRACE_BLOCK // 16
        assert ha[:n] == hb[:n]
        first_diff = common * TRACE_BLOCK // 16
        if common < min(len(ra["hash_ids"]), len(rb["hash_ids"])) and first_diff < min(len(ha), len(hb)):
            assert ha[first_diff] != hb[first_diff]
        pairs += full > 0
    assert pairs > 0  # the window does share prefixes (block 0 is a common head)
