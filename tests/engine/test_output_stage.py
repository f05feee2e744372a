"""Detokenization and stop strings off the step thread (raypaged/output_stage.py).

The real Engine and EngineCore around a scripted runner (each request's tokens are fixed in
advance: the real tokenizer's ids of a chosen text) and SmolLM2's real tokenizer, so stop
strings fall across and inside real tokens. Every case runs in line and through the output
stage; both must give the same tokens, text, logprobs and finish/stop reasons, and no streamed
delta may ever show a stop string that ends the request.
"""
from __future__ import annotations

import threading
import time

import pytest

from raypaged.config import KVPlan
from raypaged.core.contracts import ScheduledBatch, StepResult, TokenLogprobs
from raypaged.core.engine_core import EngineCore
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler
from raypaged.engine import Engine
from raypaged.output_stage import OutputStage
from raypaged.outputs import CompletionOutput

TEXT = " The answer is Paris, of course. Paris is lovely in spring."


class ScriptedRunner:
    """Samples script[request][position]; sample k of n gets script[(request, k)] if given."""

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = scripts
        self.sampled: dict[str, int] = {}  # sequence id -> tokens sampled for it (incl. dropped)

    def execute(self, batch: ScheduledBatch) -> StepResult:
        sampled, logprobs = {}, {}
        for sr in batch.requests:
            if not sr.num_samples:
                continue
            rid = sr.request_id.split("#")[0]
            pos = len(sr.output_token_ids)
            toks = tuple(self.scripts.get(f"{rid}/{sr.sample_index + k}", self.scripts[rid])[pos]
                         for k in range(sr.num_samples))
            sampled[sr.request_id] = toks
            logprobs[sr.request_id] = tuple(TokenLogprobs(t, -pos - 0.5, 1, ()) for t in toks)
            for k in range(sr.num_samples):
                seq = sr.request_id if k == 0 else f"{sr.request_id}#{k}"
                self.sampled[seq] = self.sampled.get(seq, 0) + 1
        return StepResult(sampled, logprobs)


class SlowTokenizer:
    """The real tokenizer, `delay_s` slower per decode: the stage falls steps behind."""

    def __init__(self, tok, delay_s: float) -> None:
        self.tok, self.delay_s = tok, delay_s

    def __len__(self) -> int:
        return len(self.tok)

    def decode(self, ids, **kw) -> str:
        time.sleep(self.delay_s)
        return self.tok.decode(ids, **kw)


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_model_dir))


def make_engine(tokenizer, scripts) -> Engine:
    plan = KVPlan(kv_budget_bytes=64 * 16 * 64, bytes_per_token=64, block_size=16, num_blocks=64,
                  max_model_len=512)
    runner = ScriptedRunner(scripts)
    core = EngineCore(Scheduler(64, 16, 512), runner)
    return Engine(core, tokenizer, plan, "scripted", (), runner)  # no EOS: scripts end it


def run(engine: Engine, requests: dict[str, SamplingParams], threaded: bool,
        prompts: dict[str, list[int]] | None = None):
    """Every request to completion -> ({(request, index): CompletionOutput}, [text deltas])."""
    results: dict[tuple[str, int], CompletionOutput] = {}
    deltas: dict[tuple[str, int], list[str]] = {}
    lock = threading.Lock()

    def take(outs):
        with lock:
            for o in outs:
                key = (o.request_id, o.index)
                assert not results.setdefault(key, CompletionOutput(o.index)).finish_reason, \
                    f"{key}: an output after its last"
                results[key].add(o)
                deltas.setdefault(key, []).append(o.new_text)

    if threaded:
        engine.start_output_stage(take)
    try:
        for rid, params in requests.items():
            engine.add_request(rid, (prompts or {}).get(rid, [1, 2, 3]), params)
        while engine.has_unfinished():
            take(engine.step())
        if threaded:
            assert engine.stage.drain(timeout=30)
    finally:
        engine.stop_output_stage()
    return results, deltas


def both_ways(tok, scripts, requests, slow_s: float = 0.0):
    inline = run(make_engine(tok, scripts), requests, threaded=False)
    engine = make_engine(SlowTokenizer(tok, slow_s) if slow_s else tok, scripts)
    staged = run(engine, requests, threaded=True)
    assert staged == inline, "the output stage changed what a caller receives"
    assert not engine.core.has_unfinished()
    assert engine.outputs._seqs == {} and engine.outputs._prompts == {}
    assert engine.outputs._ended_here == set()
    return inline[0], inline[1], engine


def summary(out: CompletionOutput):
    return out.text, out.finish_reason, out.stop_reason


def test_stop_string_split_across_tokens(tok):
    ids = tok.encode(TEXT)
    results, deltas, _ = both_ways(tok, {"a": ids}, {"a": SamplingParams(stop=["answer is"],
                                                                        max_tokens=len(ids))})
    assert summary(results["a", 0]) == (" The ", "stop", "answer is")
    # tokens up to the one that completes the stop (" is"), and not one more
    assert results["a", 0].token_ids == tok.encode(" The answer is")
    assert not any("answer" in d for d in deltas["a", 0])


def test_stop_string_inside_one_token(tok):
    ids = tok.encode(TEXT)
    assert "ari" not in [tok.decode([t]) for t in ids] and " Paris" in [tok.decode([t]) for t in ids]
    results, deltas, _ = both_ways(tok, {"a": ids}, {"a": SamplingParams(stop=["ari"],
                                                                        max_tokens=len(ids))})
    assert summary(results["a", 0]) == (" The answer is P", "stop", "ari")
    assert results["a", 0].token_ids == tok.encode(" The answer is Paris")
    assert [lp.logprob for lp in results["a", 0].logprobs] == [-p - 0.5 for p in range(4)]


