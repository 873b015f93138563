"""ServingConfig: what is served and measured. Frozen, hashed, loaded from a YAML file.

Knows the allowed values of every field and turns a bad file into a ConfigError that names the
field, the bad value and what is allowed. Does not know where servers or folders are (Settings)
and imports no torch: the API and the dashboard read configs too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BUNDLED_PREFIX = "bundled:"
BUNDLED_MODELS = ("smollm2-135m-instruct",)

WeightPrecision = Literal["fp32", "bf16", "fp16", "awq-int4"]
KVCacheDtype = Literal["auto", "fp32", "bf16", "fp16", "int8"]


class ConfigError(ValueError):
    """A serving config that cannot be used; the message names the field, the value and the fix."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BatchingConfig(_Frozen):
    policy: Literal["window", "continuous"] = Field(default="window", description=(
        "window: a batch forms within max_wait_ms, then runs closed; continuous: requests join at every "
        "decode step, and interactive ones preempt bulk rows when the batch is full"))
    max_batch_size: int = Field(default=16, ge=1, le=1024)
    max_wait_ms: float = Field(default=20.0, ge=0.0, le=60_000.0, description="window: how long a batch forms")
    # NOTE: counted as the room the batch's cache holds: rows x the longest row's prompt + max_new_tokens.
    max_batch_tokens: int = Field(default=16_384, ge=1)
    min_bulk_rows: int = Field(default=1, ge=0, le=1024, description=(
        "rows bulk work keeps while it waits, so interactive traffic cannot starve a bulk job"))
    max_prefill_tokens: int = Field(default=256, ge=1, description=(
        "continuous: prompt tokens (rows x longest prompt) prefilled between two decode steps; one "
        "newcomer always joins"))
    max_kv_cache_mib: int | None = Field(default=None, ge=1, description=(
        "KV-cache memory a batch may take; with the model's shape and the cache dtype it caps max_batch_tokens (on "
        "CUDA it caps the pool sized from the device's free memory)"))


