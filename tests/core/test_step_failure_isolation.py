"""A step that raises fails only the request(s) that cause it; the rest of the batch keeps its
tokens, its blocks and its place, as if the poison had never been sent."""
import pytest

from core_engine import make_engine, run_to_completion
from fake_runner import FakeRunner
from raypaged.core.engine_core import ERROR
from raypaged.core.sampling_params import SamplingParams

POISON_SEED = 666


class PoisonedRunner(FakeRunner):
    """Raises (like a sampler indexing past the vocabulary) whenever a poisoned request samples."""

    def __init__(self, *args, broken: bool = False):
        super().__init__(*args)
        self.broken = broken  # True: every execution fails (the engine itself is broken)
        self.calls = 0

    def execute(self, batch):
        self.calls += 1
        if self.broken or any(r.sampling.seed == POISON_SEED and r.num_samples
                              for r in batch.requests):
            raise IndexError("index 99999999 is out of bounds for dimension 1 with size 1000")
        return super().execute(batch)


def params(seed=None, n=1, max_tokens=12):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, seed=seed, n=n)


def add_good_requests(engine):
    engine.add_request("a", list(range(1, 10)), params())
    engine.add_request("b", list(range(20, 33)), params(n=2))   # forks: shared prompt blocks
    engine.add_request("c", list(range(40, 46)), params(max_tokens=30))


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


@OVERLAP
def test_the_poison_fails_alone_and_everyone_else_gets_exactly_the_tokens_of_a_clean_run(overlap):
    clean = make_engine(num_blocks=40)
    add_good_requests(clean)
    expected = run_to_completion(clean)

    engine = make_engine(num_blocks=40, overlap=overlap, runner=PoisonedRunner(40, 4))
    add_good_requests(engine)
    engine.add_request("poison", list(range(60, 70)), params(seed=POISON_SEED))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()

    failed = [d for d in deltas if d.finish_reason == ERROR]
    assert [d.request_id for d in failed] == ["poison"]
    assert failed[0].stop_reason.startswith("the request failed in the engine: IndexError: index")
    got = {}
    for d in deltas:
        got.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert {k: v for k, v in got.items() if k != "poison"} == expected
    assert got["poison"] == []
    assert engine.stats().memory.blocks_used == 0  # the poison's blocks came back too


@OVERLAP
def test_a_poisoned_sample_of_n_fails_with_its_siblings_and_frees_their_blocks(overlap):
    engine = make_engine(num_blocks=40, overlap=overlap, runner=PoisonedRunner(40, 4))
    engine.add_request("ok", list(range(1, 10)), params())
    engine.add_request("poison", list(range(60, 70)), params(seed=POISON_SEED, n=3))
    out = run_to_completion(engine)
    assert len(out["ok"]) == 12 and out["poison"] == []
    assert engine.stats().memory.blocks_used == 0


@OVERLAP
def test_a_broken_engine_is_not_blamed_on_its_requests(overlap):
    engine = make_engine(num_blocks=40, overlap=overlap, runner=PoisonedRunner(40, 4, broken=True))
    add_good_requests(engine)
    if overlap:
        assert engine.step() == []  # queues the first step; its failure surfaces in the next
    with pytest.raises(IndexError):
        engine.step()
    # one batched try + one per request alone, then the original error goes up (with overlap,
    # the step queued behind the failed one was refused without running)
    assert engine.runner.calls == 1 + 3


@OVERLAP
def test_a_failed_chunk_leaves_no_cached_prefix_behind_for_a_retry(overlap):
    """A prompt's blocks enter the prefix cache once the step that writes them has run. With
    overlap, step N+1 is scheduled before step N is applied: the blocks step N+1 is to fill must
    not be registered then, or, when step N+1 fails for that request (nothing written), the retry
    of the same prompt hits blocks that never held its KV."""
    engine = make_engine(num_blocks=16, max_num_batched_tokens=8, overlap=overlap,
                         runner=PoisonedRunner(16, 4))
    prompt = list(range(100, 116))  # 4 full blocks: chunk 0..7 (blocks 0 1), 8..15 (2 3) samples
    engine.add_request("poison", prompt, params(seed=POISON_SEED))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("poison", ERROR)]
    pool = engine.scheduler.kv.pool
    assert sorted(b.block_id for b in pool.cached.values()) == [0, 1]  # the chunk that ran

    engine.add_request("retry", prompt, params())
    out = run_to_completion(engine)
    retry = [sr for b in engine.runner.batches for sr in b.requests if sr.request_id == "retry"]
    assert retry[0].start_position == 8  # hits blocks 0 1, computes 8..15 again
    clean = make_engine(num_blocks=16, max_num_batched_tokens=8)
    clean.add_request("retry", prompt, params())
    assert out == run_to_completion(clean)


