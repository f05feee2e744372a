"""OpenAI request bodies (pydantic, at the HTTP edge) and their translation to SamplingParams.

Unknown fields are ignored (pydantic's default), as vLLM does; fields we do not implement are
refused when set to something other than their neutral value, so a client never silently gets
different behaviour.
Types are strict, as OpenAI's schema is: "0.5" is not a number and 1 is not a boolean (an integer
is a number). Bounds live in SamplingParams, so the offline API refuses the same values.
"""
from __future__ import annotations

import json
from typing import ClassVar, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      model_validator)

from raypaged.chat import check_turn
from raypaged.core.sampling_params import SamplingParams
from raypaged.core.structured_outputs import StructuredOutputsParams
from raypaged.serve.errors import bad_request


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field (StructuredOutputsParams' names)."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False


class _Request(BaseModel):
    """Every request body: the model it names, and check(), run on it once validated."""
    model: StrictStr | None = None

    def check(self) -> None:
        """Types only, unless a request says more (a tokenize's prompt is bounded as a
        completion's is, by the frontend; detokenize's ids' range and count are the frontend's
        and RequestLimits'; the model's name is the frontend's)."""


class _Sampling(_Request):
    n: StrictInt = 1
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = Field(None, min_length=1)
    logit_bias: dict[str, StrictFloat] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's: keep each prompt's last k tokens (-1: max_model_len of them)
    truncate_prompt_tokens: StrictInt | None = None
    # vLLM's: the prompt's and each choice's token ids beside the text (RL trainers read them)
    return_token_ids: StrictBool | None = None

    # Fields OpenAI's schema (and vLLM's) makes nullable but that have a non-null default here:
    # null means the default, as it does there.
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"n"})

    # vLLM request fields not implemented here, each with the value that asks for nothing (null
    # too): any other value is a 400 naming it, so nobody silently gets other output than asked
    # for. Fields nobody here knows are ignored, as vLLM ignores them.
    UNIMPLEMENTED: ClassVar[dict] = {
        "use_beam_search": False, "length_penalty": 1.0, "prompt_logprobs": None,
        "allowed_token_ids": None, "bad_words": [], "priority": 0, "logprob_token_ids": None,
        "return_tokens_as_token_ids": False,
        "spaces_between_special_tokens": True, "watermarking": False,
        "thinking_token_budget": None, "echo": False}

    @model_validator(mode="before")
    @classmethod
    def _unimplemented_and_nulls(cls, data):
        if not isinstance(data, dict):
            return data
        for name, neutral in cls.UNIMPLEMENTED.items():
            if data.get(name) not in (None, neutral):
                raise bad_request(f"{name} is not supported by this server: leave it out "
                                  f"(or set it to {json.dumps(neutral)})", name)
        if any(data.get(k, 0) is None for k in cls.NULL_IS_DEFAULT):
            return {k: v for k, v in data.items() if not (v is None and k in cls.NULL_IS_DEFAULT)}
        return data

    def check(self) -> None:
        """What RequestLimits, run on the body before, leaves (it bounds n and logprobs)."""
        if (k := self.truncate_prompt_tokens) is not None and k < 1 and k != -1:
            raise bad_request(f"truncate_prompt_tokens must be -1 (keep max_model_len tokens) "
                              f"or at least 1, got {k}", "truncate_prompt_tokens")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true",
                              "stream_options")

    def constraint_field(self) -> str:
        """The field constraint() comes from, as the client named it (for its 400s)."""
        if self.structured_outputs is None and self.response_format is not None:
            return "response_format.json_schema.schema"
        return "structured_outputs"

    def constraint(self) -> StructuredOutputsParams | None:
        """The one constraint asked for, from structured_outputs or response_format."""
        so, rf = self.structured_outputs, self.response_format
        if so is not None and rf is not None and rf.type != "text":
            raise bad_request("give either structured_outputs or response_format, not both",
                              "structured_outputs")
        try:
            if so is not None:  # a schema given as text: parsed by limits.check_constraint
                return StructuredOutputsParams(json=so.json_, **so.model_dump(exclude={"json_"}))
        except ValueError as exc:
            raise bad_request(str(exc), "structured_outputs") from None
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format of type 'json_schema' needs json_schema.schema",
                              "response_format.json_schema")
        return StructuredOutputsParams(json=rf.json_schema.schema_)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """The fields the client gave (null counts as not given; the frontend may set
        skip_special_tokens), under SamplingParams' own names: its defaults fill the rest, so
        the defaults above never reach it."""
        given = self.model_dump(include=_SAMPLING_FIELDS, exclude_unset=True, exclude_none=True)
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=constraint, **given)


# Request fields that are SamplingParams fields of the same name and meaning.
_SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop",
                    "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "include_stop_str_in_output", "skip_special_tokens",
                    "logit_bias"}


Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: StrictInt | None = 16
    add_special_tokens: StrictBool = True  # vLLM's: the tokenizer's own (a BOS) around a text
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None

    UNIMPLEMENTED: ClassVar[dict] = {**_Sampling.UNIMPLEMENTED, "suffix": ""}

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (use n)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict] | None = None     # an assistant turn that called tools
    tool_call_id: StrictStr | None = None    # a tool turn: which call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ToolFunction(BaseModel):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: ToolFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None
    # vLLM's: the template writes the special tokens it wants; true adds the tokenizer's as well
    add_special_tokens: StrictBool = False
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[Tool] | None = None
    tool_choice: StrictStr | dict | None = None
    parallel_tool_calls: StrictBool = True  # False: at most one call (enforced for "required")
    add_generation_prompt: StrictBool = True
    # vLLM's: the final message left open for the model to go on with (an assistant prefill)
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the chat template

    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"n", "logprobs", "parallel_tool_calls"})
    UNIMPLEMENTED: ClassVar[dict] = {**_Sampling.UNIMPLEMENTED, "documents": None,
                                     "chat_template": None}

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        for i, m in enumerate(self.messages):
            if m.role in ("user", "system", "developer") and m.content is None:
                raise bad_request(f"messages.{i}.content is required for role {m.role!r}",
                                  f"messages.{i}.content")
        try:
            check_turn(self.add_generation_prompt, self.continue_final_message)
        except ValueError as exc:
            raise bad_request(str(exc), "continue_final_message") from None
        if taken := set(self.chat_template_kwargs or ()) & TEMPLATE_ARGUMENTS:
            raise bad_request(f"chat_template_kwargs may not set {sorted(taken)[0]!r}, which the "
                              "request's own fields decide", "chat_template_kwargs")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")

    def tool_dicts(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text(),
                 **{k: v for k in ("name", "tool_calls", "tool_call_id") if (v := getattr(m, k))}}
                for m in self.messages]


# apply_chat_template's own arguments: set from the request's fields, never by the template's
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize",
                                "padding", "truncation", "max_length", "return_tensors",
                                "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class TokenizeRequest(_Request):
    """vLLM's POST /tokenize of a prompt (a body with `messages` is a TokenizeChatRequest)."""
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's POST /tokenize of a conversation: the prompt its chat completion would have."""
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Request):
    """vLLM's POST /detokenize: the text of token ids."""
    tokens: list[StrictInt]
