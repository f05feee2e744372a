"""Seeded random drive of EngineCore (Scheduler + KVCacheManager + BlockPool) over a tiny pool
of 10-20 blocks: add (shared prefixes, salts, n > 1, stop rules, continuations, held
requests, now and then a request that makes the runner fail), step, abort and release, in
both the synchronous and the overlapped loop. After every operation:

    blocks    conserved; free xor referenced; ref counts = the tables holding each block;
              only running sequences hold blocks, each exactly ceil(computed / block_size)
    cache     each hash maps to a block carrying it; a cached block holds the tokens its
              hash names (checked against the runner's KV); no hash spans two salts; a
              table's cached block carries that request's own hash; routers' summary = pool
    steps     within max_num_batched_tokens and max_num_seqs; the runner's per-request
              block-table rows (kept as model/input_buffers.py keeps them) never go stale
    outputs   every sequence's tokens are the deterministic ones, and one not aborted ends
              at exactly the token (and with the reason) its stop rules name; only the
              poisoned fail ("error" also hides a wrong KV read caught by the fake runner)
"""
import random
from collections import Counter

import pytest

import raypaged.core.request as request_module
from raypaged.core.block_hash import hash_block_tokens
from raypaged.core.cache_summary import CacheView, block_key
from raypaged.core.contracts import Continuation
from raypaged.core.request import RequestStatus
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduling_policy import FIRST_RULES, FITS, SchedulingPolicy

from core_engine import free_blocks, make_engine
from fake_runner import FakeRunner, next_token

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48
POISON_SEED = 666


class RowRunner(FakeRunner):
    """Keeps each request's block table between steps as model/input_buffers.py does (a row
    per id, written from the last known entry on; from the write position on after a
    copy-on-write; dropped when finished_request_ids names the id), and checks it is the
    table the step sends: a departure never announced leaves a stale row behind."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        super().__init__(num_blocks, block_size)
        self.rows: dict[str, list[int]] = {}
        self.max_num_seqs = max_num_seqs

    def execute(self, batch):
        for rid in batch.finished_request_ids:
            self.rows.pop(rid, None)
        for r in batch.requests:
            known = self.rows.setdefault(r.request_id, [])
            first = min(len(known), r.start_position // self.block_size) \
                if batch.block_copies else len(known)
            known[first:] = r.block_table[first:]
            assert known == list(r.block_table), f"{r.request_id}: stale block table row"
        assert len(self.rows) <= self.max_num_seqs, f"rows never freed: {sorted(self.rows)}"
        if any(r.sampling.seed == POISON_SEED and r.num_samples for r in batch.requests):
            raise IndexError("poisoned: fails before writing any KV")
        return super().execute(batch)


class Model:
    """What every sequence must produce, and what every chain hash names."""

    def __init__(self) -> None:
        self.tokens_of_hash: dict[bytes, tuple[int, ...]] = {}
        self.salt_of_hash: dict[bytes, str | None] = {}
        # id -> (prompt, SamplingParams, eos, max_tokens, outputs a continuation brought)
        self.specs: dict[str, tuple] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}

    def recording_hasher(self, token_ids, block_size, cache_salt=None, max_blocks=None, start=0,
                         parent=None):
        out = hash_block_tokens(token_ids, block_size, cache_salt, max_blocks, start, parent)
        for k, h in enumerate(out):
            i = start + k
            tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
            assert self.tokens_of_hash.setdefault(h, tokens) == tokens, "hash collision"
            # a prefix is never shared across salts: each hash names one salt
            assert self.salt_of_hash.setdefault(h, cache_salt or None) == (cache_salt or None)
        return out

    def expected(self, rid: str) -> tuple[list[int], str]:
        """The sequence's whole output and its finish reason, if it is never aborted."""
        prompt, sp, eos, max_tokens, _ = self.specs[rid.split("#")[0]]
        index = int(rid.split("#")[1]) if "#" in rid else 0
        seq, out = list(prompt), []
        while True:
            tok = next_token(seq, index)
            seq.append(tok)
            out.append(tok)
            past_min = len(out) > sp.min_tokens
            if past_min and (tok in sp.stop_token_ids or (not sp.ignore_eos and tok == eos)):
                return out, "stop"
            if len(out) >= max_tokens or len(seq) >= MAX_MODEL_LEN:
                return out, "length"


