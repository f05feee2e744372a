"""The OpenAI endpoints: validate, tokenize, start one Generation per prompt, shape the answer.

    body ─> pydantic model ─> model name ─> token ids (chat template for chat) ─> lengths
         ─> SamplingParams ─> Generation.start() per prompt (routing, first batch)
         ─> JSON (collect) or SSE (chunks as batches arrive, then usage, then [DONE])

Every problem found before the first batch is an APIError with its status; after it (a
failover that gave up, `request_timeout_s` passed since the body arrived) a stream ends with an
error event and [DONE]. A timeout before the response is a 504; either way its Generations
close, cancelling it on its workers (as a client leaving does).
"""
from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from pydantic import ValidationError
from starlette.responses import JSONResponse, StreamingResponse

from raypaged.chat import encode_chat, render_chat, tool_call_format
from raypaged.core.sampling_params import SamplingParams
from raypaged.serve.dispatch import Dispatcher
from raypaged.serve.errors import (APIError, bad_request, from_validation_error, from_value_error,
                                   too_long)
from raypaged.serve.generation import Generation, gather_or_cancel
from raypaged.serve.limits import RequestLimits
from raypaged.serve.prompt_bound import max_token_bytes
from raypaged.serve.sse_stream import sse_events
from raypaged.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeChatRequest, TokenizeRequest)
from raypaged.serve.tool_calls import MAX_TOOL_CALLS, ToolCallChoices, with_tools
from raypaged.serve.ttft_shed import TTFTShedder
from raypaged.serve.responses import Choice, Shapes, sse_response, usage, workers_header


@dataclass(frozen=True)
class Route:
    """What differs between /v1/completions and /v1/chat/completions once prompts are tokens."""

    id_prefix: str                 # of response ids: "cmpl-..." / "chatcmpl-..."
    object: str                    # the whole response's "object"
    chunk_object: str              # each stream chunk's "object"
    first_delta: dict | None       # sent per choice before any token (chat: the role)
    # return_token_ids: the prompt's ids in each choice (completions: each prompt is its own),
    # or beside the choices (chat: one conversation), as vLLM places them
    prompt_ids_per_choice: bool


COMPLETIONS = Route("cmpl", "text_completion", "text_completion", None, True)
CHAT = Route("chatcmpl", "chat.completion", "chat.completion.chunk",
             {"role": "assistant", "content": ""}, False)


@dataclass(frozen=True)
class ModelInfo:
    name: str            # the served model name clients use
    max_model_len: int
    vocab_size: int
    created: int

    @classmethod
    def of(cls, stats, tokenizer, name: str | None = None) -> ModelInfo:
        """What clients see of the model a worker loaded (its stats and tokenizer)."""
        return cls(name=name or stats.model_name, max_model_len=stats.max_model_len,
                   vocab_size=len(tokenizer), created=int(time.time()))