class KVCacheConfig(_Frozen):
    """servelab's paged KV cache: a pool of fixed-size blocks (sized by batching.max_kv_cache_mib, else by
    max_batch_tokens), a block table per row, full blocks shared between requests by their tokens' hash."""

    block_size: int = Field(default=16, ge=1, le=1024, description=(
        "tokens per KV block: a row takes blocks as it grows; only full blocks are shared by prefix caching"))
    prefix_caching: bool | None = Field(default=None, description=(
        "reuse the KV blocks of a prompt prefix already computed (a shared system prompt is prefilled once); "
        "false: every prompt is prefilled whole; unset: on wherever servelab's decoder serves. transformers' "
        "decoder keeps its own cache: asking it for prefix caching (true) is refused"))
    eviction: Literal["none", "window"] = Field(default="none", description=(
        "none: a row keeps every token's keys and values; window: a row keeps its first sink_tokens (attention "
        "sinks) and its most recent window_tokens, whole blocks between them are freed as it grows, so its KV "
        "bytes stop growing at the bound (servelab's decoder only)"))
    sink_tokens: int = Field(default=64, ge=0, le=1 << 20, description=(
        "window: the first tokens every later token still attends to (attention sinks), rounded up to whole "
        "blocks; 0: none (a plain sliding window), else at least block_size"))
    window_tokens: int = Field(default=512, ge=1, le=1 << 20, description=(
        "window: the most recent tokens every token attends to, rounded up to whole blocks; with the block being "
        "filled a token sees between window blocks x block_size and one block more; at least block_size"))

    @model_validator(mode="after")
    def _window_in_blocks(self) -> KVCacheConfig:
        if self.eviction == "window":
            if self.window_tokens < self.block_size:
                raise ValueError(f"kv_cache.window_tokens ({self.window_tokens}) must be at least block_size "
                                 f"({self.block_size}): eviction frees whole blocks")
            if 0 < self.sink_tokens < self.block_size:
                raise ValueError(f"kv_cache.sink_tokens ({self.sink_tokens}) must be 0 or at least block_size "
                                 f"({self.block_size}): sinks are kept as whole blocks")
        return self

    @property
    def sink_blocks(self) -> int:
        """Blocks kept at a row's start under window eviction (sink_tokens rounded up to whole blocks)."""
        return -(-self.sink_tokens // self.block_size)

    @property
    def window_blocks(self) -> int:
        """Full blocks kept behind the block being filled under window eviction (window_tokens rounded up)."""
        return -(-self.window_tokens // self.block_size)


class DecodingConfig(_Frozen):
    max_new_tokens: int = Field(default=256, ge=1, description="largest max_new_tokens a request may ask")
    max_context_tokens: int = Field(default=2048, ge=2, description="prompt + new tokens, at most")

    @model_validator(mode="after")
    def _new_fits_context(self) -> DecodingConfig:
        if self.max_new_tokens >= self.max_context_tokens:
            raise ValueError(
                f"max_new_tokens ({self.max_new_tokens}) must be below max_context_tokens "
                f"({self.max_context_tokens}) to leave room for a prompt"
            )
        return self


class AWQConfig(_Frozen):
    """How `servelab quantize` makes int4 weights from a full-precision model, and the kernel that serves int4 weights.
    For a published AWQ checkpoint (the model folder's config.json declares quantization_config) bits, group_size and
    zero_point state the checkpoint's (checked when it loads), method stays awq and the calibration fields are unread."""

    method: Literal["awq", "rtn"] = Field(default="awq", description="rtn: round-to-nearest, the baseline AWQ must beat")
    bits: Literal[4] = 4
    group_size: Literal[32, 64, 128] = 64
    zero_point: bool = True
    num_calibration_samples: int = Field(default=128, ge=1, le=4096)
    calibration_seq_len: int = Field(default=256, ge=16, le=4096)
    calibration_set: Literal["hellaswag", "arc_easy", "piqa"] = "hellaswag"
    kernel: Literal["auto", "servelab", "aten", "torch", "triton", "marlin", "gemm", "exllama"] = Field(
        default="auto", description="int4 matmul: auto = servelab's own on CPU (ATen's where it cannot run), on CUDA "
        "gptqmodel's pick where gptqmodel is installed, else ATen's (tinygemm, bf16); servelab (CPU) and aten load "
        "the checkpoint without gptqmodel; the rest name a gptqmodel backend")
    activations: Literal["int8", "float"] = Field(
        default="int8", description="servelab's int4 kernel at few rows: int8 = activations quantised per group, integer "
                                    "dot products (streams the weights at the bandwidth); float = fp32 activations on "
                                    "weights dequantised in registers (closer to full precision, slower)")


class ServingConfig(_Frozen):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: str = Field(default=f"{BUNDLED_PREFIX}{BUNDLED_MODELS[0]}", min_length=1)
    weights: WeightPrecision = "fp32"
    kv_cache_dtype: KVCacheDtype = Field(default="auto", description=(
        "the KV cache's precision: auto = the serving dtype; int8 = keys and values quantised per token and kv head "
        "(an fp32 scale each), read as stored by servelab's decode kernel; needs servelab's decoder"))
    device: str = "auto"
    num_threads: int | None = Field(default=None, ge=1, le=256)
    decoder: Literal["auto", "transformers"] = Field(
        default="auto", description="auto: servelab's decoder where it covers the model, else transformers'")
    paged_attention: Literal["auto", "servelab", "flex", "torch"] = Field(
        default="auto", description="how servelab's decoder reads the paged KV pool: servelab = its fused kernels (CPU, "
                                    "fp32 / bf16); flex = PyTorch's FlexAttention, compiled, reading each decode row's "
                                    "blocks in place (prompt chunks gather theirs); torch = each row's blocks gathered, "
                                    "then torch's attention; auto = servelab's where it serves, else on CUDA whichever "
                                    "of flex and torch a timed step at load finds faster, else torch")
    cuda_graph_rows: int = Field(
        default=64, ge=0, le=1024, description="on CUDA with paged_attention flex: a step of only decode rows, up to "
                                              "this many, is replayed from a CUDA graph captured at its padded size "
                                              "(powers of two from 4); 0: every step launches its kernels")
    linear_kernel: Literal["auto", "servelab", "servelab-avx512", "servelab-avx2", "onednn", "torch"] = Field(
        default="auto", description="matmul kernel of servelab's decoder on CPU; auto: measured on this CPU, "
                                    "the fastest at each batch size")
    lm_head_weights: Literal["auto", "int8"] = Field(
        default="auto", description="the output layer (and a tied embedding): auto = the serving dtype, or bf16 where "
                                    "the checkpoint stores it so; int8 = quantised per output row at load (servelab's "
                                    "kernel, CPU), half of bf16's bytes")
    batching: BatchingConfig = BatchingConfig()
    kv_cache: KVCacheConfig = KVCacheConfig()
    decoding: DecodingConfig = DecodingConfig()
    awq: AWQConfig | None = None

    @field_validator("model")
    @classmethod
    def _known_bundled_model(cls, value: str) -> str:
        if value.startswith(BUNDLED_PREFIX) and value.removeprefix(BUNDLED_PREFIX) not in BUNDLED_MODELS:
            allowed = ", ".join(BUNDLED_PREFIX + m for m in BUNDLED_MODELS)
            raise ValueError(f"unknown bundled model {value!r}; bundled models: {allowed}")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda"):
            return value
        if value.startswith("cuda:") and value.removeprefix("cuda:").isdigit():
            return value
        raise ValueError(f"unknown device {value!r}; allowed: 'auto', 'cpu', 'cuda', 'cuda:N'")

    @model_validator(mode="after")
    def _awq_settings_match_weights(self) -> ServingConfig:
        if self.weights == "awq-int4" and self.awq is None:
            object.__setattr__(self, "awq", AWQConfig())
        if self.weights != "awq-int4" and self.awq is not None:
            raise ValueError(f"an 'awq' section needs weights: awq-int4 (weights is {self.weights!r})")
        return self

    @model_validator(mode="after")
    def _prefix_caching_needs_servelab_decoder(self) -> ServingConfig:
        if self.decoder == "transformers" and self.kv_cache.prefix_caching is True:
            raise ValueError("kv_cache.prefix_caching needs servelab's decoder (its paged cache); transformers' decoder "
                             "keeps its own cache: set decoder: auto, or prefix_caching: false")
        return self

    @model_validator(mode="after")
    def _eviction_needs_servelab_decoder(self) -> ServingConfig:
        if self.decoder == "transformers" and self.kv_cache.eviction != "none":
            raise ValueError(f"kv_cache.eviction {self.kv_cache.eviction!r} needs servelab's decoder (its paged cache); "
                             "transformers' decoder keeps its own cache: set decoder: auto, or eviction: none")
        return self

    @model_validator(mode="after")
    def _int8_cache_needs_servelab_decoder(self) -> ServingConfig:
        if self.decoder == "transformers" and self.kv_cache_dtype == "int8":
            raise ValueError("kv_cache_dtype 'int8' needs servelab's decoder (its paged cache); transformers' decoder "
                             "keeps its own cache in a float dtype: set decoder: auto, or kv_cache_dtype auto, fp32, "
                             "bf16 or fp16")
        return self

    @property
    def uses_prefix_caching(self) -> bool:
        """Whether prefix caching is asked: on unless set false, never under transformers' decoder."""
        return self.kv_cache.prefix_caching is not False and self.decoder != "transformers"

    @property
    def config_hash(self) -> str:
        """Content hash of everything that changes what is served; the name is only a label."""
        return hashlib.sha256(self.canonical_json(include_name=False).encode()).hexdigest()[:16]

    def canonical_json(self, *, include_name: bool = True) -> str:
        data = self.model_dump(mode="json", exclude=None if include_name else {"name"})
        if self.kv_cache.eviction == "none":  # NOTE: the window's sizes change nothing then: hashes stay as before
            for key in ("eviction", "sink_tokens", "window_tokens"):
                data["kv_cache"].pop(key)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "config") -> ServingConfig:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"{source}: " + describe_validation_error(exc)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServingConfig:
        path = Path(path)
        return cls.from_dict(read_yaml_mapping(path, "config", ConfigError), source=str(path))


def read_yaml_mapping(path: Path, kind: str, error: type[ValueError]) -> dict[str, Any]:
    """A YAML file holding one mapping, its `name` defaulting to the file's stem; bad files raise `error`."""
    if not path.is_file():
        raise error(f"{path}: no such {kind} file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    return {"name": path.stem, **data}


def describe_validation_error(exc: ValidationError, *,
                              unknown_hint: str = "check the spelling; see configs/ for the allowed fields") -> str:
    """One line per bad field: 'field.path: got VALUE; MESSAGE'; an unknown field with unknown_hint (where the
    allowed fields are: configs/ for a YAML file, the API reference for a request body)."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown field ({unknown_hint})")
        elif err["type"] == "missing":
            lines.append(f"{where}: required field is missing")
        else:
            lines.append(f"{where}: got {err.get('input')!r}; {msg}")
    return "; ".join(lines)
