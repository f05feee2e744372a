"""The headroom projection: peak_blocks against a step-by-step simulation of the same bounds."""
from hypothesis import given, settings
from hypothesis import strategies as st

from raypaged.core.admission import Growth, OutputLengths, peak_blocks, projected_outputs
from raypaged.core.request import Request
from raypaged.core.sampling_params import SamplingParams


def blocks(tokens, bs):
    return -(-tokens // bs)


def simulated_peak(seqs, used_now, bs):
    """Every step T from now to the last end: min(nothing freed, only the alive hold blocks)."""
    peak = 0
    for t in range(max(g.remaining for g in seqs) + 1):
        no_frees = used_now + sum(blocks(g.now + min(t, g.remaining), bs) - g.held for g in seqs)
        alive = sum(blocks(g.now + t, bs) for g in seqs if g.remaining >= t)
        peak = max(peak, min(no_frees, alive))
    return peak


growth = st.builds(lambda now, extra, remaining, bs_held: (now, extra, remaining, bs_held),
                   st.integers(0, 60), st.integers(0, 3), st.integers(0, 40), st.booleans())


@settings(max_examples=300, deadline=None)
@given(raw=st.lists(growth, min_size=1, max_size=8), bs=st.sampled_from([1, 4, 16]),
       shared=st.integers(0, 5))
def test_peak_is_the_step_by_step_peak(raw, bs, shared):
    # held: the blocks of its computed tokens (or one fewer: a forked sample's shared blocks)
    seqs = [Growth(now, max(0, blocks(now, bs) - fork), remaining)
            for now, _, remaining, fork in raw]
    used_now = sum(g.held for g in seqs) - min(shared, sum(g.held for g in seqs))
    assert peak_blocks(seqs, used_now, bs) == simulated_peak(seqs, used_now, bs)


def test_peak_of_two_sequences_that_end_apart():
    # block 4: a holds 15 tokens, 5 to go (ends at 20 = 5 blocks); b holds 7, 12 to go (ends at
    # 19 = 5 blocks). At T=5 a is at 20 (5 blocks) and b at 12 (3): peak 8; at T=12 b alone: 5
    seqs = [Growth(15, 4, 5), Growth(7, 2, 12)]
    assert peak_blocks(seqs, used_now=6, block_size=4) == 8
    # b's 2 blocks are a's first two (a shared prefix: 4 in use): at T=5 the shared blocks
    # count once, 4 + 1 + 1 = 6; at T=12, 5 again
    assert peak_blocks(seqs, used_now=4, block_size=4) == 6


def test_open_max_tokens_are_projected_from_the_lengths_seen_beyond_what_was_produced():
    lengths = OutputLengths(window=3)
    req = Request("r", [1] * 10, SamplingParams(max_tokens=None), max_tokens=100)
    assert projected_outputs(req, lengths, block_size=16) == 16  # nothing seen: one block
    for n in (5, 30, 50, 71):
        lengths.record(n)  # the window keeps 30, 50, 71
    assert projected_outputs(req, lengths, block_size=16) == 51  # ceil((30 + 50 + 71) / 3)
    req.output_token_ids = [7] * 40  # it ran past 40: only 50 and 71 are still possible
    assert projected_outputs(req, lengths, block_size=16) == 61
    req.output_token_ids = [7] * 80  # past every length seen: one more block
    assert projected_outputs(req, lengths, block_size=16) == 96
    given_max = Request("g", [1] * 10, SamplingParams(max_tokens=40), max_tokens=40)
    assert projected_outputs(given_max, lengths, block_size=16) == 40  # taken at its word
