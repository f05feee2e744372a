"""On the real model: a request that makes the step fail (here: a sampler that raises on it) ends
with finish_reason "error" and its reason; the others in the same batches get exactly the
greedy tokens of a run without it."""
from raypaged import SamplingParams
from engine_prompts import PROMPTS

POISON_SEED = 666


class RaisingSampler:
    """The real sampler, except that it fails any batch holding a row seeded POISON_SEED."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __call__(self, logits, rows):
        if any(r.params.seed == POISON_SEED for r in rows):
            raise IndexError("index 99999999 is out of bounds for dimension 1")
        return self.sampler(logits, rows)


def test_a_poisoned_request_fails_alone_on_the_real_engine(llm, monkeypatch):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    clean = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy, use_tqdm=False)]

    runner = llm.engine.runner
    monkeypatch.setattr(runner, "sampler", RaisingSampler(runner.sampler))
    poison = SamplingParams(temperature=0.5, max_tokens=12, seed=POISON_SEED)
    outs = llm.generate([PROMPTS[0], "a poisoned prompt", PROMPTS[1], PROMPTS[2]],
                        [greedy, poison, greedy, greedy], use_tqdm=False)

    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "IndexError: index 99999999" in failed.stop_reason
    assert [outs[i].outputs[0].token_ids for i in (0, 2, 3)] == clean
    assert all(outs[i].outputs[0].finish_reason == "length" for i in (0, 2, 3))
    assert llm.engine.stats().memory.blocks_used == 0
