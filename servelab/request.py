"""The request contract: what a caller asks for (a prompt or chat messages, and how to sample), the states a
request goes through and why it finished, with one set of bounds that every edge and the engine check.

The API and batch-file ingest build a SamplingParams, the store saves it and the worker loads it through one
pair of functions (`to_stored` / `from_stored`), the engine reads it. Knows no HTTP, SQL, Redis or torch:
every other room stands on it. Does not know a serving config's own limits beyond `check`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from pydantic import Field

from servelab.config import DecodingConfig

# NOTE: the bounds of every edge (HTTP bodies, batch files, the native API) and of the engine, in one table that the
# body models (bounded) and SamplingParams.check both read; OpenAI's own where it has one (temperature up to 2, 4
# stop strings), vLLM's for its extra fields.
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64
MAX_TOP_K = 1_000_000
MAX_SEED = 2**63 - 1
MAX_REQUESTED_TOKENS = 1_000_000  # what an edge accepts before the config's own max_new_tokens decides
MAX_PENALTY = 2.0  # presence and frequency penalties: -2..2, as OpenAI's
MAX_REPETITION_PENALTY = 10.0  # vLLM takes any value > 0; past 10 every seen token is all but banned
MAX_TOP_LOGPROBS = 20  # alternatives per token: chat's top_logprobs (and the native API's logprobs)
MAX_COMPLETION_LOGPROBS = 5  # the legacy /v1/completions `logprobs` (an int) goes up to 5
MAX_CHOICES = 128  # n: OpenAI's bound; a serving config's max_batch_size is the real one (check_num_choices)
MAX_TOKEN_ID = 2**31 - 1


@dataclass(frozen=True)
class Bound:
    """A number's allowed range: low..high, low itself excluded when low_open."""

    low: float
    high: float
    low_open: bool = False
    what: str = ""  # said after the name in a refusal

    def holds(self, value: float) -> bool:
        return (self.low < value if self.low_open else self.low <= value) and value <= self.high

    def describe(self, name: str, value: Any) -> str:
        named = f"{name} ({self.what})" if self.what else name
        if self.low_open:
            return f"{named} must be in ({self.low:g}, {self.high:g}], got {value}"
        return f"{named} must be between {self.low:g} and {self.high:g}, got {value}"


BOUNDS: dict[str, Bound] = {
    "max_new_tokens": Bound(1, MAX_REQUESTED_TOKENS),
    "temperature": Bound(0.0, MAX_TEMPERATURE),
    "top_p": Bound(0.0, 1.0, low_open=True),
    "top_k": Bound(0, MAX_TOP_K),  # 0: off
    "min_p": Bound(0.0, 1.0),  # 0: off
    "seed": Bound(0, MAX_SEED),
    "presence_penalty": Bound(-MAX_PENALTY, MAX_PENALTY),
    "frequency_penalty": Bound(-MAX_PENALTY, MAX_PENALTY),
    "repetition_penalty": Bound(0.0, MAX_REPETITION_PENALTY, low_open=True),  # 1: off
    "min_tokens": Bound(0, MAX_REQUESTED_TOKENS),
    "logprobs": Bound(0, MAX_TOP_LOGPROBS, what="alternatives per token"),
    "choices": Bound(1, MAX_CHOICES),
}


def bounded(name: str, default: Any, **kwargs: Any) -> Any:
    """A pydantic Field for a body field with BOUNDS[name]: every edge's model declares its numbers with this."""
    bound = BOUNDS[name]
    low = {"gt": bound.low} if bound.low_open else {"ge": bound.low}
    return Field(default=default, le=bound.high, **low, **kwargs)


# What an unknown field in a request body is told (not configs/, which has nothing to do with request fields).
UNKNOWN_BODY_FIELD = "check the spelling; GET /openapi.json lists the fields every body takes"