def test_the_earliest_of_several_stop_strings_wins_and_include_stop_str_keeps_it(tok):
    ids = tok.encode(TEXT)
    reqs = {"a": SamplingParams(stop=["spring", "course", "is Pa"], max_tokens=len(ids)),
            "b": SamplingParams(stop=["spring", "course"], include_stop_str_in_output=True,
                                max_tokens=len(ids))}
    results, deltas, _ = both_ways(tok, {"a": ids, "b": ids}, reqs)
    assert summary(results["a", 0]) == (" The answer ", "stop", "is Pa")
    assert summary(results["b", 0]) == (" The answer is Paris, of course", "stop", "course")
    assert not any("is" in d for d in deltas["a", 0][1:])


def test_max_tokens_and_a_stop_on_the_same_token_report_the_stop(tok):
    ids = tok.encode(TEXT)
    n = len(tok.encode(" The answer is"))
    results, _, _ = both_ways(tok, {"a": ids}, {"a": SamplingParams(stop=["answer is"],
                                                                   max_tokens=n)})
    assert summary(results["a", 0]) == (" The ", "stop", "answer is")


def test_tokens_sampled_after_a_stop_are_dropped_when_the_stage_lags(tok):
    # A slow tokenizer keeps the stage steps behind the step thread, so core samples tokens
    # past the stop before the stage's abort reaches it: the caller must never see them.
    ids = tok.encode(TEXT)
    results, deltas, engine = both_ways(tok, {"a": ids}, {"a": SamplingParams(
        stop=["Paris"], max_tokens=len(ids))}, slow_s=0.02)
    kept = tok.encode(" The answer is Paris")
    assert results["a", 0].token_ids == kept
    assert len(results["a", 0].logprobs) == len(kept)
    assert engine.runner.sampled["a"] > len(kept), "the stage did not lag: the test proves nothing"
    assert summary(results["a", 0]) == (" The answer is ", "stop", "Paris")


def test_n_samples_stop_each_on_its_own(tok):
    ids, other = tok.encode(TEXT), tok.encode(" Paris is far, of course not.")
    other += [other[-1]] * (len(ids) - len(other))
    results, _, _ = both_ways(tok, {"a": ids, "a/1": other}, {"a": SamplingParams(
        n=2, stop=["of course"], max_tokens=len(ids))}, slow_s=0.005)
    assert summary(results["a", 0]) == (" The answer is Paris, ", "stop", "of course")
    assert summary(results["a", 1]) == (" Paris is far, ", "stop", "of course")


def test_abort_through_the_stage_ends_every_sample(tok):
    ids = tok.encode(TEXT)
    engine = make_engine(tok, {"a": ids})
    got = []
    engine.start_output_stage(got.extend)
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=len(ids)))
        engine.step()
        engine.step()
        assert engine.abort("a") == []  # the outputs come through the stage
        assert engine.stage.drain(timeout=30)
    finally:
        engine.stop_output_stage()
    finals = sorted((o.index, o.finish_reason) for o in got if o.finished)
    assert finals == [(0, "abort"), (1, "abort")]
    assert [o.new_token_ids for o in got if o.index == 0 and not o.finished] == [(ids[0],), (ids[1],)]
    assert not engine.has_unfinished() and engine.outputs._prompts == {}


def test_the_real_model_streams_the_same_through_the_stage(llm):
    from engine_prompts import PROMPTS
    tok = llm.get_tokenizer()
    prompts = {f"p{i}": tok.encode(p) for i, p in enumerate(PROMPTS)}
    requests = {rid: SamplingParams(max_tokens=24, stop=[" the", ".", "\n"], logprobs=2,
                                    **({"temperature": 0} if i % 2 else {"seed": i}))
                for i, rid in enumerate(prompts)}
    inline = run(llm.engine, requests, threaded=False, prompts=prompts)
    staged = run(llm.engine, requests, threaded=True, prompts=prompts)
    # Tokens, text and finish exactly; logprob values to fp32 noise: a stopped sequence stays in
    # the batch a step longer through the stage, and a different batch shape rounds differently.
    assert staged[0].keys() == inline[0].keys() and staged[1] == inline[1]
    for key, want in inline[0].items():
        got = staged[0][key]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), key
        assert [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in got.logprobs] == \
            [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in want.logprobs], key
        assert [lp.logprob for lp in got.logprobs] == pytest.approx(
            [lp.logprob for lp in want.logprobs], abs=1e-4), key
    assert any(o.finish_reason == "stop" and isinstance(o.stop_reason, str)
               for o in inline[0].values()), "no stop string ended a request"
    assert llm.engine.stage is None and not llm.engine.has_unfinished()


def test_an_idle_stage_thread_sleeps_instead_of_polling():
    """The stage blocks on its queue: waiting for deltas takes no CPU (nor the GIL the step
    thread and the step executor need)."""
    stage = OutputStage(processor=None, sink=lambda outputs: None)  # idle: neither is called
    try:
        clock = time.pthread_getcpuclockid(stage._thread.ident)
        cpu = time.clock_gettime(clock)
        time.sleep(0.3)
        assert time.clock_gettime(clock) - cpu < 0.03
    finally:
        stage.stop()
    assert not stage._thread.is_alive()
