"""OpenAI request bodies (completions, chat completions) and the response objects built from a result.

Knows the OpenAI field names and defaults, the fields it does not honour (NOT_HONOURED: refused by name,
never dropped), and turns a body into what the queue stores (prompt or messages, sampling, how many choices)
after checking it against the named config's limits: one Rejection per bad body, naming the field and the fix.
Renders answers in OpenAI's shapes, log-probabilities included (chat's `content` list, completions' legacy
arrays) and tool calls (`tool_calls`, finish reason `tool_calls`). Structured output: response_format
(json_object, json_schema) and tools (tool_choice none, auto, required or a named function) become one
constraint on the answer (servelab/engine/grammar.py: a JSON schema, compiled to a grammar the sampler keeps
to), its schema checked here so a bad one is a 400 naming the field; tools are described to the model in a
system message. Shared by the API and batch-file ingest, so both accept the same bodies. One module past 400
lines on purpose: a body's fields and the answer's shape are one contract (what logprobs or tools ask, the
answer returns). Does not know HTTP status codes or tokenizers (the worker counts tokens exactly).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationInfo, field_validator,
                      model_validator)

from servelab.config import ServingConfig
from servelab.outputs import Alternative, TokenLogprobs
from servelab.request import (MAX_COMPLETION_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID,
                              FinishReason, bounded,
                              RequestError, SamplingParams, check_num_choices)
from servelab.catalog import Catalog, UnknownModel, sampling_defaults
from servelab.engine.grammar import check_constraint, constraint_json, is_tool_call

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Rejection(ValueError):
    """A body that cannot be queued. kind: 'invalid' (400), 'unknown_model' (404), 'too_large' (413)."""

    def __init__(self, message: str, *, kind: str = "invalid", code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.kind, self.code, self.param = kind, code, param


@dataclass(frozen=True)
class NotHonoured:
    """An OpenAI body field servelab does not act on: accepted only at a value that asks for nothing."""

    neutral: tuple[Any, ...]
    why: str

    def is_neutral(self, value: Any) -> bool:
        """Equal to a neutral value and of its JSON type (false is not 0, 1 is 1.0)."""
        return any(value == n and _json_type(value) == _json_type(n) for n in self.neutral)


def _json_type(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    return "number" if isinstance(value, int | float) else type(value).__name__


# NOTE: the one list of OpenAI body fields that would change the answer and that servelab does not honour: a
# body setting one to anything but a neutral value is refused (400, naming the field) on every edge (the API and
# batch lines), never dropped. Honouring a field = declaring it on the body model and deleting its line here
# (tests/api/test_openai_surface.py checks that no line names a declared field).
NOT_HONOURED: dict[str, NotHonoured] = {
    "logit_bias": NotHonoured((None, {}), "sampling takes no logit bias"),
    "best_of": NotHonoured((None, 1), "completions are not ranked: ask for n choices instead"),
    "echo": NotHonoured((None, False), "the prompt is not echoed back"),
    "suffix": NotHonoured((None, ""), "insertion (a suffix after the completion) is not supported"),
    "functions": NotHonoured((None, []), "the deprecated functions field is not built: send tools instead"),
    "function_call": NotHonoured((None, "none"), "the deprecated function_call field is not built: send tool_choice"),
    "modalities": NotHonoured((None, ["text"]), "the served models produce text only"),
    "audio": NotHonoured((None,), "the served models produce text only"),
    "prediction": NotHonoured((None,), "predicted outputs are not supported"),
    "reasoning_effort": NotHonoured((None, "none"), "the served models do not reason"),
    "verbosity": NotHonoured((None,), "the served models take no verbosity setting"),
    "web_search_options": NotHonoured((None,), "web search is not built"),
    "moderation": NotHonoured((None,), "moderation is not built"),
    "service_tier": NotHonoured((None, "auto", "default"), "servelab has one service tier"),
    "store": NotHonoured((None, False), "OpenAI's stored-completions API is not built (every request is kept: "
                                        "read it with GET /v1/requests/{id})"),
    "metadata": NotHonoured((None, {}), "metadata goes with store, which is not built"),
}
# Fields that label a request or hint at caching: accepted, and they change nothing servelab generates.
NO_EFFECT = frozenset({"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                       "prompt_cache_options"})
# A chat message's fields beyond role and content (name, tool_calls, refusal, ...): only empty values pass.
EMPTY = NotHonoured((None, "", [], {}), "a message is read as its role and content only")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = Field(default=None, description="accepted; chunks are never padded")
    # NOTE: as vLLM reads it: with include_usage, every chunk carries the usage so far, not only the last one
    continuous_usage_stats: bool = Field(default=False, description="vLLM's: every chunk carries the usage so far")


NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's and a json_schema's name


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="a JSON Schema; left out: "
                                                                                     "any JSON object")
    strict: bool | None = Field(default=None, description="accepted; the schema is always kept to (a grammar)")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self

    @property
    def answer_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer keeps to; None: free text."""
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema.schema_ is None:
            return {"type": "object"}
        return self.json_schema.schema_


