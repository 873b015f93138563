"""Workloads: a prompt set, an optional shared system prompt, output caps, an arrival process, an optional bulk
backlog and SLOs, replayed identically for every config.

Knows the YAML format, the built-in prompt sets and system prompts (the benches reuse them: `system_prompt`,
`builtin_prompts`), the seeded arrival schedule and the fingerprint (prompts, lengths and arrival times) that
keeps runs on different workloads from being compared. Pure: no clock, no queue, no torch. Bad files get a
WorkloadError naming the field and the fix.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from servelab.config import describe_validation_error, read_yaml_mapping
from servelab.request import SamplingParams

PROMPTS_DIR = Path(__file__).parent / "prompts"
BUILTIN_SETS = {"chat": PROMPTS_DIR / "chat.jsonl", "library": PROMPTS_DIR / "library.jsonl"}
# NOTE: a library help desk's instructions and worked examples, about 570 tokens for the bundled model's tokenizer:
# the shared prefix of workloads/shared-prefix.yaml and of `servelab bench prefix` (what prefix caching reuses)
BUILTIN_SYSTEM_PROMPTS = {"library": PROMPTS_DIR / "library-system.txt"}


class WorkloadError(ValueError):
    """A workload or prompt file that cannot be used; the message names the file, line or field."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SystemSpec(_Frozen):
    """A system message sent before every prompt of the workload, bulk ones too: one shared prefix."""

    set: Literal["library"] | None = Field(default=None, description="a built-in system prompt")
    file: str | None = Field(default=None, description="a UTF-8 text file: its whole text is the system message")

    @model_validator(mode="after")
    def _one_source(self) -> SystemSpec:
        if (self.set is None) == (self.file is None):
            raise ValueError("give exactly one of 'set' (built-in: library) or 'file' (a text file's path)")
        return self


class PromptSpec(_Frozen):
    set: Literal["chat", "library"] | None = Field(default=None, description="a built-in prompt set")
    file: str | None = Field(default=None, description="JSONL: {'prompt': ...} or {'messages': [...]} per line")
    num_prompts: int = Field(default=16, ge=1, le=100_000)
    seed: int = 0
    chat: bool = Field(default=True, description="wrap plain prompts as a user message in the chat template")
    system: SystemSpec | None = Field(default=None, description="a system message before every prompt (a shared "
                                                                "prefix, as a support desk's instructions are)")

    @model_validator(mode="after")
    def _one_source(self) -> PromptSpec:
        if (self.set is None) == (self.file is None):
            raise ValueError("give exactly one of 'set' (built-in: chat, library) or 'file' (a JSONL path)")
        if self.system is not None and not self.chat:
            raise ValueError("system needs chat: true (a system message goes through the chat template; a plain "
                             "prompt has none)")
        return self


class ArrivalSpec(_Frozen):
    process: Literal["poisson", "burst", "closed"] = "poisson"
    rate_per_s: float = Field(default=2.0, gt=0, le=10_000, description="poisson: mean arrivals per second")
    num_clients: int = Field(default=4, ge=1, le=1024, description="closed: clients, each one request at a time")
    seed: int = 0


class SLOSpec(_Frozen):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2e_ms: float | None = Field(default=None, gt=0)


class BulkSpec(_Frozen):
    """A bulk backlog enqueued at the start, on the bulk stream, beside the interactive arrivals."""

    num_requests: int = Field(ge=1, le=100_000)
    min_new_tokens: int = Field(default=16, ge=1, le=8192)
    max_new_tokens: int = Field(default=256, ge=1, le=8192, description="each request's cap is drawn uniformly "
                                                                        "between min_new_tokens and this")
    ignore_eos: bool = Field(default=True, description="every bulk request decodes exactly its drawn cap")
    seed: int = 0

    @model_validator(mode="after")
    def _range(self) -> BulkSpec:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) is above max_new_tokens ({self.max_new_tokens})")
        return self


