"""Engine: core's EngineCore plus the tokenizer side (detokenization, stop strings, extra EOS
ids). `Engine.from_args` is the one way to get one: the offline `LLM`, the worker actor and the
batch job all call it. How the model runs is decided in raypaged/model/setup.py.
"""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, wait
from typing import Callable, Sequence

from raypaged.config import EngineArgs, KVPlan
from raypaged.core.contracts import Continuation, EngineStats, RequestDelta
from raypaged.core.engine_core import ERROR, EngineCore
from raypaged.settings import flag
from raypaged.core.sampling_params import SamplingParams
from raypaged.output_processor import IncrementalDetokenizer, OutputProcessor
from raypaged.output_stage import OutputStage
from raypaged.outputs import SequenceOutput


class Engine:
    """EngineCore plus the tokenizer side. Outputs come back from `step()` / `abort()` (in line),
    or, once `start_output_stage(sink)` has run, from the output stage's thread to `sink`."""

    def __init__(self, core: EngineCore, tokenizer, plan: KVPlan, model_name: str,
                 eos_token_ids: tuple[int, ...], runner=None, output_thread: bool = False,
                 grammars=None) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.plan = plan
        self.model_name = model_name
        self.max_model_len = plan.max_model_len
        self.block_size = plan.block_size
        self.eos_token_ids = eos_token_ids
        self.runner = runner
        self.output_thread = output_thread  # whether serving should start the output stage
        self.outputs = OutputProcessor(tokenizer)
        self.stage: OutputStage | None = None
        self.grammars = grammars  # model/grammar.py GrammarCache, shared with the sampler
        # request id -> (its grammar's Compile, its spec): held out of the scheduler until then
        self._compiling: dict[str, tuple] = {}

    @classmethod
    def from_args(cls, args: EngineArgs) -> Engine:
        """Load the model and tokenizer named by `args` and assemble a ready engine."""
        from transformers import AutoTokenizer

        from raypaged.model.default_model import MODEL_NAME
        from raypaged.model.grammar import GrammarCache
        from raypaged.model.setup import ModelSetup

        setup = ModelSetup.decide(args)
        model = setup.load_model()  # first: nothing before it may run a oneDNN primitive
        tokenizer = AutoTokenizer.from_pretrained(str(setup.model_dir))
        eos = setup.config.eos_token_ids
        grammars = GrammarCache(tokenizer, setup.config.vocab_size, eos,
                            max_compile_s=args.max_structured_output_compile_s)
        core, plan, runner = setup.build_core(model, grammars)
        name = args.model or MODEL_NAME
        return cls(core, tokenizer, plan, name, eos, runner, args.output_thread, grammars)

    def start_output_stage(self, sink: Callable[[list[SequenceOutput]], None]) -> None:
        """From now on detokenize on a thread of its own: step() and abort() return [] and every
        output goes to sink, called on that thread. The caller (the serving step thread) must
        be the only thread calling this engine's other methods."""
        assert self.stage is None and not self.core.has_unfinished(), "start before any request"
        self.stage = OutputStage(self.outputs, sink)

    def stop_output_stage(self) -> None:
        if self.stage is not None:
            self.stage.stop()
            self.stage = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, continuation: Continuation | None = None,
                    block_hashes: Sequence[bytes] = ()) -> None:
        """Queue a request; raises ValueError with the reason when it can never be served.
        A continuation resumes one sample begun on another engine (serving's failover);
        `block_hashes`: see EngineCore.add_request."""
        if not isinstance(request_id, str) or not request_id or "#" in request_id:
            raise ValueError(f"request_id must be a non-empty string without '#', got {request_id!r}")
        # With an output stage this reads the stage thread's map; a dict lookup is atomic, and
        # a request id the stage is about to forget is one core has finished with anyway.
        if self.outputs.tracks(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        # Re-check here whatever the caller validated: nothing unchecked reaches step().
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        if len(self.eos_token_ids) > 1 and not params.ignore_eos:
            # further EOS ids (Llama 3's <|eot_id|>, say) stop generation like stop tokens
            extra = tuple(t for t in self.eos_token_ids[1:] if t not in params.stop_token_ids)
            params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
        vocab = len(self.tokenizer)
        for what, ids in (("prompt", prompt_token_ids),
                          ("continuation", continuation.output_token_ids if continuation else ())):
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise ValueError(f"{what} token ids must be integers in [0, {vocab})")
        params.check_token_ids(vocab)
        compile_ = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("structured_outputs is not available on this engine (it was "
                                 "built without a tokenizer)")
            # Built and compiled on the cache's thread (the edge already checked it); until
            # then the request is held, and every other request keeps its steps.
            compile_ = self.grammars.prepare(params.structured_outputs)
            if compile_.future.done() and compile_.future.exception() is not None:
                raise ValueError(str(compile_.future.exception()))  # a spec known to fail
        held = compile_ is not None and not compile_.future.done()
        prompt = list(prompt_token_ids)
        self.core.add_request(request_id, prompt, params, eos, cache_salt, continuation, held,
                              block_hashes)
        if held:
            self._compiling[request_id] = (compile_, params.structured_outputs)
        detok = IncrementalDetokenizer(self.tokenizer, prompt, params)
        if continuation is not None:
            try:  # here, not on the stage: the caller learns at once that it does not fit
                detok.resume(continuation.output_token_ids, continuation.text_chars)
            except ValueError:
                self.core.abort(request_id)  # nothing tracks it yet: its deltas go nowhere
                raise
        index = continuation.sample_index if continuation else 0
        (self.outputs if self.stage is None else self.stage).add(request_id, prompt, params, index,
                                                                 detok)

    def step(self) -> list[SequenceOutput]:
        if self.stage is not None:  # sequences it ended (stop strings) leave core first
            while self.stage.aborts:
                seq_id, reason = self.stage.aborts.popleft()
                self.stage.submit(self.core.abort(seq_id, reason, with_samples=False))
        failed = self._release_compiled() if self._compiling else []
        return self._emit(failed + self.core.step())

    def abort(self, request_id: str) -> list[SequenceOutput]:
        """Finish a request and all its samples now, in any state, freeing their blocks."""
        self._compiling.pop(request_id, None)
        return self._emit(self.core.abort(request_id))

    def _release_compiled(self) -> list[RequestDelta]:
        """Held requests whose compile has ended join the scheduler, or fail with its error;
        one whose compile runs past the limit fails. With nothing else to run, wait a moment
        for a compile rather than spin (a new command waits at most that long)."""
        if self.core.only_held():
            wait([c.future for c, _ in self._compiling.values()], timeout=0.05,
                 return_when=FIRST_COMPLETED)
        failed, now = [], time.monotonic()
        limit = self.grammars.max_compile_s
        for request_id, (compile_, spec) in list(self._compiling.items()):
            why = None
            if compile_.overdue(now, limit):
                why = (f"the structured_outputs {spec.kind} took more than {limit:g} s to "
                       f"compile: simplify it, or raise the setting "
                       f"max_structured_output_compile_s ({flag('max_structured_output_compile_s')})")
                self.grammars.give_up(spec, why)
            elif not compile_.future.done():
                continue
            elif compile_.future.exception() is not None:
                why = str(compile_.future.exception())
            del self._compiling[request_id]
            if why is None:
                self.core.release(request_id)
            else:
                failed += self.core.abort(request_id, ERROR, stop_reason=why)
        return failed

    def _emit(self, deltas: list[RequestDelta]) -> list[SequenceOutput]:
        if self.stage is not None:
            self.stage.submit(deltas)
            return []
        outs, aborts = self.outputs.process(deltas)
        for seq_id, reason in aborts:  # in line: core hears of a stop string before the next step
            dropped, more = self.outputs.process(self.core.abort(seq_id, reason, with_samples=False))
            assert not dropped and not more, "a sequence ended by the processor has no more outputs"
        return outs

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def cache_summary(self):
        return self.core.cache_summary()

    def stats(self) -> EngineStats:
        return self.core.stats()