class _Body(BaseModel):
    # NOTE: extra fields are kept (extra="allow") and checked by refuse_unhonoured: each is honoured, refused
    # with a message naming it (NOT_HONOURED, or unknown), or in NO_EFFECT; none is dropped in silence.
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=256, description="a serving config name")
    max_tokens: int | None = bounded("max_new_tokens", None)
    temperature: float = bounded("temperature", 1.0)
    top_p: float = bounded("top_p", 1.0)
    top_k: int = bounded("top_k", 0, description="not OpenAI (vLLM's); 0 is off")
    seed: int | None = bounded("seed", None, description="choice i samples with seed + i")
    stop: str | list[str] | None = None
    presence_penalty: float | None = bounded("presence_penalty", None)
    frequency_penalty: float | None = bounded("frequency_penalty", None)
    n: int | None = bounded("choices", 1, description="choices, decoded in one batch: at most the config's "
                                                      "max_batch_size")
    # vLLM's extra sampling fields (benchmark and evaluation clients send them), as vLLM defines them
    ignore_eos: bool = Field(default=False, description="vLLM's: EOS does not end the answer (max_tokens does)")
    min_tokens: int = bounded("min_tokens", 0, description="vLLM's: nothing ends the answer before this many tokens")
    stop_token_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS, description="vLLM's: token ids that end the answer")
    repetition_penalty: float = bounded("repetition_penalty", 1.0, description=(
        "vLLM's: a token seen in the prompt or the answer has its logit divided by it (positive) or multiplied"))
    min_p: float = bounded("min_p", 0.0, description="vLLM's: keep tokens at least min_p times the likeliest's p")
    include_stop_str_in_output: bool = Field(default=False, description="vLLM's: the stop string ends the text")
    skip_special_tokens: bool = Field(default=True, description="vLLM's: special tokens' text left out")
    stream: bool | None = Field(default=False, description="answer as server-sent events, chunk by chunk")
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = Field(default=None, description=(
        "json_object or json_schema: the answer is JSON (valid against the schema), by a grammar the sampler keeps"))

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Body:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def num_top_logprobs(self) -> int | None:
        """Alternatives per token (0: the chosen token's log-probability alone); None: no log-probabilities."""
        return None

    def sampling(self, max_new_tokens: int, model_defaults: dict[str, float | int] | None = None) -> SamplingParams:
        """model_defaults: the model's own values (its generation_config.json) for the fields this body leaves out."""
        given = {name: getattr(self, name) for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        given |= {name: value for name, value in (model_defaults or {}).items()
                  if name in given and name not in self.model_fields_set}
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=given["temperature"], top_p=given["top_p"],
                              top_k=given["top_k"], seed=self.seed, stop=tuple(self.stop or ()),
                              presence_penalty=self.presence_penalty or 0.0,
                              frequency_penalty=self.frequency_penalty or 0.0, logprobs=self.num_top_logprobs,
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                              stop_token_ids=tuple(self.stop_token_ids or ()),
                              repetition_penalty=given["repetition_penalty"], min_p=given["min_p"],
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens, constraint=self.constraint())

    def constraint(self) -> str | None:
        """The answer's constraint (servelab/engine/grammar.py's form), checked: a Rejection names the field."""
        schema = self.response_format.answer_schema if self.response_format is not None else None
        if schema is None:
            return None
        constraint = constraint_json(schema)
        _check(constraint, "response_format.json_schema.schema" if self.response_format.type == "json_schema"
               else "response_format")
        return constraint


def _check(constraint: str, param: str) -> None:
    if problem := check_constraint(constraint):
        raise Rejection(f"{param} cannot be served: {problem.strip().splitlines()[0]}", param=param)