class WorkloadSpec(_Frozen):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    prompts: PromptSpec
    max_new_tokens: int = Field(default=32, ge=1, le=8192)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0, description="0: greedy, so outputs can be compared")
    ignore_eos: bool = Field(default=False, description="every request decodes exactly max_new_tokens")
    arrival: ArrivalSpec = ArrivalSpec()
    bulk: BulkSpec | None = Field(default=None, description="a bulk backlog sent at the start on the bulk stream")
    slo: SLOSpec = SLOSpec()


@dataclass(frozen=True)
class WorkloadItem:
    index: int
    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    max_new_tokens: int
    offset_s: float | None  # scheduled arrival after the start; None for closed-loop clients
    is_bulk: bool = False

    def sampling(self, spec: WorkloadSpec) -> SamplingParams:
        seed = spec.arrival.seed * 100_003 + self.index if spec.temperature > 0 else None  # same in every replay
        ignore_eos = spec.bulk.ignore_eos if self.is_bulk and spec.bulk else spec.ignore_eos
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=spec.temperature,
                              ignore_eos=ignore_eos, seed=seed)


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec
    items: tuple[WorkloadItem, ...]
    fingerprint: str

    @property
    def name(self) -> str:
        return self.spec.name


def load_workload(path: str | Path) -> Workload:
    path = Path(path)
    data = read_yaml_mapping(path, "workload", WorkloadError)
    try:
        spec = WorkloadSpec.model_validate(data)
    except ValidationError as exc:
        raise WorkloadError(f"{path}: {describe_validation_error(exc)}") from None
    return build_workload(spec, base_dir=path.parent)


def build_workload(spec: WorkloadSpec, *, base_dir: Path = Path(".")) -> Workload:
    source = _read_prompt_file(_prompt_path(spec.prompts, base_dir))
    system = _system_text(spec.prompts.system, base_dir, source, _prompt_path(spec.prompts, base_dir))
    prompts = _sample(source, spec.prompts)
    offsets = arrival_offsets(spec.arrival, len(prompts))
    items = tuple(
        WorkloadItem(i, *_as_prompt(record, spec.prompts.chat, system),
                     int(record.get("max_new_tokens", spec.max_new_tokens)), offset)
        for i, (record, offset) in enumerate(zip(prompts, offsets))
    )
    if spec.bulk is not None:
        items += _bulk_items(spec, source, system, first_index=len(items))
    return Workload(spec, items, fingerprint(spec, items))


def _bulk_items(spec: WorkloadSpec, source: list[dict[str, Any]], system: str | None, *,
                first_index: int) -> tuple[WorkloadItem, ...]:
    """The backlog: prompts from the same source (its own seeded draw), caps drawn between the bounds."""
    bulk = spec.bulk
    draw = spec.prompts.model_copy(update={"num_prompts": bulk.num_requests, "seed": bulk.seed})
    records = _sample(source, draw)
    caps = np.random.default_rng(bulk.seed).integers(bulk.min_new_tokens, bulk.max_new_tokens + 1, bulk.num_requests)
    return tuple(WorkloadItem(first_index + i, *_as_prompt(record, spec.prompts.chat, system), int(cap), 0.0,
                              is_bulk=True)
                 for i, (record, cap) in enumerate(zip(records, caps.tolist())))


def system_prompt(name: str) -> str:
    """A built-in system prompt's text (BUILTIN_SYSTEM_PROMPTS), for the benches that reuse a workload's prefix."""
    if name not in BUILTIN_SYSTEM_PROMPTS:
        raise WorkloadError(f"no built-in system prompt {name!r}; built-in: {', '.join(BUILTIN_SYSTEM_PROMPTS)}")
    return BUILTIN_SYSTEM_PROMPTS[name].read_text(encoding="utf-8").strip()


def builtin_prompts(name: str) -> list[str]:
    """A built-in prompt set's plain prompts, in file order."""
    if name not in BUILTIN_SETS:
        raise WorkloadError(f"no built-in prompt set {name!r}; built-in: {', '.join(BUILTIN_SETS)}")
    return [record["prompt"] for record in _read_prompt_file(BUILTIN_SETS[name]) if "prompt" in record]


