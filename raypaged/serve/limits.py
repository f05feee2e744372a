"""What one request may ask, checked on the parsed JSON before pydantic, tokenizing or queueing.

Every bound is a `ServeOptions` setting (serve/config.py, docs/limits.md). The checks read only
lengths of the raw body, so refusing a request that lists millions of prompts, stop strings or
token ids costs microseconds rather than validating, tokenizing and submitting all of them; the
400 names the field, the limit, and the setting (and flag) that raises it. Fields of the wrong
type are left to pydantic, which names them just as clearly. A structured-output constraint is
checked once the request model has made it (check_constraint), still before queueing.
"""
from __future__ import annotations

import asyncio

from raypaged.core.sampling_params import is_int
from raypaged.core.structured_outputs import StructuredOutputsParams
from raypaged.model.grammar import build_grammar
from raypaged.serve.config import ServeOptions
from raypaged.serve.errors import bad_request, too_long
from raypaged.settings import flag


class RequestLimits(ServeOptions):
    """The checks, bounded by the settings of the same names (max_n, max_stop_strings, ...);
    frozen and picklable, as ServeOptions is: body_parser runs a check in a child process."""

    @classmethod
    def of(cls, options: ServeOptions) -> RequestLimits:
        return cls(**{**vars(options), "api_key": None})  # not to travel with each body

    # -- the checks ---------------------------------------------------------------------------
    def check_completion(self, body: dict, max_model_len: int) -> None:
        self._check_common(body)
        prompt = body.get("prompt")
        several = isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str))
        prompts = prompt if several else [prompt]
        self._at_most(len(prompts), "prompt", "prompts in one request", "max_prompts_per_request")
        truncated = body.get("truncate_prompt_tokens") is not None  # then it may be longer
        for i, p in enumerate(prompts):  # a token list too long to fit: before validating it
            if isinstance(p, list) and len(p) >= max_model_len and not truncated:
                where = f"prompt.{i}" if several else "prompt"
                raise too_long(max_model_len, f"{where} is {len(p)} tokens")
        self._check_logprobs(body.get("logprobs"), "logprobs")
        self.check_output_tokens(body, len(prompts), body.get("max_tokens", 16))

    @staticmethod
    def check_detokenize(body: dict, max_model_len: int) -> None:
        """Before pydantic validates each id: at most a sequence's worth of them."""
        tokens = body.get("tokens")
        if isinstance(tokens, list) and len(tokens) > max_model_len:
            raise bad_request(f"tokens has {len(tokens)} ids, more than a sequence can hold "
                              f"(max_model_len {max_model_len}): detokenize at most "
                              f"{max_model_len} at once", "tokens")

    def check_chat(self, body: dict) -> None:
        self._check_common(body)
        messages = body.get("messages")
        if isinstance(messages, list):
            self._at_most(len(messages), "messages", "messages in one request", "max_messages")
            # validating each part is pydantic's work on the event loop (docs/limits.md)
            parts = sum(len(m["content"]) for m in messages
                        if isinstance(m, dict) and isinstance(m.get("content"), list))
            self._at_most(parts, "messages", "content parts in one request", "max_content_parts")
        self._check_logprobs(body.get("top_logprobs"), "top_logprobs")
        given = body.get("max_completion_tokens")
        self.check_output_tokens(body, 1, body.get("max_tokens") if given is None else given)

    def check_output_tokens(self, body: dict, prompts: int, max_tokens) -> None:
        """prompts x n x max_tokens, when max_tokens is given (the frontend checks again with
        what is left of the context once prompts are tokens, for max_tokens unset)."""
        n = body.get("n", 1)
        if not (is_int(n) and is_int(max_tokens) and n >= 1 and max_tokens >= 1):
            return  # pydantic or SamplingParams refuse the types and signs
        self.check_total(prompts * n * max_tokens, prompts, n, f"max_tokens {max_tokens}")

    def check_total(self, total: int, prompts: int, n: int, per_sample: str) -> None:
        if total > self.max_request_output_tokens:
            raise bad_request(
                f"this request may generate {total} tokens ({prompts} prompt(s) x n {n} x "
                f"{per_sample}), more than the {self.max_request_output_tokens} one request may "
                f"ask of this server: lower max_tokens or n, or split the request "
                f"{_limit('max_request_output_tokens')}", "max_tokens")

    async def check_constraint(self, spec: StructuredOutputsParams | None,
                               field: str = "structured_outputs"
                               ) -> StructuredOutputsParams | None:
        """A constraint's size, then its grammar built in a thread (model/grammar.py, no
        tokenizer needed): a bad schema, regex or EBNF is a 400 before anything is queued.
        `field`: the request field the constraint came from, which the 400 names (the grammar's
        errors name SamplingParams' `structured_outputs.<kind>`)."""
        if spec is None:
            return None
        given = {"structured_outputs": f"structured_outputs {spec.kind}",
                 "tools": "tools' parameter schema"}.get(field, field)
        if spec.size > self.max_structured_output_chars:
            raise bad_request(f"the {given} is {spec.size} characters, more than the "
                              f"{self.max_structured_output_chars} this server accepts "
                              f"{_limit('max_structured_output_chars')}", field)
        try:
            await asyncio.to_thread(build_grammar, spec)
        except ValueError as exc:
            message = str(exc)
            if field != "structured_outputs":
                message = message.replace(f"structured_outputs.{spec.kind}", field)
            raise bad_request(message, field) from None
        return spec

    def _check_common(self, body: dict) -> None:
        n = body.get("n")
        if is_int(n) and not 1 <= n <= self.max_n:
            raise bad_request(f"n must be between 1 and {self.max_n}, got {n} {_limit('max_n')}",
                              "n")
        stop = body.get("stop")
        if isinstance(stop, list):
            self._at_most(len(stop), "stop", "stop strings", "max_stop_strings")
        for s in ([stop] if isinstance(stop, str) else stop if isinstance(stop, list) else ()):
            if isinstance(s, str) and len(s) > self.max_stop_string_chars:
                raise bad_request(
                    f"a stop string of {len(s)} characters is longer than the "
                    f"{self.max_stop_string_chars} this server accepts "
                    f"{_limit('max_stop_string_chars')}", "stop")
        for param, kind, what in (("stop_token_ids", list, "stop_token_ids"),
                                  ("logit_bias", dict, "logit_bias entries")):
            if isinstance(entries := body.get(param), kind):
                self._at_most(len(entries), param, what, f"max_{param}")

    def _check_logprobs(self, value, param: str) -> None:
        if is_int(value) and not 0 <= value <= self.max_logprobs:
            raise bad_request(f"{param} must be between 0 and {self.max_logprobs}, got {value} "
                              f"{_limit('max_logprobs')}", param)

    def _at_most(self, count: int, param: str, what: str, setting: str) -> None:
        """At most the setting's number of entries in `param`."""
        if count > (limit := getattr(self, setting)):
            raise bad_request(f"{param} has {count} entries: at most {limit} {what} are "
                              f"accepted {_limit(setting)}", param)


def _limit(setting: str) -> str:
    """What a 400 says of the setting that bounds it."""
    return f"(the limit is the setting {setting}, {flag(setting)})"