class CompletionBody(_Body):
    prompt: str | list[str] = Field(description="one prompt (a list of exactly one string is accepted)")
    logprobs: StrictInt | StrictBool | None = Field(default=None, description=(
        f"the legacy form: alternatives per token, 0..{MAX_COMPLETION_LOGPROBS} (0: the chosen token's alone)"))

    @field_validator("logprobs")
    @classmethod
    def _alternatives(cls, value: int | bool | None) -> int | None:
        if value is True or (value is not None and value is not False and not 0 <= value <= MAX_COMPLETION_LOGPROBS):
            raise ValueError(f"on /v1/completions logprobs is the number of alternatives per token, 0 to "
                             f"{MAX_COMPLETION_LOGPROBS} (0: the chosen token's log-probability alone); got {value}")
        return None if value is False else value

    @property
    def num_top_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError(f"give one prompt per request, got {len(value)}; send one request per prompt")
            return value[0]
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str = Field(description="the arguments as a JSON string, as the answer gave them")


class ToolCall(BaseModel):
    """A tool call an earlier answer made, sent back in an assistant message."""

    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class MessageBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # NOTE: checked by refuse_unhonoured, as the body's are
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, description="an assistant message's earlier tool calls")
    tool_call_id: str | None = Field(default=None, description="a tool message: the call it answers")

    @model_validator(mode="after")
    def _content_or_calls(self) -> MessageBody:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (an assistant message may give tool_calls "
                             "instead)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return self

    @property
    def text(self) -> str:
        """What the model reads: the content; an assistant's tool calls as the JSON it answers them with."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        calls = [json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                            ensure_ascii=False) for c in self.tool_calls or []]
        return "\n".join(x for x in (content, *calls) if x)


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw  # NOTE: not JSON (the client's own making): the model reads it as the string it is


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON Schema of the arguments; left out: "
                                                                        "no arguments")
    strict: bool | None = Field(default=None, description="accepted; the arguments always keep to the schema")


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatCompletionBody(_Body):
    messages: list[MessageBody] = Field(min_length=1, max_length=1_000)
    max_completion_tokens: int | None = bounded("max_new_tokens", None)
    logprobs: StrictBool | None = Field(default=None, description="each token's log-probability in the answer")
    top_logprobs: StrictInt | None = bounded("logprobs", None, description="alternatives per token; needs logprobs: "
                                                                           "true")
    tools: list[Tool] | None = Field(default=None, max_length=128, description="functions the answer may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(default=None, description=(
        "none: text; auto (the default with tools): a call or text, the model's pick; required: a call; a named "
        "function: a call of it. One call per answer"))
    parallel_tool_calls: bool | None = Field(default=None, description="accepted; an answer makes at most one call")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):  # NOTE: logprobs is declared first, so it is read already
            raise ValueError(f"top_logprobs is {value}, which needs logprobs: true")
        return value

    @property
    def num_top_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def choice_of_tools(self) -> str | NamedToolChoice:
        return self.tool_choice or ("auto" if self.tools else "none")

    def callable_tools(self) -> list[Tool]:
        """The tools the answer may call (none when tool_choice is none); a Rejection for a bad pairing."""
        choice = self.choice_of_tools
        names = [t.function.name for t in self.tools or []]
        if choice != "none" and not self.tools:
            raise Rejection("tool_choice asks for a tool call and tools is empty: give tools or leave tool_choice out",
                            param="tool_choice")
        if len(set(names)) != len(names):
            raise Rejection(f"tools names a function twice: {sorted({n for n in names if names.count(n) > 1})}",
                            param="tools")
        if choice == "none":
            return []
        if self.response_format is not None and self.response_format.type != "text":
            raise Rejection("response_format and tools are not served together: an answer keeps to one grammar; "
                            'send tool_choice "none" or leave response_format out', param="response_format")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise Rejection(f"tool_choice names {choice.function.name!r}, which tools does not define "
                                f"(it defines {names})", param="tool_choice")
            return [t for t in self.tools if t.function.name == choice.function.name]
        return list(self.tools)

    def constraint(self) -> str | None:
        tools = self.callable_tools()
        if not tools:
            return super().constraint()
        calls = []
        for i, tool in enumerate(self.tools):
            parameters = tool.function.parameters or {"type": "object", "properties": {}, "additionalProperties": False}
            _check(constraint_json(parameters), f"tools.{i}.function.parameters")
            if tool in tools:
                calls.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                               "arguments": parameters},
                              "required": ["name", "arguments"], "additionalProperties": False})
        constraint = constraint_json(calls[0] if len(calls) == 1 else {"anyOf": calls},
                                     text=self.choice_of_tools == "auto", tools=True)
        _check(constraint, "tools")
        return constraint

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages the model reads: developer as system, and the callable tools described in a system
        message of their own (after the caller's first system message, if any)."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in self.messages]
        tools = self.callable_tools()
        if not tools:
            return messages
        described = "\n".join(json.dumps({"name": t.function.name, "description": t.function.description or "",
                                            "parameters": t.function.parameters or {}}, ensure_ascii=False)
                               for t in tools)
        how = ("To call a function, answer with only a JSON object {\"name\": <the function's name>, \"arguments\": "
               "<its arguments>}" + (", or answer in plain text if no function helps." if self.choice_of_tools == "auto"
                                      else "; answer with a function call."))
        note = {"role": "system", "content": f"You can call these functions:\n{described}\n{how}"}
        at = 1 if messages[0]["role"] == "system" else 0
        return [*messages[:at], note, *messages[at:]]


@dataclass(frozen=True)
class Submission:
    """A checked body, as the request row stores it."""

    serving_config_name: str
    prompt: str | None
    messages: list[dict[str, str]] | None
    sampling: SamplingParams
    num_choices: int = 1  # n: this many rows, decoded together and answered as one


def refuse_unhonoured(body: CompletionBody | ChatCompletionBody) -> None:
    """A Rejection naming the first field the body sets that servelab would not honour."""
    for name, value in (body.model_extra or {}).items():
        rule = NOT_HONOURED.get(name)
        if name in NO_EFFECT or (rule is not None and rule.is_neutral(value)):
            continue
        if rule is not None:
            raise Rejection(f"{name} is not supported: {rule.why}; leave it out (or send "
                            f"{json.dumps(rule.neutral[-1])})", code="unsupported_parameter", param=name)
        raise Rejection(f"unknown field {name!r}: servelab does not know it, so it would be ignored; leave it out",
                        code="unknown_parameter", param=name)
    for i, message in enumerate(getattr(body, "messages", None) or []):
        for name, value in (message.model_extra or {}).items():
            if not EMPTY.is_neutral(value):
                raise Rejection(f"messages[{i}].{name} is not supported: a message is read as its role and content "
                                f"only (the chat template has no place for {name}); leave it out",
                                code="unsupported_parameter", param=f"messages.{i}.{name}")


def to_submission(body: CompletionBody | ChatCompletionBody, *, catalog: Catalog, max_prompt_chars: int
                  ) -> Submission:
    refuse_unhonoured(body)
    refuse_unstreamable(body)
    config = find_config(catalog, body.model)
    try:
        check_num_choices(body.num_choices, max_batch_size=config.batching.max_batch_size)
    except RequestError as exc:
        raise Rejection(str(exc), param="n") from None
    if isinstance(body, ChatCompletionBody):
        messages = body.chat_messages()
        requested = body.max_completion_tokens or body.max_tokens
        prompt = None
    else:
        messages, prompt = None, body.prompt
        requested = body.max_tokens or min(DEFAULT_COMPLETION_MAX_TOKENS, config.decoding.max_new_tokens)
    return checked_submission(config, prompt=prompt, messages=messages, max_prompt_chars=max_prompt_chars,
                              sampling=body.sampling(max_new_tokens(requested, config), sampling_defaults(config)),
                              num_choices=body.num_choices)


def refuse_unstreamable(body: CompletionBody | ChatCompletionBody) -> None:
    """NOTE: a stream relays one request's text; n > 1 and log-probabilities are answered whole, not streamed."""
    if not body.stream:
        return
    if body.num_choices > 1:
        raise Rejection(f"n is {body.num_choices} with stream: true; servelab streams one choice: leave out "
                        "stream (the answer carries every choice) or send n: 1", code="unsupported_parameter",
                        param="n")
    if body.num_top_logprobs is not None:
        raise Rejection("logprobs cannot be streamed: servelab's streams carry text only; leave out stream (the "
                        "answer carries the log-probabilities) or logprobs", code="unsupported_parameter",
                        param="logprobs")


def find_config(catalog: Catalog, name: str) -> ServingConfig:
    try:
        return catalog.get(name)
    except UnknownModel as exc:
        raise Rejection(str(exc), kind="unknown_model", code="model_not_found", param="model") from None


def checked_submission(config: ServingConfig, *, prompt: str | None, messages: list[dict[str, str]] | None,
                       sampling: SamplingParams, max_prompt_chars: int, num_choices: int = 1) -> Submission:
    """A request every edge builds the same way: the prompt's size checked, the sampling against the config."""
    try:
        sampling.check(config.decoding)  # NOTE: the engine checks again; here a bad pair (min_tokens) is a 400
    except RequestError as exc:
        raise Rejection(str(exc), param=str(exc).split(" ", 1)[0]) from None
    num_chars = len(prompt) if prompt is not None else sum(len(m["content"]) for m in messages or [])
    if num_chars > max_prompt_chars:
        raise Rejection(f"the prompt has {num_chars} characters; at most {max_prompt_chars} are accepted",
                        kind="too_large", code="prompt_too_large", param="messages" if messages else "prompt")
    return Submission(config.name, prompt, messages, sampling, num_choices)


def max_new_tokens(requested: int | None, config: ServingConfig, *, param: str = "max_tokens") -> int:
    """What a request may generate: as asked, within the config's limit; not asked: the config's limit."""
    limit = config.decoding.max_new_tokens
    if requested is None:
        return limit
    if requested > limit:
        raise Rejection(f"{param} is {requested}; model {config.name!r} generates at most {limit} tokens",
                        param=param)
    return requested


@dataclass(frozen=True)
class Choice:
    """One choice of a finished request: its text, why it ended, and its tokens' log-probabilities if asked."""

    text: str
    finish_reason: FinishReason
    num_generated_tokens: int
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @classmethod
    def of_stored(cls, text: str, finish_reason: FinishReason | None, num_generated_tokens: int,
                  logprobs: list[dict[str, Any]] | None) -> Choice:
        """From a result row's fields (logprobs as stored: TokenLogprobs.to_stored per token)."""
        return cls(text, finish_reason or FinishReason.STOP, num_generated_tokens,
                   None if logprobs is None else tuple(TokenLogprobs.from_stored(t) for t in logprobs))


@dataclass(frozen=True)
class Answer:
    """A finished request as the OpenAI response objects need it: its choices in order (n of them)."""

    request_id: str  # the first choice's: the response's id
    model: str
    created: int  # unix seconds
    num_prompt_tokens: int
    choices: tuple[Choice, ...]
    num_cached_tokens: int = 0  # of the prompt counted (the first choice's), tokens served from the prefix cache
    tool_calls: bool = False  # the request offered tools: a choice whose text is a call is answered as tool_calls

    def usage(self) -> dict[str, Any]:
        """As OpenAI counts n choices: the prompt once (the first choice's, with its cached tokens), every
        choice's tokens."""
        num_generated = sum(c.num_generated_tokens for c in self.choices)
        return openai_usage(self.num_prompt_tokens, num_generated, self.num_cached_tokens)


def openai_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object. cached_tokens: the prompt tokens served from the prefix cache, given as
    `prompt_tokens_details.cached_tokens` (0 included: nothing was cached); None leaves the details out (a
    stream's running usage, as vLLM's: the figure comes with the request's end)."""
    counted: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                               "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        counted["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counted


def _finish_reason(reason: FinishReason) -> str:
    return "length" if reason is FinishReason.LENGTH else "stop"


def token_text(token_bytes: bytes) -> str:
    """A token as OpenAI's log-probabilities name it: its text, or (part of a character) `bytes:\\xNN...`."""
    try:
        return token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes)


def _chat_token(a: Alternative) -> dict[str, Any]:
    return {"token": token_text(a.token_bytes), "logprob": a.logprob, "bytes": list(a.token_bytes)}


def chat_logprobs(entries: tuple[TokenLogprobs, ...] | None) -> dict[str, Any] | None:
    """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    if entries is None:
        return None
    return {"content": [{**_chat_token(t.chosen), "top_logprobs": [_chat_token(a) for a in t.top]} for t in entries],
            "refusal": None}


def completion_logprobs(entries: tuple[TokenLogprobs, ...] | None) -> dict[str, Any] | None:
    """The legacy shape: parallel lists of tokens, their log-probabilities, {token: logprob} of the top tokens
    (the chosen one always among them, as OpenAI's: up to k + 1) and each token's offset in the text."""
    if entries is None:
        return None
    tops = []
    for t in entries:
        top: dict[str, float] = {}
        for a in (*t.top, t.chosen):  # NOTE: most likely first; two tokens of one text keep the likelier
            top.setdefault(token_text(a.token_bytes), a.logprob)
        tops.append(top)
    return {"tokens": [token_text(t.chosen.token_bytes) for t in entries],
            "token_logprobs": [t.chosen.logprob for t in entries], "top_logprobs": tops,
            "text_offset": [t.text_offset for t in entries]}


def completion_object(answer: Answer) -> dict[str, Any]:
    return {
        "id": f"cmpl-{answer.request_id}", "object": "text_completion", "created": answer.created,
        "model": answer.model, "usage": answer.usage(),
        "choices": [{"index": i, "text": c.text, "logprobs": completion_logprobs(c.logprobs),
                     "finish_reason": _finish_reason(c.finish_reason)} for i, c in enumerate(answer.choices)],
    }


def tool_call(text: str, call_id: str) -> dict[str, Any] | None:
    """OpenAI's tool call for an answer's text when it is one (a whole JSON {"name", "arguments"}): the arguments
    as a JSON string; None for a text answer (tool_choice auto) or one cut short by max_tokens."""
    if not text.startswith("{"):
        return None
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    return {"id": call_id, "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def call_id(request_id: str, index: int = 0) -> str:
    return f"call_{request_id.replace('-', '')}_{index}"


def _chat_choice(answer: Answer, i: int, c: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    finish_reason = _finish_reason(c.finish_reason)
    if answer.tool_calls and (call := tool_call(c.text, call_id(answer.request_id, i))):
        message, finish_reason = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    return {"index": i, "message": message, "logprobs": chat_logprobs(c.logprobs), "finish_reason": finish_reason}


def chat_completion_object(answer: Answer) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{answer.request_id}", "object": "chat.completion", "created": answer.created,
        "model": answer.model, "usage": answer.usage(),
        "choices": [_chat_choice(answer, i, c) for i, c in enumerate(answer.choices)],
    }


@dataclass(frozen=True)
class ChunkWriter:
    """The chunks of one streamed answer, as OpenAI sends them: chat opens with the assistant's role, every
    text piece is a chunk, the last choice chunk carries the finish reason, and with include_usage every
    chunk has `usage: null` and a last chunk with no choices carries the usage; with continuous_usage (vLLM's
    continuous_usage_stats) every chunk carries the usage so far instead of null. With tool_calls (the request
    offered tools) an answer that opens with "{" is a call: held back and sent whole at the end as one
    `tool_calls` delta (finish reason tool_calls); one that opens with text streams as text."""

    endpoint: str
    request_id: str
    model: str
    created: int
    include_usage: bool = False
    continuous_usage: bool = False
    tool_calls: bool = False  # the request offered tools: a call is held back and sent whole at the end
    _text: list[str] = field(default_factory=list)  # NOTE: with tool_calls, the text so far (a call's, held back)

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT_COMPLETIONS

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""})] if self.is_chat else []

    @property
    def _holding(self) -> bool:
        return self.tool_calls and bool(self._text) and self._text[0][:1] == "{"

    def text(self, piece: str, usage: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """A text piece's chunk; None while a tool call is held back."""
        if self.tool_calls:
            self._text.append(piece)
            if self._holding:
                return None
        chunk = self._chunk({"content": piece} if self.is_chat else piece)
        if self.continuous_usage:
            chunk["usage"] = usage
        return chunk

    def closing(self, finish_reason: FinishReason, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
        held, reason = [], _finish_reason(finish_reason)
        if self._holding:
            text = "".join(self._text)
            call = tool_call(text, call_id(self.request_id))
            delta = {"content": text} if call is None else {"tool_calls": [{"index": 0, **call}]}
            held, reason = [self._chunk(delta)], reason if call is None else "tool_calls"
            if self.continuous_usage:
                held[0]["usage"] = usage
        last = self._chunk({} if self.is_chat else "", finish_reason=reason)
        if self.continuous_usage:
            last["usage"] = usage
        if not self.include_usage:
            return [*held, last]
        return [*held, last, {**self._chunk(None), "choices": [], "usage": usage}]

    def _chunk(self, delta: dict[str, Any] | str | None, *, finish_reason: str | None = None) -> dict[str, Any]:
        if self.is_chat:
            head = {"id": f"chatcmpl-{self.request_id}", "object": "chat.completion.chunk"}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            head = {"id": f"cmpl-{self.request_id}", "object": "text_completion"}
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**head, "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk


def response_object(endpoint: str, answer: Answer) -> dict[str, Any]:
    assert endpoint in ENDPOINTS, f"unknown endpoint {endpoint!r}"
    return chat_completion_object(answer) if endpoint == CHAT_COMPLETIONS else completion_object(answer)


def body_model(endpoint: str) -> type[CompletionBody] | type[ChatCompletionBody]:
    assert endpoint in ENDPOINTS, f"unknown endpoint {endpoint!r}"
    return ChatCompletionBody if endpoint == CHAT_COMPLETIONS else CompletionBody