def _system_text(system: SystemSpec | None, base_dir: Path, source: list[dict[str, Any]],
                 source_path: Path) -> str | None:
    """The workload's system message, checked: a readable, non-empty text, and no prompt with one of its own."""
    if system is None:
        return None
    if system.set is not None:
        return system_prompt(system.set)
    path = Path(system.file)
    path = path if path.is_absolute() or path.exists() else base_dir / path
    if not path.is_file():
        raise WorkloadError(f"prompts.system.file: no such file {path}")
    try:
        text = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"prompts.system.file: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text:
        raise WorkloadError(f"prompts.system.file: {path} holds no text")
    for k, record in enumerate(source, start=1):
        if any(m["role"] == "system" for m in record.get("messages") or ()):
            raise WorkloadError(f"{source_path}: prompt {k} has a system message of its own, and prompts.system "
                                "gives every prompt one: drop one of the two")
    return text


def arrival_offsets(arrival: ArrivalSpec, num_requests: int) -> list[float | None]:
    """Seconds after the start at which each request is sent; None for closed-loop clients."""
    if arrival.process == "burst":
        return [0.0] * num_requests
    if arrival.process == "closed":
        return [None] * num_requests
    gaps = np.random.default_rng(arrival.seed).exponential(1.0 / arrival.rate_per_s, num_requests)
    return [0.0, *np.cumsum(gaps[1:]).round(6).tolist()]


def fingerprint(spec: WorkloadSpec, items: tuple[WorkloadItem, ...]) -> str:
    """Hash of what is replayed: every prompt, its output cap, its arrival time, and how it is sampled."""
    body = {
        "items": [[it.prompt, it.messages, it.max_new_tokens, it.offset_s, *(["bulk"] if it.is_bulk else [])]
                  for it in items],
        "arrival": spec.arrival.model_dump(), "temperature": spec.temperature, "ignore_eos": spec.ignore_eos,
    }
    if spec.bulk is not None:  # NOTE: only then, so fingerprints of workloads without a backlog stay as they were
        body["bulk"] = spec.bulk.model_dump()
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _prompt_path(prompts: PromptSpec, base_dir: Path) -> Path:
    if prompts.set is not None:
        return BUILTIN_SETS[prompts.set]
    path = Path(prompts.file)
    return path if path.is_absolute() or path.exists() else base_dir / path


def _read_prompt_file(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise WorkloadError(f"prompts.file: no such file {path}")
    records = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not (isinstance(record.get("prompt"), str) or
                                                isinstance(record.get("messages"), list)):
            raise WorkloadError(f"{path}:{line_no}: each line needs a 'prompt' string or a 'messages' list")
        messages = record.get("messages")
        if messages is not None and not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                            and isinstance(m.get("content"), str) for m in messages):
            raise WorkloadError(f"{path}:{line_no}: each message needs 'role' and 'content' strings")
        cap = record.get("max_new_tokens")
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise WorkloadError(f"{path}:{line_no}: max_new_tokens must be a positive whole number, got {cap!r}")
        records.append(record)
    if not records:
        raise WorkloadError(f"{path}: holds no prompts")
    return records


def _sample(records: list[dict[str, Any]], prompts: PromptSpec) -> list[dict[str, Any]]:
    """num_prompts records: a seeded permutation, cycled when the set is smaller than asked."""
    order = np.random.default_rng(prompts.seed).permutation(len(records)).tolist()
    return [records[order[i % len(order)]] for i in range(prompts.num_prompts)]


def _as_prompt(record: dict[str, Any], chat: bool, system: str | None = None
               ) -> tuple[str | None, tuple[dict[str, str], ...] | None]:
    opening = ({"role": "system", "content": system},) if system is not None else ()
    if "messages" in record:
        return None, opening + tuple({"role": m["role"], "content": m["content"]} for m in record["messages"])
    if chat:
        return None, opening + ({"role": "user", "content": record["prompt"]},)
    return record["prompt"], None
