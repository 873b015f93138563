"""The engine: serves a batch of requests with KV-cached decoding, prefill and decode kept apart.

Knows tokenising, left-padded batches (attention mask, per-row positions), the decode loop in which
finished rows leave the batch and its cache, stop conditions, timings and memory. Does not know
queues, databases or how a batch was formed: a bad request fails alone, its batch-mates carry on.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch
from servelab.config import ServingConfig
from servelab.engine import measure
from servelab.engine.decoder import build_decoder
from servelab.engine.kvcache import KVCache, cache_bytes_per_element
from servelab.engine.linear import LABELS, LinearKernelError, check_linear_kernel
from servelab.engine.loader import DTYPES, LoadedModel, apply_threads, load_model, resolve_device
from servelab.engine.memory import MemoryBreakdown
from servelab.engine.outputs import BatchResult, BatchTimings, Completion, FinishReason, failed
from servelab.request import GenerationRequest, RequestError, check_prompt_length
from servelab.engine.sampling import make_generator, sample_next
from servelab.settings import Settings


@dataclass
class _Row:
    """Decoding state of one request while its batch runs."""

    request: GenerationRequest
    prompt_ids: list[int]
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    token_times_ms: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    text: str | None = None  # set when a stop string ended the row


@dataclass
class _Batch:
    """The tensors that travel between decode steps; rows[i] owns row i of every tensor."""

    rows: list[_Row]
    cache: KVCache
    attention_mask: torch.Tensor  # (B, T_cache + 1 after the step's token is appended)
    positions: torch.Tensor  # (B,) position of each row's last token
    peak_cache_tokens: int = 0
    peak_cache_allocated_bytes: int = 0


class Engine:
    def __init__(self, loaded: LoadedModel, config: ServingConfig, *, cache_dir: Path = Path(".cache")) -> None:
        self.loaded = loaded
        self.config = config
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.eos_token_ids = _eos_token_ids(loaded)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.weight_bytes = measure.weight_bytes(self.model)
        self.kv_bytes_per_element = cache_bytes_per_element(config.kv_cache_dtype, loaded.dtype)
        self.decoder = build_decoder(self.model, choice=config.decoder, kv_cache_dtype=config.kv_cache_dtype,
                                     dtype=loaded.dtype, device=self.device, linear_kernel=config.linear_kernel,
                                     cache_dir=cache_dir)

    @property
    def kernel(self) -> str:
        """The decoder and the linear-layer kernel serving the weights, reported with every run."""
        if self.config.weights == "awq-int4":
            from servelab.engine.awq import kernel_name

            linear = kernel_name(self.model)
        else:
            kernel = self.decoder.kernel.label if self.decoder.name == "servelab" else LABELS["torch"]
            linear = f"dense {str(self.loaded.dtype).removeprefix('torch.')}, {kernel}"
        return f"{self.decoder.name} decoder, {linear}"

    @classmethod
    def from_config(cls, config: ServingConfig, settings: Settings) -> Engine:
        apply_threads(config, settings)
        check_configured_kernel(config, settings)
        return cls(load_model(config, settings), config, cache_dir=settings.cache_dir)

    # --- admission: text -> token ids, every limit checked per request ---

    def encode(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            if not request.messages:
                raise RequestError("messages is empty: give at least one message")
            chat = [{"role": m.role, "content": m.content} for m in request.messages]
            ids = self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=False)
        request.params.check(self.config.decoding)
        check_prompt_length(len(ids), request.params, self.config.decoding)
        return ids

    def _admit(self, requests: Sequence[GenerationRequest]) -> tuple[list[_Row], list[Completion]]:
        rows, rejected = [], []
        for request in requests:
            try:
                prompt_ids = self.encode(request)
            except RequestError as exc:
                rejected.append(failed(request.request_id, str(exc)))
                continue
            if not request.params.is_greedy and request.params.seed is None:
                request = replace(request, params=replace(request.params, seed=random.getrandbits(63)))
            rows.append(_Row(request, prompt_ids, make_generator(request.params, self.device)))
        return rows, rejected

    # --- the serving step ---

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest]) -> BatchResult:
        rows, rejected = self._admit(requests)
        with measure.PeakMemory(self.device) as peak:
            started = time.perf_counter()
            batch, logits = self._prefill(rows) if rows else (None, None)
            prefill_done = time.perf_counter()
            num_rows_per_step = self._decode_loop(batch, logits, started) if rows else []
            finished = time.perf_counter()
        by_id = {c.request_id: c for c in [*(self._complete(r, started) for r in rows), *rejected]}
        timings = BatchTimings(
            prefill_ms=(prefill_done - started) * 1e3,
            decode_ms=(finished - prefill_done) * 1e3,
            num_rows_per_step=tuple(num_rows_per_step),
            num_prefill_tokens=len(rows) * max((len(r.prompt_ids) for r in rows), default=0),
            num_decode_tokens=sum(num_rows_per_step[1:]),
        )
        return BatchResult(
            completions=tuple(by_id[r.request_id] for r in requests),
            timings=timings,
            memory=self._memory(batch, peak),
        )

    def _decode_loop(self, batch: _Batch, logits: torch.Tensor, started: float) -> list[int]:
        """Sample for every live row, retire finished rows, run one cached step; until none is left."""
        num_rows_per_step = []
        while batch.rows:
            num_rows_per_step.append(len(batch.rows))
            next_ids = sample_next(logits, [r.request.params for r in batch.rows], [r.generator for r in batch.rows])
            now_ms = (time.perf_counter() - started) * 1e3
            is_live = [self._append_token(row, int(t), now_ms) for row, t in zip(batch.rows, next_ids.tolist())]
            if not all(is_live):
                next_ids = self._retire(batch, is_live, next_ids)
            if batch.rows:
                logits = self._decode_step(batch, next_ids)
        return num_rows_per_step

    # --- prefill and decode: the only two places the model runs ---

    def _prefill(self, rows: list[_Row]) -> tuple[_Batch, torch.Tensor]:
        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # NOTE: left padding keeps every row's last token in the last column
            input_ids[i, width - len(row.prompt_ids):] = torch.tensor(row.prompt_ids)
            attention_mask[i, width - len(row.prompt_ids):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
        # NOTE: a row's last sampled token is never fed back, so this capacity always suffices.
        capacity = width + max(r.request.params.max_new_tokens for r in rows)
        cache = self.decoder.new_cache(len(rows), capacity)
        logits = self.decoder.forward(input_ids, attention_mask, position_ids, cache)
        batch = _Batch(rows, cache, attention_mask, position_ids[:, -1])
        self._track_cache(batch)
        return batch, logits  # (B, V)

    def _decode_step(self, batch: _Batch, next_ids: torch.Tensor) -> torch.Tensor:
        ones = batch.attention_mask.new_ones((len(batch.rows), 1))
        batch.attention_mask = torch.cat([batch.attention_mask, ones], dim=-1)  # (B, T + 1)
        batch.positions = batch.positions + 1
        logits = self.decoder.forward(next_ids.view(-1, 1).to(self.device), batch.attention_mask,
                                      batch.positions.view(-1, 1), batch.cache)
        self._track_cache(batch)
        return logits  # (B, V)

    # --- bookkeeping ---

    def _append_token(self, row: _Row, token_id: int, now_ms: float) -> bool:
        """Record a token; returns whether the row goes on decoding."""
        row.token_ids.append(token_id)
        row.token_times_ms.append(now_ms)
        if token_id in self.eos_token_ids and not row.request.params.ignore_eos:
            row.finish_reason = FinishReason.STOP
        elif row.request.params.stop and self._hit_stop_string(row):
            row.finish_reason = FinishReason.STOP
        elif len(row.token_ids) >= row.request.params.max_new_tokens:
            row.finish_reason = FinishReason.LENGTH
        return row.finish_reason is None

    def _hit_stop_string(self, row: _Row) -> bool:
        text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in row.request.params.stop if s in text]
        if cuts:
            row.text = text[: min(cuts)]
        return bool(cuts)

    def _retire(self, batch: _Batch, is_live: list[bool], next_ids: torch.Tensor) -> torch.Tensor:
        """Drop finished rows from every batch tensor and the cache, then trim all-padding columns."""
        keep = torch.tensor([i for i, live in enumerate(is_live) if live], dtype=torch.long)
        batch.rows = [r for r, live in zip(batch.rows, is_live) if live]
        if not batch.rows:
            return next_ids[:0]
        keep_dev = keep.to(self.device)
        batch.cache.select_rows(keep_dev)
        batch.attention_mask = batch.attention_mask[keep_dev]
        batch.positions = batch.positions[keep_dev]
        num_pad_columns = int(batch.attention_mask.any(dim=0).int().argmax())  # leading columns no row uses
        if num_pad_columns:
            batch.attention_mask = batch.attention_mask[:, num_pad_columns:]
            batch.cache.drop_leading_columns(num_pad_columns)
        return next_ids[keep_dev]

    def _track_cache(self, batch: _Batch) -> None:
        num_tokens = len(batch.rows) * batch.cache.num_columns
        if num_tokens > batch.peak_cache_tokens:
            # NOTE: allocation peaks with the tokens (transformers' cache) or is largest at prefill (servelab's)
            batch.peak_cache_tokens = num_tokens
            batch.peak_cache_allocated_bytes = max(batch.peak_cache_allocated_bytes, batch.cache.allocated_bytes)

    def _complete(self, row: _Row, started: float) -> Completion:
        text = row.text
        if text is None:
            text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        return Completion(
            request_id=row.request.request_id,
            text=text,
            token_ids=tuple(row.token_ids),
            num_prompt_tokens=len(row.prompt_ids),
            finish_reason=row.finish_reason,
            seed=row.request.params.seed,
            ttft_ms=row.token_times_ms[0],
            token_times_ms=tuple(row.token_times_ms),
            e2e_ms=row.token_times_ms[-1],
        )

    def _memory(self, batch: _Batch | None, peak: measure.PeakMemory) -> MemoryBreakdown:
        peak_tokens = batch.peak_cache_tokens if batch else 0
        return MemoryBreakdown(
            weight_bytes=self.weight_bytes,
            kv_cache_bytes=self.loaded.shape.kv_cache_bytes(peak_tokens, self.kv_bytes_per_element),
            kv_cache_allocated_bytes=batch.peak_cache_allocated_bytes if batch else 0,
            peak_working_bytes=peak.working_bytes,
            peak_process_bytes=peak.peak_bytes,
            device=str(self.device),
        )


def _eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids = loaded.model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return ids


def check_configured_kernel(config: ServingConfig, settings: Settings) -> None:
    """A linear kernel named in the config that cannot run on this machine is refused before the model loads."""
    if config.decoder != "auto" or config.linear_kernel == "auto":
        return
    device = resolve_device(config.device)
    if config.weights == "awq-int4":
        from servelab.engine.awq import serving_dtype

        dtype = serving_dtype(device)  # the dtype around the int4 layers: the output layer's
    else:
        dtype = DTYPES[config.weights]
    try:
        check_linear_kernel(config.linear_kernel, device=device, dtype=dtype, cache_dir=settings.cache_dir)
    except LinearKernelError as exc:
        raise LinearKernelError(f"{config.name}: {exc}") from None