class OpenAIFrontend:
    # TTFT-SLO load shedding (ttft_shed.py), set by the application when --ttft-slo-s is given
    shedder: TTFTShedder | None = None

    def __init__(self, dispatcher: Dispatcher, tokenizer, info: ModelInfo, *,
                 limits: RequestLimits | None = None, request_timeout_s: float | None = None,
                 tool_call_parser: str | None = None, max_tool_calls: int = MAX_TOOL_CALLS):
        self.dispatcher = dispatcher
        self.tokenizer = tokenizer
        self.shapes = Shapes(tokenizer)
        self.info = info
        self.limits = limits or RequestLimits()
        # each request model's limits, checked on the raw body before pydantic (picklable:
        # http_app has body_parser run a large body's in a child process)
        self.body_checks = {CompletionRequest: functools.partial(
            self.limits.check_completion, max_model_len=info.max_model_len),
            ChatCompletionRequest: self.limits.check_chat,
            TokenizeChatRequest: self.limits.check_chat, TokenizeRequest: lambda body: None,
            DetokenizeRequest: functools.partial(self.limits.check_detokenize,
                                                 max_model_len=info.max_model_len)}
        self.request_timeout_s = request_timeout_s  # None: no deadline
        self.max_token_bytes = max_token_bytes(tokenizer)  # None: no bound, tokenize everything
        # tool_choice "auto": the model family's call format, from its chat template unless set
        self.tool_parser = tool_call_parser or tool_call_format(tokenizer)
        self.max_tool_calls = max_tool_calls

    # -- endpoints -------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [self.model()]}

    def model(self, model_id: str | None = None) -> dict:
        """The served model's card; `model_id`: as GET /v1/models/{model} asks (the OpenAI
        SDK's models.retrieve), a 404 unless it is this server's."""
        if model_id is not None and model_id != self.info.name:
            raise self._no_model(model_id)
        return {"id": self.info.name, "object": "model", "created": self.info.created,
                "owned_by": "raypaged", "root": self.info.name, "parent": None,
                "max_model_len": self.info.max_model_len}

    async def tokenize(self, body) -> JSONResponse:
        """vLLM's POST /tokenize: the token ids a completion of `prompt`, or a chat completion
        of `messages` (with its `tools`, `add_generation_prompt`), would be given."""
        if isinstance(body, dict) and "messages" in body:
            req = self._parse(TokenizeChatRequest, body)
            tokens = await self._chat_tokens(req)
        else:
            req = self._parse(TokenizeRequest, body)
            self._refuse_unfittable(req.prompt, "prompt")
            tokens = await asyncio.to_thread(self.tokenizer.encode, req.prompt,
                                             add_special_tokens=req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return JSONResponse({"count": len(tokens), "max_model_len": self.info.max_model_len,
                             "tokens": tokens, "token_strs": strs})

    async def detokenize(self, body) -> JSONResponse:
        """vLLM's POST /detokenize: the text of `tokens`."""
        req = self._parse(DetokenizeRequest, body)
        self._check_ids(req.tokens, "tokens")
        return JSONResponse({"prompt": await asyncio.to_thread(self.tokenizer.decode,
                                                               req.tokens)})

    def _no_model(self, name: str) -> APIError:
        return APIError(404, f"The model `{name}` does not exist; this server serves "
                             f"`{self.info.name}`", param="model", code="model_not_found")

    async def completions(self, body) -> JSONResponse | StreamingResponse:
        return await self._by_deadline(self._completions, body)

    async def chat_completions(self, body) -> JSONResponse | StreamingResponse:
        return await self._by_deadline(self._chat_completions, body)

    async def _by_deadline(self, endpoint, body) -> JSONResponse | StreamingResponse:
        """Run an endpoint up to its response (for a stream: its first batch) within the
        request's deadline; the stream itself keeps the same deadline (sse_events)."""
        arrival = time.monotonic()
        loop_now = asyncio.get_running_loop().time()
        deadline = None if self.request_timeout_s is None else loop_now + self.request_timeout_s
        timeout = asyncio.timeout_at(deadline)
        try:
            async with timeout:
                return await endpoint(body, arrival, deadline)
        except TimeoutError:
            if timeout.expired():
                raise self._timed_out() from None
            raise

    def _timed_out(self) -> APIError:
        return APIError(504, f"the request did not finish within {self.request_timeout_s:g} s "
                             "and was cancelled: ask for fewer tokens, or raise the server's "
                             "setting request_timeout_s (--request-timeout-s)",
                        code="request_timeout")

    async def _completions(self, body, arrival: float, deadline: float | None
                           ) -> JSONResponse | StreamingResponse:
        req: CompletionRequest = self._parse(CompletionRequest, body)
        texts = req.prompts()
        for text in texts:  # all of them before tokenizing any
            self._refuse_unfittable(text, "prompt", req.truncate_prompt_tokens)
        prompts = [await self._prompt_tokens(p, req.add_special_tokens) for p in texts]
        chunk = functools.partial(self.shapes.completion_choice, req.logprobs is not None,
                                  token_ids=bool(req.return_token_ids))
        return await self._respond(COMPLETIONS, req, prompts, req.max_tokens, req.logprobs,
                                   chunk, arrival, deadline)

    async def _chat_completions(self, body, arrival: float, deadline: float | None
                                ) -> JSONResponse | StreamingResponse:
        req: ChatCompletionRequest = self._parse(ChatCompletionRequest, body)
        chunk = functools.partial(self.shapes.chat_choice, req.logprobs,
                                  token_ids=bool(req.return_token_ids))
        chunk, forced = with_tools(req, chunk, self.tool_parser, self.max_tool_calls)
        return await self._respond(CHAT, req, [await self._chat_tokens(req)],
                                   req.requested_max_tokens(), req.requested_logprobs(), chunk,
                                   arrival, deadline, forced)

    # -- the one request path ----------------------------------------------------------------
    async def _respond(self, route: Route, req, prompts: list[list[int]], max_tokens: int | None,
                       logprobs: int | None, chunk: Callable, arrival: float,
                       deadline: float | None = None, constraint=None
                       ) -> JSONResponse | StreamingResponse:
        if (k := req.truncate_prompt_tokens) is not None:  # each prompt's last k tokens (vLLM's)
            if k > self.info.max_model_len:
                raise bad_request(f"truncate_prompt_tokens {k} is more than max_model_len "
                                  f"({self.info.max_model_len}): keep at most that many (-1)",
                                  "truncate_prompt_tokens")
            prompts = [tokens[-(self.info.max_model_len if k == -1 else k):] for tokens in prompts]
        for tokens in prompts:
            self._check_length(tokens, max_tokens)
        if not isinstance(max_tokens, int):  # unset: up to what is left of each context
            left = sum(self.info.max_model_len - len(tokens) for tokens in prompts)
            self.limits.check_total(left * req.n, len(prompts), req.n,
                                    "what is left of max_model_len, as max_tokens is unset")
        field = "tools" if constraint else req.constraint_field()  # what a 400 names
        constraint = await self.limits.check_constraint(constraint or req.constraint(), field)
        try:
            params = req.sampling_params(max_tokens, logprobs, constraint)
            params.check_token_ids(self.info.vocab_size)  # the engine checks again
        except ValueError as exc:
            raise from_value_error(exc) from None
        if self.shedder is not None:  # last check before any work reaches a worker
            self.shedder.check(sum(len(tokens) for tokens in prompts))
        # one id for the response; each prompt's generation is "<id>-<i>" (as vLLM names them)
        response_id = f"{route.id_prefix}-{uuid.uuid4().hex}"
        gens = await self._start(response_id, prompts, params, req.cache_salt, arrival)
        prompt_ids = prompts if req.return_token_ids else None  # as served (truncated)
        if req.stream:  # the header goes out first: it names the workers streaming now
            opts = req.stream_options
            head = {"id": response_id, "object": route.chunk_object,
                    "created": int(time.time()), "model": self.info.name}
            # plain text chunks are spliced into a frame: Shapes' choices without logprobs,
            # token ids, nor tool-call parsing around them
            plain = (logprobs is None and not req.return_token_ids
                     and not isinstance(chunk, ToolCallChoices))
            events = sse_events(gens, params.n, chunk, head, route.first_delta, plain,
                                bool(opts and opts.include_usage),
                                bool(opts and opts.continuous_usage_stats), deadline,
                                self._timed_out, prompt_ids)
            return sse_response(events, workers_header(gens))
        choices = [chunk(i, c, whole=True)
                   for i, c in enumerate(await self._collect(gens, params.n))]
        body = {"id": response_id, "object": route.object, "created": int(time.time()),
                "model": self.info.name, "choices": choices, "usage": usage(gens)}
        if prompt_ids and route.prompt_ids_per_choice:
            for i, choice in enumerate(choices):
                choice["prompt_token_ids"] = prompt_ids[i // params.n]
        elif prompt_ids:
            body["prompt_token_ids"] = prompt_ids[0]
        return JSONResponse(body, headers=workers_header(gens))  # after a failover: who finished

    # -- validation and tokenization --------------------------------------------------------
    def _parse(self, model, body):
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        self.body_checks[model](body)
        try:
            req = model.model_validate(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from None
        req.check()
        if req.model is not None and req.model != self.info.name:
            raise self._no_model(req.model)
        return req

    # Tokenizing runs in a thread: a multi-MB prompt takes seconds, and the event loop must keep
    # answering /health and other requests meanwhile (HF's fast tokenizers release the GIL).
    async def _prompt_tokens(self, prompt: str | list[int], add_special_tokens: bool
                             ) -> list[int]:
        if isinstance(prompt, str):
            tokens = await asyncio.to_thread(self.tokenizer.encode, prompt,
                                             add_special_tokens=add_special_tokens)
        else:
            tokens = prompt
            self._check_ids(tokens, "prompt")
        if not tokens:
            raise bad_request("the prompt is empty: give at least one token", "prompt")
        return list(tokens)

    def _check_ids(self, tokens: list[int], param: str) -> None:
        if bad := [t for t in tokens if not 0 <= t < self.info.vocab_size]:
            raise bad_request(f"{param} token id {bad[0]} is out of range: token ids must be "
                              f"in [0, {self.info.vocab_size})", param)

    async def _chat_tokens(self, req: ChatCompletionRequest) -> list[int]:
        try:
            text = await asyncio.to_thread(render_chat, self.tokenizer, req.conversation(),
                                           req.add_generation_prompt, req.tool_dicts(),
                                           req.continue_final_message, req.chat_template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template that rejects this conversation
            raise bad_request(f"the chat template rejected these messages: {exc}",
                              "messages") from None
        # the rendered text, not the contents: a template may trim or drop parts of them
        self._refuse_unfittable(text, "messages", req.truncate_prompt_tokens)
        tokens = await asyncio.to_thread(encode_chat, self.tokenizer, text,
                                         req.add_special_tokens)
        if not tokens:
            raise bad_request("the conversation renders to an empty prompt", "messages")
        return tokens

    def _refuse_unfittable(self, text: str | list[int], param: str,
                           truncate: int | None = None) -> None:
        """A text of more bytes than max_model_len tokens can cover is refused before it is
        tokenized (why: prompt_bound); token ids pass, and so does a text to be truncated (its
        size is the body's, bounded by max_request_bytes)."""
        if self.max_token_bytes is None or not isinstance(text, str) or truncate is not None:
            return
        size = len(text) if text.isascii() else len(text.encode(errors="surrogatepass"))
        fewest = -(-size // self.max_token_bytes)  # isascii() above is O(1), encode() is not
        limit = self.info.max_model_len
        if fewest >= limit:
            raise too_long(limit, f"the prompt is {size} bytes, so at least {fewest} tokens (no "
                                  f"token covers more than {self.max_token_bytes} bytes)", param)

    def _check_length(self, tokens: list[int], max_tokens: int | None) -> None:
        limit = self.info.max_model_len
        if len(tokens) >= limit:
            raise too_long(limit, f"the prompt is {len(tokens)} tokens")
        if isinstance(max_tokens, int) and max_tokens >= 1 and len(tokens) + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but you requested "
                f"{len(tokens) + max_tokens} ({len(tokens)} in the prompt, {max_tokens} "
                f"max_tokens): lower max_tokens to at most {limit - len(tokens)}", "max_tokens")

    # -- running -----------------------------------------------------------------------------
    async def _start(self, base: str, prompts: list[list[int]], params: SamplingParams,
                     cache_salt: str | None, arrival: float) -> list[Generation]:
        gens = [Generation(self.dispatcher, base if len(prompts) == 1 else f"{base}-{i}",
                           tokens, params, cache_salt, arrival) for i, tokens in enumerate(prompts)]
        try:
            results = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
            if errors := [r for r in results if isinstance(r, BaseException)]:
                raise errors[0]
        except BaseException:  # one failed, or cancelled (the deadline, a client gone):
            await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)  # leave all
            raise
        return gens

    async def _collect(self, gens: list[Generation], n: int) -> list[Choice]:
        try:  # a lost worker is failed over inside Generation; what comes out is an APIError
            outputs = await gather_or_cancel(*(g.collect() for g in gens))
        finally:
            await asyncio.gather(*(g.close() for g in gens), return_exceptions=True)
        choices = [Choice() for _ in range(len(gens) * n)]
        for g, outs in enumerate(outputs):
            for out in outs:
                choices[g * n + out.index].add(out)
        return choices

