"""What a caller asks the engine for: a prompt or chat messages, and how to sample.

Knows the allowed range of every sampling parameter and checks a request against a serving
config's limits. Imports no torch: the worker and the lab build these before a model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servelab.config import DecodingConfig


class RequestError(ValueError):
    """One request cannot be served as asked; the message names the field and the limit."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks: every row decodes exactly max_new_tokens

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self, limits: DecodingConfig) -> None:
        if not 1 <= self.max_new_tokens <= limits.max_new_tokens:
            raise RequestError(
                f"max_new_tokens must be between 1 and {limits.max_new_tokens}, got {self.max_new_tokens}"
            )
        if not 0.0 <= self.temperature <= 10.0:
            raise RequestError(f"temperature must be between 0 and 10, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if any(not s for s in self.stop) or len(self.stop) > 8:
            raise RequestError(f"stop takes at most 8 non-empty strings, got {list(self.stop)!r}")


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

    def __post_init__(self) -> None:
        assert (self.prompt is None) != (self.messages is None), "give exactly one of prompt or messages"


def check_prompt_length(num_prompt_tokens: int, params: SamplingParams, limits: DecodingConfig) -> None:
    if num_prompt_tokens == 0:
        raise RequestError("prompt is empty: give at least one token of text")
    if num_prompt_tokens + params.max_new_tokens > limits.max_context_tokens:
        raise RequestError(
            f"prompt has {num_prompt_tokens} tokens and max_new_tokens is {params.max_new_tokens}: "
            f"{num_prompt_tokens + params.max_new_tokens} > max_context_tokens {limits.max_context_tokens}; "
            "shorten the prompt or lower max_new_tokens"
        )
