"""The router hashes a prompt once: the worker's engine takes the router's block hashes, which
are its own hashes byte for byte, and hashes only the blocks past them."""
import pytest

import raypaged.core.request as request_module
from fake_engine import FakeEngine
from local_fleet import LocalFleet, post_once
from raypaged.core.block_hash import hash_block_tokens
from raypaged.core.contracts import Continuation
from raypaged.core.engine_core import EngineCore
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler
from raypaged.serve.config import ServeOptions
from raypaged.serve.fleet_loads import FleetLoads
from raypaged.serve.routing import Router

BS = 4
PROMPT = list(range(100, 143))  # 43 tokens: 10 full blocks


class _Runner:
    def execute(self, batch):
        from raypaged.core.contracts import StepResult
        return StepResult(sampled={r.request_id: (7,) for r in batch.requests if r.num_samples})


def _engine(block_size=BS):
    return EngineCore(Scheduler(64, block_size, 256), _Runner())


@pytest.fixture
def hashed(monkeypatch):
    """Counts the blocks the engine's requests hash themselves."""
    count = []
    real = request_module.hash_block_tokens

    def counting(tokens, block_size, *a, start=0, **k):
        out = real(tokens, block_size, *a, start=start, **k)
        count.append(len(out))
        return out
    monkeypatch.setattr(request_module, "hash_block_tokens", counting)
    return count


@pytest.mark.parametrize("routing", ["hash", "cache_aware"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_the_engine_keeps_the_routers_hashes_and_hashes_only_the_rest(routing, salt, hashed):
    router = Router(ServeOptions(routing=routing, route_prefix_blocks=4), BS)
    keys = router.prompt_keys(PROMPT, salt, FleetLoads(["a"], [0]))
    assert len(keys.hashes) == 4 if routing == "hash" else len(keys.hashes) == 10
    assert list(keys.hashes) == hash_block_tokens(PROMPT, BS, salt)[:len(keys.hashes)]
    engine = _engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=2), cache_salt=salt,
                       block_hashes=keys.hashes)
    engine.step()  # admission extends the chain over the prompt's full blocks
    (req,) = engine.scheduler.requests.values()
    assert req.block_hashes == hash_block_tokens(PROMPT, BS, salt)  # the engine's own chain
    assert sum(hashed) == 10 - len(keys.hashes)                      # the rest, and only it


GOOD = hash_block_tokens(PROMPT, BS)[:6]


def _with(i, value, hashes=GOOD):
    return [*hashes[:i], value, *hashes[i + 1:]]


@pytest.mark.parametrize("given", [
    hash_block_tokens(PROMPT, 8),                     # a router of another block size
    hash_block_tokens(PROMPT, BS, "tenant-b"),        # another salt
    hash_block_tokens(PROMPT + [1] * 8, BS),          # more blocks than the prompt has
    _with(2, GOOD[2][:15]),                           # a digest of the wrong length
    _with(2, GOOD[2] + b"\0"),
    _with(2, GOOD[2].hex()),                          # not bytes
    _with(2, bytearray(GOOD[2])),                     # equal to bytes, yet not bytes
    _with(2, None),
    # the last hash not that of its block's tokens (the router hashed other tokens there)
    hash_block_tokens(PROMPT[:20] + [0] * 4, BS),
    _with(5, GOOD[4]),                                # the last one repeated
    iter(GOOD),                                       # not a list or tuple
], ids=["block_size", "salt", "too_many", "short_digest", "long_digest", "str", "bytearray",
        "none", "last_tokens", "last_repeated", "iterator"])
def test_hashes_that_cannot_be_the_engines_are_dropped_and_the_engine_hashes_itself(given, hashed):
    engine = _engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=2), block_hashes=given)
    engine.step()
    (req,) = engine.scheduler.requests.values()
    assert req.block_hashes == hash_block_tokens(PROMPT, BS)
    assert sum(hashed) == 10


@pytest.mark.parametrize("given", [GOOD, tuple(GOOD), GOOD[:1], GOOD[:2]])
def test_well_formed_hashes_are_kept_as_a_list_or_a_tuple(given, hashed):
    engine = _engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=2), block_hashes=given)
    engine.step()
    (req,) = engine.scheduler.requests.values()
    assert req.block_hashes == hash_block_tokens(PROMPT, BS)
    assert sum(hashed) == 10 - len(given)


# 13: the last block all outputs; 11: block 10 is 3 prompt tokens and 1 output
@pytest.mark.parametrize("n", [13, 11])
def test_a_continuations_hashes_cover_the_prompt_and_the_outputs_it_resumes_after(n, hashed):
    outputs = [5] * 9  # 43 + 9 = 52 tokens: 13 full blocks
    given = hash_block_tokens(PROMPT + outputs, BS)[:n]
    engine = _engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=20), block_hashes=given,
                       continuation=Continuation(0, tuple(outputs), 9))
    engine.step()
    (req,) = engine.scheduler.requests.values()
    assert req.block_hashes[:13] == hash_block_tokens(PROMPT + outputs, BS)
    assert sum(hashed) == 13 - n


def test_a_continuation_whose_outputs_the_router_hashed_otherwise_is_hashed_here(hashed):
    outputs = [5] * 9
    given = hash_block_tokens(PROMPT + [6] * 9, BS)  # the last block: other output tokens
    engine = _engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=20), block_hashes=given,
                       continuation=Continuation(0, tuple(outputs), 9))
    engine.step()
    (req,) = engine.scheduler.requests.values()
    assert req.block_hashes[:13] == hash_block_tokens(PROMPT + outputs, BS)
    assert sum(hashed) == 13


@pytest.mark.parametrize("routing", ["round_robin", "hash", "cache_aware"])
def test_a_served_request_carries_the_routers_hashes_to_its_worker(routing):
    fleet = LocalFleet(n=2)
    engines = [w.engine for w in fleet.workers.values()]
    assert isinstance(engines[0], FakeEngine)
    prompt = list(range(65, 65 + 40))
    r, _ = post_once(fleet, {"model": "fake-model", "prompt": prompt, "max_tokens": 2},
                     options=ServeOptions(routing=routing))
    assert r.status_code == 200
    (given,) = [h for e in engines for h in e.block_hashes_given.values()]
    bs = engines[0].block_size
    if routing == "round_robin":
        assert given == []  # it hashes nothing: the worker does it all
    else:
        assert given and given == hash_block_tokens(prompt, bs)[:len(given)]
