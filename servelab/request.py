"""The request contract: what a caller asks for (a prompt or chat messages, and how to sample), the states a
request goes through and why it finished, with one set of bounds that every edge and the engine check.

The API and batch-file ingest build a SamplingParams, the store saves it and the worker loads it through one
pair of functions (`to_stored` / `from_stored`), the engine reads it. Knows no HTTP, SQL, Redis or torch:
every other room stands on it. Does not know a serving config's own limits beyond `check`.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from servelab.config import DecodingConfig

# NOTE: the bounds of every edge (HTTP bodies, batch files, the native API) and of the engine; OpenAI's own
# where it has one (temperature up to 2, 4 stop strings).
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
MAX_TOP_K = 1_000_000
MAX_SEED = 2**63 - 1
MAX_REQUESTED_TOKENS = 1_000_000  # what an edge accepts before the config's own max_new_tokens decides
MAX_PENALTY = 2.0  # presence and frequency penalties: -2..2, as OpenAI's
MAX_TOP_LOGPROBS = 20  # alternatives per token: chat's top_logprobs (and the native API's logprobs)
MAX_COMPLETION_LOGPROBS = 5  # the legacy /v1/completions `logprobs` (an int) goes up to 5
MAX_CHOICES = 128  # n: OpenAI's bound; a serving config's max_batch_size is the real one (check_num_choices)


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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def check(self, limits: DecodingConfig) -> None:
        if not 1 <= self.max_new_tokens <= limits.max_new_tokens:
            raise RequestError(
                f"max_new_tokens must be between 1 and {limits.max_new_tokens}, got {self.max_new_tokens}"
            )
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise RequestError(f"temperature must be between 0 and {MAX_TEMPERATURE:g}, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise RequestError(f"top_k must be 0 (off) or up to {MAX_TOP_K}, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise RequestError(f"seed must be between 0 and 2**63 - 1, got {self.seed}")
        if any(not s for s in self.stop) or len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings, got {list(self.stop)!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise RequestError(f"{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, "
                                   f"got {getattr(self, name)}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs (alternatives per token) must be between 0 and {MAX_TOP_LOGPROBS}, "
                               f"got {self.logprobs}")

    def to_stored(self) -> dict[str, Any]:
        """As the request row keeps it (JSON)."""
        return {**asdict(self), "stop": list(self.stop)}

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any]) -> SamplingParams:
        """A request row's sampling back; a field it cannot read is a RequestError naming it. A field the row
        lacks (a row written before the field existed) takes its default, which asks for nothing."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(stored) - known)
        if unknown:
            raise RequestError(f"stored sampling has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**{**stored, "stop": tuple(stored.get("stop") or ())})


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


def check_num_choices(n: int, *, max_batch_size: int) -> None:
    """n choices are n rows decoded in one batch: at most the serving config's batch."""
    if not 1 <= n <= min(MAX_CHOICES, max_batch_size):
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