class RequestError(ValueError):
    """One request cannot be served as asked; the message names the field and the limit."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_new_tokens reached
    ERROR = "error"
    CANCELLED = "cancelled"


class RequestStatus(str, enum.Enum):
    """A request's state. Ordered: queued < running < a terminal state (succeeded, failed, cancelled).

    The PostgreSQL enum keeps this declaration order, so `status < 'succeeded'` means "not finished".
    """

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def rank(self) -> int:
        """0 queued, 1 running, 2 for every terminal state: they are siblings, not a sequence."""
        return {RequestStatus.QUEUED: 0, RequestStatus.RUNNING: 1}.get(self, 2)

    @property
    def is_terminal(self) -> bool:
        return self.rank == 2

    def can_move_to(self, other: RequestStatus) -> bool:
        """Forward only; running -> queued is the one step back (a lost worker's request is re-queued)."""
        if self is RequestStatus.RUNNING and other is RequestStatus.QUEUED:
            return True
        return other.rank > self.rank


class StreamKind(str, enum.Enum):
    """Which stream of its serving config a request waits in; the worker serves interactive first."""

    INTERACTIVE = "interactive"
    BULK = "bulk"


# NOTE: the fields every stored row has held since token-level serving; a row keeps them whatever their value
STORED_ALWAYS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos",
                           "presence_penalty", "frequency_penalty", "logprobs"})


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: every row decodes exactly max_new_tokens
    # NOTE: as OpenAI and vLLM define them, over the row's generated tokens (never the prompt's):
    # logits[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t], before temperature
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely ones'
    # vLLM's extra fields, as vLLM defines them:
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings end nothing before this many tokens (EOS is masked)
    stop_token_ids: tuple[int, ...] = ()  # generating one of these ends the row (finish reason stop)
    repetition_penalty: float = 1.0  # a token seen in prompt or output: logit / rp if positive, logit * rp if not
    min_p: float = 0.0  # after temperature, keep tokens with p >= min_p * max p
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text, not cut
    skip_special_tokens: bool = True  # special tokens' text left out of the answer
    # structured output: servelab's constraint JSON (servelab/engine/grammar.py), the answer held to a JSON schema
    # (response_format, tools); None: free text. Ends the answer when the grammar is complete.
    constraint: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def check(self, limits: DecodingConfig) -> None:
        if not 1 <= self.max_new_tokens <= limits.max_new_tokens:
            raise RequestError(
                f"max_new_tokens must be between 1 and {limits.max_new_tokens}, got {self.max_new_tokens}"
            )
        for name, bound in BOUNDS.items():
            value = getattr(self, name, None)
            if value is not None and not bound.holds(value):
                raise RequestError(bound.describe(name, value))
        if any(not s for s in self.stop) or len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {list(self.stop)!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(0 <= t <= MAX_TOKEN_ID
                                                                     for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} token ids (0 or more), got "
                               f"{list(self.stop_token_ids)!r}")
        if self.constraint is not None and (self.ignore_eos or self.min_tokens):
            raise RequestError(f"{'ignore_eos' if self.ignore_eos else 'min_tokens'} cannot be combined with "
                               "structured output (response_format or tools): the grammar decides where the answer "
                               "ends; leave it out")
        if self.min_tokens > self.max_new_tokens:
            raise RequestError(f"min_tokens is {self.min_tokens}, above max_tokens ({self.max_new_tokens}): lower "
                               "min_tokens or raise max_tokens")

    def to_stored(self) -> dict[str, Any]:
        """As the request row keeps it (JSON). A field added since STORED_ALWAYS is left out at its default (it
        reads back as that default), so a worker of the release before it existed still serves every request
        that does not use it: the API can be upgraded before the workers of a rolling deploy."""
        defaults, stored = SamplingParams(), {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in STORED_ALWAYS or value != getattr(defaults, f.name):
                stored[f.name] = list(value) if isinstance(value, tuple) else value
        return stored

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> SamplingParams:
        """A request row's sampling back; a field it cannot read is a RequestError naming it. A field the row
        lacks (a row written before the field existed) takes its default, which asks for nothing."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(stored) - known)
        if unknown:
            raise RequestError(f"stored sampling has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**{**stored, "stop": tuple(stored.get("stop") or ()),
                      "stop_token_ids": tuple(stored.get("stop_token_ids") or ())})


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    # NOTE: set once, when a worker admits the request (Engine.tokenize: chat template applied, bounds checked);
    # a preempted or re-added request keeps them, so a prompt is tokenised once per worker that serves it
    prompt_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        assert (self.prompt is None) != (self.messages is None), "give exactly one of prompt or messages"

    @property
    def is_tokenized(self) -> bool:
        return self.prompt_token_ids is not None


# NOTE: a lone surrogate (U+D800..U+DFFF unpaired) is what JSON's "\\ud800" escape and Python's str can hold but no
# UTF-8 can: no tokenizer reads it and no database stores it, so every edge refuses it, naming where it is. Any other
# text (NUL and control characters included) is served as the tokenizer reads it.
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class NonText:
    """Where a JSON value holds a lone surrogate: the string's path (dotted keys and indexes), the index in it."""

    where: str
    at: int
    char: str

    @property
    def message(self) -> str:
        return (f"{self.where} holds a lone surrogate (U+{ord(self.char):04X} at character {self.at}), which is not "
                "Unicode text and cannot be encoded as UTF-8: send the character it stands for (a surrogate pair "
                "escapes one character: \\ud83d\\ude00 is U+1F600) or leave it out")


def find_non_text(value: Any) -> NonText | None:
    """The first string of a JSON value (keys included) that holds a lone surrogate, or None when every string is
    Unicode text."""
    stack: list[tuple[tuple[str, ...], Any]] = [((), value)]  # NOTE: a walk, not recursion: JSON nests deep
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item) if not item.isascii() else None
            if found:
                return NonText(".".join(path) or "(the body)", found.start(), found.group())
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                name = key if key.isascii() and key.isprintable() else ascii(key)
                stack.append(((*path, "(a key)"), key))
                stack.append(((*path, name), child))
        elif isinstance(item, list | tuple):
            stack.extend(((*path, str(i)), child) for i, child in reversed(list(enumerate(item))))
    return None


def check_num_choices(n: int, *, max_batch_size: int) -> None:
    """n choices are n rows decoded in one batch: at most the serving config's batch."""
    if not BOUNDS["choices"].holds(n) or n > max_batch_size:
        raise RequestError(f"n must be between 1 and {min(MAX_CHOICES, max_batch_size)} (this model's "
                           f"max_batch_size: the n choices decode in one batch), got {n}")


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice i of an n-choice request samples with seed + i (wrapping at 2**63), so each choice differs and the
    whole answer is reproducible from the one seed; without a seed each choice draws its own."""
    return None if seed is None else (seed + index) % (MAX_SEED + 1)


def check_prompt_length(num_prompt_tokens: int, params: SamplingParams, limits: DecodingConfig) -> None:
    if num_prompt_tokens == 0:
        raise RequestError("prompt is empty: give at least one token of text")
    if num_prompt_tokens + params.max_new_tokens > limits.max_context_tokens:
        raise RequestError(
            f"prompt has {num_prompt_tokens} tokens and max_new_tokens is {params.max_new_tokens}: "
            f"{num_prompt_tokens + params.max_new_tokens} > max_context_tokens {limits.max_context_tokens}; "
            "shorten the prompt or lower max_new_tokens"
        )
