"""A small engine with the real Engine's interface, for testing the serving layer fast.

It is the real EngineCore (scheduler, block pool, prefix cache) driven by a deterministic runner
and a byte-level tokenizer, so KV usage, prefix hits and aborts behave like the real thing while
a step costs microseconds. `step_delay_s` slows it down for tests that need requests in flight.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

from raypaged.config import KVPlan
from raypaged.core.contracts import ScheduledBatch, StepResult, TokenLogprobs
from raypaged.core.engine_core import EngineCore
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.scheduler import Scheduler
from raypaged.outputs import SequenceOutput

EOS = 256
LETTERS = range(ord("a"), ord("z") + 1)


class ByteTokenizer:
    """Token id = byte value; 256 is end-of-sequence."""

    eos_token_id = EOS
    name_or_path = "fake-bytes"

    def __len__(self) -> int:
        return 257

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        text = "".join(f"<{m['role']}>{m.get('content') or ''}</{m['role']}>\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text


# A request seeded with this makes every step it samples in raise, as a request that trips a bug
# in a real sampler would: for testing that it fails alone.
POISON_SEED = 666
# A request seeded with this kills the worker process that steps it (a segfault in a kernel, an
# abort in a native library): for testing the worker lifecycle.
CRASH_SEED = 667


class LetterRunner:
    """Next token: a letter chosen by a hash of the sequence (greedy) or by a seeded RNG."""

    def __init__(self, step_delay_s: float = 0.0):
        self.step_delay_s = step_delay_s

    def execute(self, batch: ScheduledBatch) -> StepResult:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if any(sr.sampling.seed == CRASH_SEED for sr in batch.requests):
            os._exit(1)
        if any(sr.sampling.seed == POISON_SEED and sr.num_samples for sr in batch.requests):
            raise IndexError("index 99999999 is out of bounds for dimension 1 with size 257")
        sampled, logprobs = {}, {}
        for sr in batch.requests:
            if not sr.num_samples:
                continue
            ctx = list(sr.prompt_token_ids) + list(sr.output_token_ids)
            toks = tuple(self._pick(ctx, sr.sampling, sr.sample_index + j)
                         for j in range(sr.num_samples))
            sampled[sr.request_id] = toks
            if sr.sampling.logprobs is not None:
                top = range(sr.sampling.logprobs)
                logprobs[sr.request_id] = tuple(
                    TokenLogprobs(t, -0.25, 1, tuple((t + k, -0.25 - k) for k in top))
                    for t in toks)
        return StepResult(sampled=sampled, logprobs=logprobs)

    @staticmethod
    def _pick(ctx: list[int], sp: SamplingParams, sample_index: int) -> int:
        if sp.temperature == 0 or sp.seed is not None:
            acc = 17 + 7919 * sample_index + (sp.seed or 0) * 104729
            for i, t in enumerate(ctx):
                acc = (acc * 31 + t * (i + 1)) % 1_000_003
            return LETTERS[acc % len(LETTERS)]
        return random.choice(LETTERS)


@dataclass
class FakeEngine:
    max_model_len: int = 256
    block_size: int = 16
    num_blocks: int = 64
    step_delay_s: float = 0.0
    model_name: str = "fake-model"
    output_thread: bool = False  # Engine's attributes the worker reads: outputs come from step()
    stage = None
    runner = None                # no model runner: no CUDA-graph counters

    def __post_init__(self):
        self.tokenizer = ByteTokenizer()
        self.plan = KVPlan(kv_budget_bytes=self.num_blocks * self.block_size * 64,
                           bytes_per_token=64, block_size=self.block_size,
                           num_blocks=self.num_blocks, max_model_len=self.max_model_len)
        self.core = EngineCore(Scheduler(self.num_blocks, self.block_size, self.max_model_len),
                               LetterRunner(self.step_delay_s))
        self._meta: dict[str, tuple[SamplingParams, int]] = {}
        self._text: dict[tuple[str, int], str] = {}
        self.block_hashes_given: dict[str, list[bytes]] = {}  # request id -> the router's hashes

    def add_request(self, request_id, prompt_token_ids, params, cache_salt=None,
                    continuation=None, block_hashes=()):
        self.block_hashes_given[request_id] = list(block_hashes)
        self.core.add_request(request_id, prompt_token_ids, params, eos_token_id=EOS,
                              cache_salt=cache_salt, continuation=continuation,
                              block_hashes=block_hashes)
        self._meta[request_id] = (params, len(prompt_token_ids))
        if continuation is not None:  # the text the client has: bytes decode one to one
            key = (request_id, continuation.sample_index)
            self._text[key] = self.tokenizer.decode(continuation.output_token_ids)
            assert len(self._text[key]) == continuation.text_chars

    def step(self) -> list[SequenceOutput]:
        return [self._output(d) for d in self.core.step()]

    def abort(self, request_id) -> list[SequenceOutput]:
        return [self._output(d) for d in self.core.abort(request_id)]

    def has_unfinished(self):
        return self.core.has_unfinished()

    def stats(self):
        return self.core.stats()

    def cache_summary(self):
        return self.core.cache_summary()

    def _output(self, d) -> SequenceOutput:
        rid = d.parent_id or d.request_id
        params, num_prompt = self._meta[rid]
        key = (rid, d.sample_index)
        before = self._text.get(key, "")
        text = before + self.tokenizer.decode(d.new_token_ids)
        finish, stop_reason = d.finish_reason, d.stop_reason
        for stop in params.stop:
            at = text.find(stop)
            if at >= 0:
                text, finish, stop_reason = text[:at], "stop", stop
                self.core.abort(d.request_id)
                break
        self._text[key] = text
        if finish is not None:
            self._text.pop(key, None)
        return SequenceOutput(rid, d.sample_index, d.new_token_ids, text[len(before):],
                              d.new_logprobs, finish, stop_reason, num_prompt, d.num_cached_tokens)


# Models a Ray worker process builds this engine for once install() has run there. The tests
# start Ray with runtime_env={"worker_process_setup_hook": SETUP_HOOK} and name one as the
# application's `model`, as a user names a model folder (absolute: the CLI and the batch job make
# a model path absolute, which leaves these as they are).
FAKE_MODEL = "/raypaged-fake-engine"
# 20 ms a step, so requests are still running when a test breaks a worker
SLOW_FAKE_MODEL = "/raypaged-fake-engine-slow"
STEP_DELAY_S = {FAKE_MODEL: 0.0, SLOW_FAKE_MODEL: 0.02}
SETUP_HOOK = "tests.serve.fake_engine.install"


def install() -> None:
    """Ray's worker_process_setup_hook (it runs in every worker process of the cluster's jobs):
    `Engine.from_args` builds a FakeEngine for the models above, the real engine for any other."""
    from raypaged.engine import Engine

    real = Engine.from_args.__func__

    def from_args(cls, args):
        if args.model not in STEP_DELAY_S:
            return real(cls, args)
        return FakeEngine(max_model_len=args.max_model_len or 256, block_size=args.block_size,
                          step_delay_s=STEP_DELAY_S[args.model])

    Engine.from_args = classmethod(from_args)