def check_pool(eng, model: Model, num_blocks: int, kv_settled: bool) -> None:
    sched, kv = eng.scheduler, eng.scheduler.kv
    pool, bs = kv.pool, kv.block_size
    queue = [b.block_id for b in free_blocks(pool)]
    assert len(queue) == len(set(queue)) == len(pool.free_queue)
    in_queue = set(queue)
    refs = Counter(bid for table in kv.block_ids.values() for bid in table)
    for block in pool.blocks:
        # conserved: free xor referenced, and referenced exactly by the tables that hold it
        assert (block.ref_count == 0) == (block.block_id in in_queue), block
        assert block.ref_count == refs[block.block_id], block
    assert sum(1 for b in pool.blocks if b.ref_count) + len(in_queue) == num_blocks
    used, cached, empty = pool.count_by_state()
    assert cached == sum(1 for b in pool.blocks if not b.ref_count and b.block_hash is not None)
    assert used + cached + empty == num_blocks
    # only running sequences hold blocks; each table covers exactly its computed tokens
    assert set(kv.tables) == {r.request_id for r in sched.running}
    for req in sched.running:
        assert req.status is RequestStatus.RUNNING
        table = kv.block_ids[req.request_id]
        assert [b.block_id for b in kv.tables[req.request_id]] == table
        assert len(table) == len(set(table))
        assert len(table) == -(-req.num_computed_tokens // bs), req
        for i, block in enumerate(kv.tables[req.request_id]):  # a hit is on its own prefix
            if block.block_hash is not None and i < len(req.block_hashes):
                assert block.block_hash == req.block_hashes[i], (req, i, block)
    for req in list(sched.waiting) + list(sched.held.values()):
        assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert req.num_computed_tokens == 0 and req.num_placeholders == 0
    # the hash map and the blocks agree; a cached block holds the tokens its hash names
    for h, block in pool.cached.items():
        assert block.block_hash == h
        if kv_settled:
            assert tuple(eng.runner.kv[block.block_id]) == model.tokens_of_hash[h], block
    assert all(pool.cached.get(b.block_hash) is b for b in pool.blocks if b.block_hash)
    # the routers' summary names exactly the cached blocks
    assert pool.summary.keys == {block_key(h) for h in pool.cached}
    assert sched.num_queued_tokens == sum(
        r.num_tokens + r.num_placeholders - r.num_computed_tokens
        for q in (sched.waiting, sched.running, sched.held.values()) for r in q)


def check_batch(eng, batch, max_num_seqs: int, max_tokens: int) -> None:
    assert sum(len(r.token_ids) for r in batch.requests) <= max_tokens
    assert len(batch.requests) <= max_num_seqs
    assert len({r.request_id for r in batch.requests}) == len(batch.requests)
    assert all(len(r.token_ids) > 0 for r in batch.requests)
    seats = sum(1 if r.forked else r.sampling.n for r in eng.scheduler.running)
    assert seats <= max_num_seqs


def apply_deltas(model: Model, deltas) -> None:
    for d in deltas:
        assert d.request_id not in model.finish, f"{d.request_id} produced after finishing"
        if d.finish_reason == "error":  # only the poisoned; a wrong KV read raises in the runner
            assert model.specs[d.request_id.split("#")[0]][1].seed == POISON_SEED, d
        model.outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
        if d.finished:
            model.finish[d.request_id] = d.finish_reason


POLICIES = {
    "headroom_bounded": SchedulingPolicy(),
    "first_rules": FIRST_RULES,
    "fits_bounded": SchedulingPolicy(admission_policy=FITS),
}


def drive(seed: int, policy, overlap: bool, num_ops: int = 400):
    rng = random.Random(seed)
    num_blocks = rng.choice([10, 12, 16, 20])
    max_num_seqs = rng.choice([2, 3, 4, 8])
    budget = rng.choice([4, 7, 8, 16, 32])
    eng = make_engine(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, overlap=overlap,
                      policy=policy, prefix=rng.random() < 0.85,
                      runner=RowRunner(num_blocks, BLOCK_SIZE, max_num_seqs))
    model = Model()
    view = CacheView()
    request_module_hasher = request_module.hash_block_tokens
    request_module.hash_block_tokens = model.recording_hasher
    prefixes = [[rng.randrange(4) for _ in range(rng.choice([4, 8, 9]))] for _ in range(3)]
    ids: list[str] = []
    try:
        for _ in range(num_ops):
            op = rng.random()
            if op < 0.3:
                rid = f"r{len(ids)}"
                prompt = (rng.choice(prefixes) if rng.random() < 0.7 else []) + \
                    [rng.randrange(4) for _ in range(rng.choice([0, 1, 3, 4, 8]))]
                prompt = prompt or [1]
                n = rng.choice([1, 1, 1, 2, 3])
                max_tokens = rng.randint(1, 12)
                # stop rules hit the sequence's own tokens (the fake runner's are deterministic)
                ahead, seq = [], list(prompt)
                for _ in range(max_tokens):
                    ahead.append(next_token(seq))
                    seq.append(ahead[-1])
                eos = rng.choice(ahead) if rng.random() < 0.4 else None
                stops = (rng.choice(ahead),) if rng.random() < 0.3 else ()
                # fails in the runner whenever it samples; one at a time (a batch whose every
                # request fails alone is taken for a broken engine: EngineCore raises)
                poison = rng.random() < 0.1 and not any(
                    r.sampling.seed == POISON_SEED for r in eng.scheduler.requests.values())
                sp = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens,
                                    min_tokens=rng.choice([0, 0, 1, 2]) if max_tokens > 2 else 0,
                                    stop_token_ids=stops, ignore_eos=rng.random() < 0.2,
                                    seed=POISON_SEED if poison else None)
                model.specs[rid] = (prompt, sp, eos, max_tokens, 0)
                # a continuation (n = 1) resumes a sample after outputs it already has
                whole = model.expected(rid)[0]
                continuation = None
                if n == 1 and len(whole) > 1 and rng.random() < 0.15:
                    done = rng.randrange(1, len(whole))
                    continuation = Continuation(0, tuple(whole[:done]), 0)
                    model.specs[rid] = (prompt, sp, eos, max_tokens, done)
                ids.append(rid)
                try:
                    eng.add_request(rid, prompt, sp, eos_token_id=eos, continuation=continuation,
                                    cache_salt=rng.choice([None, None, "a", "b"]),
                                    held=rng.random() < 0.1)
                except ValueError:
                    del model.specs[rid]  # can never be served: refused, nothing queued
            elif op < 0.38 and ids:
                target = rng.choice(ids) + rng.choice(["", "", "#1", "#2"])  # any state
                apply_deltas(model, eng.abort(target))
            elif op < 0.42 and eng.scheduler.held:
                eng.release(rng.choice(sorted(eng.scheduler.held)))
            else:
                batches = len(eng.runner.batches)
                apply_deltas(model, eng.step())
                for batch in eng.runner.batches[batches:]:
                    check_batch(eng, batch, max_num_seqs, budget)
            check_pool(eng, model, num_blocks, kv_settled=not overlap)
            view.apply(eng.scheduler.kv.pool.summary.delta_since(view.version))
            assert view.keys == eng.scheduler.kv.pool.summary.keys
        for rid in sorted(eng.scheduler.held):
            eng.release(rid)
        for _ in range(5000):
            if not eng.has_unfinished():
                break
            apply_deltas(model, eng.step())
            check_pool(eng, model, num_blocks, kv_settled=not overlap)
        else:
            raise AssertionError(f"the engine did not drain: {eng.scheduler.requests}")
        check_pool(eng, model, num_blocks, kv_settled=True)
    finally:
        request_module.hash_block_tokens = request_module_hasher
    assert eng.scheduler.kv.pool.num_free == num_blocks and not eng.scheduler.kv.tables
    assert eng.scheduler.num_queued_tokens == 0
    # every sequence: the deterministic tokens; unaborted ones end exactly where their rules say
    for rid, reason in model.finish.items():
        want, why = model.expected(rid)
        want = want[model.specs[rid.split("#")[0]][4]:]  # after a continuation's outputs
        got = model.outputs.get(rid, [])
        if reason in ("abort", "error"):
            assert got == want[:len(got)], rid
        else:
            assert (got, reason) == (want, why), rid
    return eng, model


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_random_drive_keeps_blocks_cache_budgets_and_outputs_right(policy, overlap):
    preemptions = evictions = hits = copies = 0
    for seed in range(16):
        eng, model = drive(seed, policy, overlap)
        preemptions += eng.stats().num_preemptions
        evictions += eng.stats().memory.evictions
        hits += eng.stats().memory.prefix_hits
        copies += eng.stats().memory.cow_copies
        assert set(model.finish) >= set(model.specs)  # every admitted request finished
    assert evictions > 0 and hits > 0 and copies > 0  # the drive exercised them
    if policy is not POLICIES["headroom_bounded"]:
        assert preemptions > 0
