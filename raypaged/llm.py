"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence, Union

from tqdm import tqdm

from raypaged.core.sampling_params import SamplingParams
from raypaged.chat import encode_chat, render_chat
from raypaged.config import EngineArgs
from raypaged.engine import Engine
from raypaged.outputs import CompletionOutput, RequestOutput

Prompt = Union[str, dict]  # "text" or {"prompt_token_ids": [...]}
Messages = list[dict]

_ENGINE_FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        unknown = sorted(set(kwargs) - set(_ENGINE_FIELDS))
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {unknown}; valid: {_ENGINE_FIELDS}")
        self.engine: Engine = Engine.from_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts: "
                             "give one SamplingParams, or one per prompt")
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        return self._run(encoded, list(params), use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them (vLLM's
        LLM.chat arguments: `continue_final_message` leaves the final message open, an
        assistant prefill for the model to go on with)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        texts = [render_chat(tok, c, add_generation_prompt, tools, continue_final_message,
                             chat_template_kwargs) for c in convs]
        prompts = [{"prompt": t, "prompt_token_ids": encode_chat(tok, t)} for t in texts]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _encode(self, prompt: Prompt, i: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        raise ValueError(f"prompt {i} must be a string or a dict with 'prompt_token_ids', "
                         f"got {type(prompt).__name__}")

    def _run(self, encoded, params, use_tqdm) -> list[RequestOutput]:
        engine = self.engine
        results: dict[str, RequestOutput] = {}  # in input order
        bar = None
        try:
            for i, ((text, ids), sp) in enumerate(zip(encoded, params)):
                rid = str(next(self._ids))
                try:
                    if sp.structured_outputs is not None and engine.grammars is not None:
                        engine.grammars.check(sp.structured_outputs)  # as the router does
                    engine.add_request(rid, ids, sp)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
                results[rid] = RequestOutput(rid, text, ids, [CompletionOutput(k) for k in range(sp.n)])
            bar = tqdm(total=len(results), desc="generate", unit="req",
                       disable=not use_tqdm or len(results) < 2)
            while engine.has_unfinished():
                for out in engine.step():
                    res = results[out.request_id]
                    res.num_cached_tokens = max(res.num_cached_tokens, out.num_cached_tokens)
                    res.outputs[out.index].add(out)
                    if out.finished and res.finished:
                        bar.update(1)
        except BaseException:
            for rid in results:  # leave the engine clean for the next call
                engine.abort(rid)
            raise
        finally:
            if bar is not None:  # None: a request was refused before any ran
                bar.close()
        return list(results.values())