@OVERLAP
def test_a_copy_on_write_in_a_failed_step_keeps_the_copying_samples_kv(overlap):
    """The step that fails also holds the first divergent write of a forked request: "r" copies
    the shared partial block 2 to block 3 and writes position 10 there. Run again request by
    request, the copy must not be applied again after r's own write (in r#1's run), or r's KV
    at position 10 is the shared block's, and r's next steps read the wrong KV."""
    clean = make_engine(num_blocks=16)
    clean.add_request("r", list(range(10)), params(n=2, max_tokens=4))
    expected = run_to_completion(clean)

    engine = make_engine(num_blocks=16, overlap=overlap, runner=PoisonedRunner(16, 4))
    engine.add_request("r", list(range(10)), params(n=2, max_tokens=4))  # blocks 0 1 2
    deltas = []
    while "r#1" not in engine.scheduler.requests:  # prefill, then fork
        deltas += engine.step()
    engine.add_request("poison", list(range(60, 63)), params(seed=POISON_SEED))
    while engine.has_unfinished():
        deltas += engine.step()
    copies = [b.block_copies for b in engine.runner.batches if b.block_copies]
    assert copies[0] == ((2, 3),)  # r writes position 10 into block 3, r#1 keeps block 2
    got = {}
    for d in deltas:
        got.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert {d.request_id: d.finish_reason for d in deltas if d.finished} == \
        {"r": "length", "r#1": "length", "poison": ERROR}
    assert {k: v for k, v in got.items() if k != "poison"} == expected


class LatePoisonedRunner(FakeRunner):
    """Fails the poisoned request once it has sampled five tokens: an error mid-output."""

    def execute(self, batch):
        for r in batch.requests:
            if r.sampling.seed == POISON_SEED and r.num_samples and r.start_position >= 10 + 4:
                raise IndexError("index 99999999 is out of bounds for dimension 1 with size 1000")
        return super().execute(batch)


@OVERLAP
def test_the_samples_of_one_request_failing_alone_are_one_culprit_not_a_broken_engine(overlap):
    """Forked samples p and p#1 are the whole batch and both fail alone: one request's fault
    (they share its prompt and params), so p fails with "error" and the engine goes on."""
    engine = make_engine(num_blocks=40, overlap=overlap, runner=LatePoisonedRunner(40, 4))
    engine.add_request("p", list(range(60, 70)), params(seed=POISON_SEED, n=2, max_tokens=30))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert {d.request_id: d.finish_reason for d in deltas if d.finished} == {"p": ERROR, "p#1": ERROR}
    assert engine.stats().memory.blocks_used == 0
    engine.add_request("next", list(range(1, 10)), params())
    assert len(run_to_completion(engine)["next"]) == 12


@OVERLAP
def test_two_requests_failing_alone_with_no_survivor_are_a_broken_engine(overlap):
    """Two different requests, the whole batch, each fail alone: as a broken engine would."""
    engine = make_engine(num_blocks=40, overlap=overlap, runner=PoisonedRunner(40, 4))
    engine.add_request("p1", list(range(60, 70)), params(seed=POISON_SEED))
    engine.add_request("p2", list(range(70, 80)), params(seed=POISON_SEED))
    with pytest.raises(IndexError):
        while engine.has_unfinished():
            engine.step()


def test_a_request_the_engine_failed_mid_output_is_not_counted_as_an_output_length():
    engine = make_engine(num_blocks=40, runner=LatePoisonedRunner(40, 4))
    engine.add_request("good", list(range(1, 10)), params(max_tokens=12))
    engine.add_request("poison", list(range(60, 70)), params(seed=POISON_SEED, max_tokens=30))
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    failed = [d for d in deltas if d.finish_reason == ERROR]
    assert [d.request_id for d in failed] == ["poison"]
    assert sum(len(d.new_token_ids) for d in deltas if d.request_id == "poison") == 5
    # headroom admission projects an open max_tokens from the lengths outputs ended at by
    # themselves: the failed request's 5 tokens say nothing about that (12, not (12 + 5) / 2)
    assert engine.scheduler.output_lengths.expected(0) == 12
