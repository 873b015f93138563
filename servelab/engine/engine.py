"""The engine: serves requests with KV-cached decoding, one step at a time, rows joining and leaving.

A running batch lives in the engine between calls: `add(requests)` prefills newcomers (one forward for
the group, apart from the running rows) and joins them to the batch's cache; `step()` runs one decode
step for every live row. Both return each row's new token and the rows that finished, whose cache space
is free at once. `generate(requests)` is a closed batch: add, then step until every row has finished.
Knows tokenising, left-padded prefill groups, stop conditions, per-row timings, the log-probabilities a
row asked for, each constrained row's grammar matcher (structured output: grammar.py), and the memory of each stretch of steps (`take_stats`). Does not know queues, databases or
how rows were chosen: a bad request fails alone, its batch-mates carry on. Past 400 lines as one piece: the
running batch's rows and cache change together in add, step, preempt and cancel.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel

from servelab.config import ServingConfig
from servelab.engine import measure
from servelab.engine.arena import gather_on_huge_pages
from servelab.engine.blocks import BlockManager, OutOfBlocks
from servelab.engine.decoder import LlamaDecoder, PagedBatch, build_decoder, release_copied_weights
from servelab.engine.detokenize import Detokenizer, TokenBytes
from servelab.engine.kvcache import BatchKVCache, cache_bytes_per_element
from servelab.engine.kernels import load_blocked_kernel
from servelab.engine.linear import LABELS, LinearKernelError, check_linear_kernel
from servelab.engine.loader import DTYPES, LoadedModel, apply_threads, load_model, resolve_device
from servelab.memory import MemoryBreakdown
from servelab.outputs import (Alternative, BatchResult, BatchTimings, Completion, FinishReason, StepOutput,
                              TokenLogprobs, failed)
from servelab.resident import return_freed_memory
from servelab.request import GenerationRequest, RequestError, check_prompt_length
from servelab.engine.grammar import Grammars
from servelab.engine.sampling import Allowed, kernel_argmax, make_generator, read_logprobs, sample_next
from servelab.settings import Settings


@dataclass
class _Row:
    """Decoding state of one request while it is in the batch."""

    request: GenerationRequest
    prompt_ids: list[int]
    generator: torch.Generator | None
    detok: Detokenizer
    started: float = 0.0  # perf_counter when its prefill began; its times count from here
    started_at_s: float = 0.0  # the same instant, Unix time
    token_ids: list[int] = field(default_factory=list)
    token_times_ms: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprobs] | None = None  # a list when the request asked for them
    num_computed: int = 0  # paged: tokens (prompt, then generated) whose keys and values the cache holds
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at its first admission
    holds_blocks: bool = False  # paged: False while it waits for the pool (new, or preempted by the pool running out)
    matcher: Any = None  # structured output: its llguidance matcher, advanced with each token it takes
    error: str | None = None  # why it failed mid-answer (its grammar)

    def __post_init__(self) -> None:
        if self.request.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def num_columns(self) -> int:
        """Cache columns the row may hold by its end: prompt and every new token."""
        return len(self.prompt_ids) + self.request.params.max_new_tokens

    @property
    def tokens(self) -> list[int]:
        """Its sequence: the prompt, then the tokens generated (the last one not yet in the cache)."""
        return self.prompt_ids + self.token_ids

    @property
    def num_pending(self) -> int:
        """Tokens still to run through the model before its next token: 1 when it decodes."""
        return len(self.prompt_ids) + len(self.token_ids) - self.num_computed


@dataclass
class _Meter:
    """What a stretch of steps did, from the first add or step after `take_stats` to the next one."""

    peak: measure.PeakMemory
    started_at_s: float = field(default_factory=time.time)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    num_rows_per_step: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    peak_cache_tokens: int = 0
    peak_cache_allocated_bytes: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    kv_blocks_shared: int = 0
    kv_blocks_private: int = 0


class Engine:
    def __init__(self, loaded: LoadedModel, config: ServingConfig, *, cache_dir: Path = Path(".cache"),
                 settings: Settings | None = None) -> None:
        """With `settings`, a serving process keeps one copy of its weights: the linear layers servelab's decoder
        lays out for its kernels are emptied in transformers' model, and `model` loads a fresh copy where
        transformers' forward is needed (the quality lab, comparisons against `generate`)."""
        if getattr(loaded.model, "servelab_released", False):
            raise ValueError("this loaded model's weights were handed to another engine's decoder: load it again "
                             "(an engine keeps one copy of its weights and empties transformers' copies)")
        self.loaded = loaded
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.device = loaded.device
        self.eos_token_ids = _eos_token_ids(loaded)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.token_bytes = TokenBytes(self.tokenizer)
        self.kv_bytes_per_element = cache_bytes_per_element(config.kv_cache_dtype, loaded.dtype, loaded.shape.head_dim)
        self.decoder = build_decoder(loaded.model, choice=config.decoder, kv_cache_dtype=config.kv_cache_dtype,
                                     dtype=loaded.dtype, device=self.device, linear_kernel=config.linear_kernel,
                                     cache_dir=cache_dir, int4_kernel=config.awq.kernel if config.awq else "auto",
                                     int4_activations=config.awq.activations if config.awq else "int8",
                                     lm_head_weights=config.lm_head_weights)
        self._settings = settings
        self._reference: PreTrainedModel | None = None
        blocked = getattr(getattr(self.decoder, "kernel", None), "blocked", None)
        self._argmax = kernel_argmax(blocked.module) if blocked is not None and blocked.module is not None else None
        self.released_bytes = release_copied_weights(loaded.model, self.decoder) if settings is not None else 0
        if self.released_bytes:
            gc.collect()
            return_freed_memory()
        # NOTE: what the process holds: the model's remaining tensors and the decoder's layouts, shared storage once
        own = isinstance(self.decoder, LlamaDecoder)
        held = self.decoder.tensors() if own else []
        self.weight_bytes = measure.tensor_storage_bytes([*loaded.model.parameters(), *loaded.model.buffers(), *held])
        # what one decode step reads (the rooflines' bytes); transformers' forward: every weight but the embedding
        self.step_weight_bytes = (measure.tensor_storage_bytes(self.decoder.step_tensors()) if own
                                  else self.weight_bytes - measure.tensor_storage_bytes(
                                      [loaded.model.get_input_embeddings().weight]) * (not _tied(loaded.model)))
        # NOTE: after the byte figures (which count storages, not the arena): the weights a step streams move onto
        # huge pages, where the CPU's prefetcher is not stopped at every 4 KB
        self.arena = (gather_on_huge_pages(self.decoder.step_tensors(),
                                           sharing=[*loaded.model.parameters(), *loaded.model.buffers(), *held])
                      if own and self.device.type == "cpu" and settings is not None and settings.huge_pages else None)
        if self.arena is not None:
            gc.collect()
            return_freed_memory()
        self._grammars: Grammars | None = None  # compiled constraints, on the first constrained request
        self._rows: list[_Row] = []  # the running batch, in order of admission (transformers': row i of its cache)
        self._batch_cache: BatchKVCache | None = None
        self._meter: _Meter | None = None
        self.blocks: BlockManager | None = None
        if isinstance(self.decoder, LlamaDecoder):
            block_size = config.kv_cache.block_size
            self.blocks = BlockManager(pool_blocks(config, self.decoder.kv_bytes_per_block(block_size), block_size),
                                       block_size, prefix_caching=config.uses_prefix_caching,
                                       namespace=cache_namespace(config, loaded.dtype), window=kv_window(config),
                                       chunk_tokens=config.batching.max_prefill_tokens)
            self._paged = self.decoder.new_paged_cache(self.blocks)
        elif config.kv_cache.eviction != "none":
            raise ValueError(f"{config.name}: kv_cache.eviction {config.kv_cache.eviction!r} needs servelab's decoder (its "
                             f"paged cache), which does not cover this model ({self.decoder.name} decoder serves it): "
                             "set eviction: none")
        elif config.kv_cache.prefix_caching is True:
            raise ValueError(f"{config.name}: kv_cache.prefix_caching needs servelab's decoder (its paged cache), which "
                             f"does not cover this model ({self.decoder.name} decoder serves it): set prefix_caching: "
                             "false")

    @property
    def model(self) -> PreTrainedModel:
        """transformers' model with all its weights: the loaded one, or (when this engine emptied the layers its
        decoder copied) a fresh copy loaded on first use."""
        if not self.released_bytes:
            return self.loaded.model
        if self._reference is None:
            self._reference = load_model(self.config, self._settings).model
        return self._reference

    @property
    def kernel(self) -> str:
        """The decoder and the linear-layer kernel serving the weights, reported with every run."""
        if self.config.weights == "awq-int4" and getattr(self.decoder, "int4", None) is not None:
            linear = self.decoder.int4.label
        elif self.config.weights == "awq-int4":
            from servelab.engine.awq import kernel_name

            linear = kernel_name(self.loaded.model)
        else:
            kernel = self.decoder.kernel.label if self.decoder.name == "servelab" else LABELS["torch"]
            blocked = self.decoder.kernel.blocked if self.decoder.name == "servelab" else None
            if self.loaded.dtype == torch.bfloat16 and blocked is not None and "servelab" in self.decoder.kernel.kernels:
                kernel = f"{kernel}, {blocked.bf16_note()}"
            linear = f"dense {str(self.loaded.dtype).removeprefix('torch.')}, {kernel}"
        head = ", int8 output layer" if self.config.lm_head_weights == "int8" else ""
        return f"{self.decoder.name} decoder, {linear}{head}"

    @classmethod
    def from_config(cls, config: ServingConfig, settings: Settings) -> Engine:
        apply_threads(config, settings)
        check_configured_kernel(config, settings)
        return cls(load_model(config, settings), config, cache_dir=settings.cache_dir, settings=settings)

    # --- admission: text -> token ids, every limit checked per request, once ---

    def tokenize(self, request: GenerationRequest) -> GenerationRequest:
        """The request as a worker admits it: its prompt tokenised (the chat template applied), every limit
        checked, and a sampled request's seed drawn, so that it gives the same answer however often it is
        started (a preemption, a re-add). A request already tokenised comes back as it is: checked once."""
        if request.is_tokenized:
            return request
        prompt_ids = self.encode(request)
        params = request.params
        if not params.is_greedy and params.seed is None:
            params = replace(params, seed=random.getrandbits(63))
        return replace(request, prompt_token_ids=tuple(prompt_ids), params=params)

    def encode(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids, the request's limits checked (RequestError names the one that fails)."""
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
        vocab_size = self.loaded.shape.vocab_size
        if past := [t for t in request.params.stop_token_ids if t >= vocab_size]:
            # NOTE: checked here, where the vocabulary is known: an id past it would index past the logits
            raise RequestError(f"stop_token_ids holds {past}, past this model's vocabulary ({vocab_size} tokens: "
                               f"ids 0 to {vocab_size - 1})")
        return ids

    def _admit(self, requests: Sequence[GenerationRequest]) -> tuple[list[_Row], list[Completion]]:
        rows, rejected = [], []
        for request in requests:
            try:
                request = self.tokenize(request)
            except RequestError as exc:
                rejected.append(failed(request.request_id, str(exc)))
                continue
            try:
                matcher = self._matcher(request.params.constraint)
            except ValueError as exc:
                rejected.append(failed(request.request_id, f"response_format: the schema cannot be served: {exc}"))
                continue
            rows.append(_Row(request, list(request.prompt_token_ids), make_generator(request.params, self.device),
                             Detokenizer(self.tokenizer, request.params.stop,
                                         include_stop=request.params.include_stop_str_in_output,
                                         skip_special_tokens=request.params.skip_special_tokens), matcher=matcher))
        return rows, rejected

    def _matcher(self, constraint: str | None) -> Any:
        """A constrained row's own matcher (its constraint compiled once per engine, kept in an LRU); None: free."""
        if constraint is None:
            return None
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.loaded.shape.vocab_size, sorted(self.eos_token_ids))
        return self._grammars.matcher(constraint)

    # --- the running batch: add, step, preempt ---

    @property
    def live_request_ids(self) -> list[str]:
        return [r.request.request_id for r in self._rows]

    @property
    def num_live(self) -> int:
        return len(self._rows)

    @torch.inference_mode()
    def add(self, requests: Sequence[GenerationRequest]) -> StepOutput:
        """Newcomers join the batch. servelab's decoder: each takes the pool's blocks for its prompt (its cached
        prefix shared), and when no row is decoding their prefill starts at once (a prompt longer than the step's
        budget goes on in the next steps); transformers': prefilled whole and joined. The first tokens of rows
        whose prefill completed come back. A request that cannot be served (too long, bad parameters) finishes at
        once with an error."""
        rows, rejected = self._admit(requests)
        if not rows:
            return StepOutput((), tuple(rejected))
        started, started_at_s = time.perf_counter(), time.time()
        for row in rows:
            row.started, row.started_at_s = started, started_at_s
        if self.blocks is None:
            tokens, texts, finished = self._add_dense(rows)
            return StepOutput(tokens, (*finished, *rejected), texts)
        self._open_meter()
        decoding = any(r.holds_blocks and r.num_pending == 1 for r in self._rows)
        self._rows += rows
        self._take_blocks()
        if decoding:
            return StepOutput((), tuple(rejected))  # NOTE: rows decode: the newcomers' prefill joins the next step
        out = self._paged_pass(decode=False)
        return StepOutput(out.new_tokens, (*out.finished, *rejected), out.new_text)

    def _add_dense(self, rows: list[_Row]):
        meter = self._open_meter()
        logits, prefilled, mask = self._prefill(rows)
        self._cache.join(prefilled, mask, num_columns=max(r.num_columns for r in [*self._rows, *rows]),
                         max_rows=self.config.batching.max_batch_size)
        del prefilled
        self._rows += rows
        self._track_cache(meter)
        out = self._sample(logits, rows)
        meter.prefill_ms += (time.perf_counter() - rows[0].started) * 1e3
        meter.num_rows_per_step.append(len(rows))
        meter.num_prefill_tokens += mask.numel()
        return out

    @torch.inference_mode()
    def step(self) -> StepOutput:
        """One step: a decode step for every decoding row, and (servelab's decoder) the next prefill chunks of rows
        still prefilling, together within the step's token budget (max_prefill_tokens)."""
        if not self._rows:
            return StepOutput((), ())
        if self.blocks is not None:
            return self._paged_pass(decode=True)
        meter = self._open_meter()
        started = time.perf_counter()
        mask, positions = self._cache.next_inputs()
        last_ids = torch.tensor([r.token_ids[-1] for r in self._rows], dtype=torch.long, device=self.device)
        logits = self.decoder.forward(last_ids.view(-1, 1), mask, positions, self._cache)
        self._track_cache(meter)
        num_rows = len(self._rows)
        tokens, texts, finished = self._sample(logits, list(self._rows))
        meter.decode_ms += (time.perf_counter() - started) * 1e3
        meter.num_rows_per_step.append(num_rows)
        meter.num_decode_tokens += num_rows
        return StepOutput(tokens, finished, texts)

    # --- the paged cache: blocks, chunks, one forward per step ---

    def _take_blocks(self) -> None:
        """Rows waiting for the pool take their blocks, oldest first, while it has room (their cached prefix
        shared and counted)."""
        meter = self._open_meter()
        # NOTE: while rows run, each keeps a block in reserve for its next token, so a newcomer does not take the
        # block a running row needs next (and the pool's preemption rarely has to act)
        reserve = sum(r.holds_blocks for r in self._rows)
        prefix_caching = self.blocks.prefix_caching
        prefilling = [r for r in self._rows if r.holds_blocks and r.num_pending > 1] if prefix_caching else []
        for row in self._rows:
            if row.holds_blocks:
                continue
            tokens = row.tokens
            if any(self._waits_for_prefix(tokens, other) for other in prefilling):
                continue  # NOTE: it takes its blocks once they are computed and shared, not computed twice
            if self.blocks.blocks_to_admit(tokens) + reserve > self.blocks.num_free_blocks and reserve:
                return  # NOTE: in order: a younger row never overtakes an older one for the pool
            try:
                cached = self.blocks.allocate(row.request.request_id, tokens)
            except OutOfBlocks:
                return
            reserve += 1
            row.holds_blocks, row.num_computed = True, cached
            if prefix_caching and row.num_pending > 1:
                prefilling.append(row)
            if not row.token_ids:  # its first admission: what the prompt found is its cached_tokens
                row.num_cached_tokens = cached
                if self.blocks.prefix_caching:
                    meter.num_prefix_query_tokens += len(tokens)
                    meter.num_prefix_hit_tokens += cached

    def set_preemption_order(self, request_ids: Sequence[str]) -> None:
        """Which rows give their blocks back first when the pool runs out mid-decode (the scheduler's order: the
        newest bulk row first); rows not named go after them, newest first."""
        self._preemption_order = list(request_ids)

    def _pool_victim(self) -> _Row:
        holding = {r.request.request_id: r for r in self._rows if r.holds_blocks}
        named = [holding[i] for i in getattr(self, "_preemption_order", ()) if i in holding]
        return named[0] if named else next(r for r in reversed(self._rows) if r.holds_blocks)

    def _waits_for_prefix(self, tokens: list[int], other: _Row) -> bool:
        """Whether a newcomer starts with full blocks another row is still prefilling: it waits for them to be
        cached (a bulk job's lines sharing a system prompt admitted together prefill it once, not once each)."""
        bs = self.blocks.block_size
        limit = min(len(tokens) - 1, len(other.prompt_ids))
        common = next((i for i, (a, b) in enumerate(zip(tokens[:limit], other.prompt_ids[:limit])) if a != b), limit)
        return common >= bs and other.num_computed < common // bs * bs

    def _room_for_decode(self, decoding: list[_Row]) -> list[_Row]:
        """Each decoding row's next column has a block; when the pool runs out, the newest row holding blocks
        gives them back and waits (its tokens kept: it is prefilled again, prompt and generated tokens, when
        room returns, so nothing it released is released twice) -> the rows that still decode."""
        for row in list(decoding):
            if row.holds_blocks:  # NOTE: a window's middle blocks go back first: the row's next token no longer sees them
                self.blocks.evict(row.request.request_id, row.num_computed, cached_tokens=len(row.prompt_ids))
            while row.holds_blocks:
                try:
                    self.blocks.grow(row.request.request_id, row.num_computed + 1)
                    break
                except OutOfBlocks:
                    victim = self._pool_victim()
                    self._release(victim)
                    victim.holds_blocks, victim.num_computed = False, 0
                    self._open_meter().num_preempted += 1
        return [r for r in decoding if r.holds_blocks]

    def _window_chunks(self, chunks: list[tuple[_Row, int]], decoding: bool) -> list[tuple[_Row, int]]:
        """With a window, each chunk's row drops the blocks its first token no longer sees, then takes the blocks the
        chunk writes (admission took only the first chunks' blocks of a long prompt). Where the pool has too few, the
        chunk is cut to the blocks the row holds; with no row decoding, the newest row gives its blocks back (as a
        decode step does), so something always moves -> the chunks that run."""
        out = []
        for row, n in chunks:
            rid = row.request.request_id
            self.blocks.evict(rid, row.num_computed, cached_tokens=len(row.prompt_ids))
            while row.holds_blocks:
                try:
                    self.blocks.grow(rid, row.num_computed + n)
                    break
                except OutOfBlocks:
                    room = (len(self.blocks.table(rid)) + self.blocks.evicted(rid)) * self.blocks.block_size
                    if room > row.num_computed or decoding:
                        n = room - row.num_computed
                        break
                    victim = self._pool_victim()
                    self._release(victim)
                    victim.holds_blocks, victim.num_computed = False, 0
                    self._open_meter().num_preempted += 1
            if row.holds_blocks and n > 0:
                out.append((row, n))
        return [(r, n) for r, n in out if r.holds_blocks]  # NOTE: a row cut above may have been the pool's victim

    def _paged_pass(self, *, decode: bool) -> StepOutput:
        meter = self._open_meter()
        started = time.perf_counter()
        self._take_blocks()
        decoding = [r for r in self._rows if r.holds_blocks and r.num_pending == 1] if decode else []
        decoding = self._room_for_decode(decoding)
        self._take_blocks()
        budget = max(self.config.batching.max_prefill_tokens - len(decoding), 1)
        chunks: list[tuple[_Row, int]] = []
        for row in self._rows:
            if budget <= 0:
                break
            if row.holds_blocks and (row.num_pending > 1 or not decode):
                n = min(row.num_pending, budget)
                chunks.append((row, n))
                budget -= n
        if self.blocks.window is not None:
            chunks = self._window_chunks(chunks, bool(decoding))
        if not decoding and not chunks:
            return StepOutput((), ())
        held = {r.request.request_id: self.blocks.table(r.request.request_id) for r in self._rows if r.holds_blocks}
        tables = [held[r.request.request_id] for r in [*decoding, *(c for c, _ in chunks)]]
        evicted = {r.request.request_id: self.blocks.evicted(r.request.request_id) for r in [*decoding, *(c for c, _ in chunks)]}
        cap = self.blocks.row_cap or self.blocks.num_blocks
        growth = sum(max(0, min(self.blocks.blocks_for(r.num_columns), cap) - len(held[r.request.request_id]))
                     for r in self._rows if r.holds_blocks)
        self._paged.reach(tables, expected=self.blocks.num_used_blocks + growth)
        ids, positions, chunk_spans, logit_rows, sampled = [], [], [], [], []
        for i, row in enumerate(decoding):
            ids.append(row.token_ids[-1] if row.token_ids else row.prompt_ids[-1])
            positions.append(row.num_computed)
            logit_rows.append(i)
            sampled.append(row)
        for row, n in chunks:
            first = len(ids)
            ids += row.tokens[row.num_computed:row.num_computed + n]
            positions += range(row.num_computed, row.num_computed + n)
            chunk_spans.append((first, row.num_computed, n))
            if n == row.num_pending:  # its prefill completes: its last token's logits give its next token
                logit_rows.append(len(ids) - 1)
                sampled.append(row)
        bs = self.blocks.block_size
        # NOTE: a decode row's new key goes to the column after those it keeps (its evicted blocks' columns left out)
        lengths = [r.num_computed - evicted[r.request.request_id] * bs for r in decoding]
        window = self.blocks.window
        batch = PagedBatch(torch.tensor(ids, dtype=torch.long, device=self.device),
                           torch.tensor(positions, dtype=torch.long, device=self.device),
                           self._paged.table_tensor(tables), len(decoding), tuple(chunk_spans),
                           torch.tensor(logit_rows, dtype=torch.long, device=self.device),
                           lengths=torch.tensor(lengths, dtype=torch.long, device=self.device) if window else None,
                           window=window, chunk_evicted=tuple(evicted[r.request.request_id] for r, _ in chunks))
        logits = self.decoder.forward_paged(batch, self._paged)
        for row in decoding:
            row.num_computed += 1
        for row, n in chunks:
            row.num_computed += n
        for row in [*decoding, *(c for c, _ in chunks)]:
            self.blocks.commit(row.request.request_id, row.tokens[:row.num_computed])
        self._track_cache(meter)
        tokens, texts, finished = self._sample(logits, sampled) if sampled else ((), (), ())
        elapsed_ms = (time.perf_counter() - started) * 1e3
        num_chunk_tokens = sum(n for _, n in chunks)
        # NOTE: a mixed step's time is shared by its tokens: the chunks' part is prefill, the decode rows' decode
        prefill_share = num_chunk_tokens / (num_chunk_tokens + len(decoding))
        meter.prefill_ms += elapsed_ms * prefill_share
        meter.decode_ms += elapsed_ms * (1 - prefill_share)
        meter.num_rows_per_step.append(len(sampled))
        meter.num_prefill_tokens += num_chunk_tokens
        meter.num_decode_tokens += len(decoding)
        return StepOutput(tokens, finished, texts)

    @torch.inference_mode()
    def preempt(self, request_ids: Sequence[str]) -> list[GenerationRequest]:
        """Take rows out of the batch unfinished (their cache is dropped); -> their requests, which start
        over from the prompt when added again (same seed, so the same answer)."""
        wanted = set(request_ids)
        taken = [r.request for r in self._rows if r.request.request_id in wanted]
        if taken:
            self._open_meter().num_preempted += len(taken)
            self._keep([i for i, r in enumerate(self._rows) if r.request.request_id not in wanted])
        return taken

    @torch.inference_mode()
    def cancel(self, request_ids: Sequence[str]) -> list[Completion]:
        """Take rows out of the batch for good (their client left); -> their completions, finish reason
        `cancelled`, holding the text released so far (what a streaming client was shown)."""
        wanted = set(request_ids)
        taken = [r for r in self._rows if r.request.request_id in wanted]
        if taken:
            self._keep([i for i, r in enumerate(self._rows) if r.request.request_id not in wanted])
        for row in taken:
            row.finish_reason = FinishReason.CANCELLED
        return [self._complete(r, text=r.detok.text[:r.detok.released]) for r in taken]

    def take_stats(self) -> tuple[BatchTimings, MemoryBreakdown]:
        """The timings and memory of the steps since the last call; the next add or step starts a new stretch."""
        meter, self._meter = self._meter, None
        if meter is None:
            meter = _Meter(peak=measure.PeakMemory(self.device).__enter__())
        meter.peak.__exit__(None, None, None)
        timings = BatchTimings(
            prefill_ms=meter.prefill_ms, decode_ms=meter.decode_ms,
            num_rows_per_step=tuple(meter.num_rows_per_step), num_prefill_tokens=meter.num_prefill_tokens,
            num_decode_tokens=meter.num_decode_tokens, num_preempted=meter.num_preempted,
            started_at_s=meter.started_at_s, finished_at_s=time.time(),
            num_prefix_query_tokens=meter.num_prefix_query_tokens, num_prefix_hit_tokens=meter.num_prefix_hit_tokens,
        )
        memory = MemoryBreakdown(
            weight_bytes=self.weight_bytes,
            kv_cache_bytes=self.loaded.shape.kv_cache_bytes(meter.peak_cache_tokens, self.kv_bytes_per_element),
            kv_cache_allocated_bytes=meter.peak_cache_allocated_bytes,
            peak_working_bytes=meter.peak.working_bytes,
            peak_process_bytes=meter.peak.peak_bytes,
            device=str(self.device),
            kv_cache_tokens=meter.peak_cache_tokens,
            kv_block_size=self.blocks.block_size if self.blocks is not None else 0,
            kv_blocks_shared=meter.kv_blocks_shared, kv_blocks_private=meter.kv_blocks_private,
        )
        return timings, memory

    def generate(self, requests: Sequence[GenerationRequest]) -> BatchResult:
        """A closed batch: every request added at once, stepped until the last row finishes."""
        if self._rows:
            raise RuntimeError("generate serves a closed batch; this engine has rows running")
        self.take_stats()  # NOTE: the batch's figures start here
        done = {c.request_id: c for c in self.add(requests).finished}
        while self._rows:
            done.update((c.request_id, c) for c in self.step().finished)
        timings, memory = self.take_stats()
        return BatchResult(completions=tuple(done[r.request_id] for r in requests), timings=timings, memory=memory)

    # --- prefill and sampling ---

    def _prefill(self, rows: list[_Row]) -> tuple[torch.Tensor, object, torch.Tensor]:
        """One forward over the newcomers, left-padded to the longest prompt, in a cache of their own."""
        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # NOTE: left padding keeps every row's last token in the last column
            input_ids[i, width - len(row.prompt_ids):] = torch.tensor(row.prompt_ids)
            attention_mask[i, width - len(row.prompt_ids):] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (B, T)
        prefilled = self.decoder.new_cache(len(rows), width)
        logits = self.decoder.forward(input_ids, attention_mask, position_ids, prefilled)
        return logits, prefilled, attention_mask  # logits (B, V)

    def _sample(self, logits: torch.Tensor, rows: list[_Row]
                ) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[str, int, str], ...], tuple[Completion, ...]]:
        """A token for each of these rows (logits row i is rows[i]'s), the text each released, and the rows that
        finished (they leave)."""
        # NOTE: fp32 holds bf16 logits exactly; torch's argmax over bf16 is 5x slower than over fp32 on CPU
        logits = logits.float()
        next_ids = sample_next(logits, [r.request.params for r in rows], [r.generator for r in rows],
                               [r.token_ids for r in rows], [r.prompt_ids for r in rows],
                               [self._suppressed(r) for r in rows], _allowed(rows, logits.shape[-1]), argmax=self._argmax)
        read = self._read_logprobs(logits, next_ids, rows)
        now = time.perf_counter()
        tokens, texts, finished = [], [], []
        for j, (row, token_id) in enumerate(zip(rows, next_ids.tolist())):
            tokens.append((row.request.request_id, token_id))
            if j in read:  # NOTE: before the token's text joins the row's: its offset is the text so far
                row.logprobs.append(self._token_logprobs(token_id, len(row.detok.text), *read[j]))
            going_on = self._append_token(row, token_id, (now - row.started) * 1e3)
            at = row.detok.released
            piece = row.detok.release() if going_on else row.detok.finish()
            if piece:
                texts.append((row.request.request_id, at, piece))
            if not going_on:
                finished.append(row)
        if finished:
            done = {id(r) for r in finished}
            self._keep([i for i, r in enumerate(self._rows) if id(r) not in done])
        return tuple(tokens), tuple(texts), tuple(self._complete(r) for r in finished)

    @staticmethod
    def _read_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, rows: list[_Row]
                       ) -> dict[int, tuple[float, list[tuple[int, float]]]]:
        """{index in rows: (chosen token's log-probability, [(token, log-probability)] most likely first)} for
        the rows that asked; nothing is computed when none did."""
        asked = [j for j, r in enumerate(rows) if r.logprobs is not None]
        if not asked:
            return {}
        num_top = [rows[j].request.params.logprobs for j in asked]
        return dict(zip(asked, read_logprobs(logits, next_ids, asked, num_top)))

    def _token_logprobs(self, token_id: int, text_offset: int, logprob: float, top: list[tuple[int, float]]
                        ) -> TokenLogprobs:
        return TokenLogprobs(Alternative(token_id, self.token_bytes(token_id), logprob), text_offset,
                             tuple(Alternative(i, self.token_bytes(i), lp) for i, lp in top))

    def _keep(self, indices: list[int]) -> None:
        kept = {id(self._rows[i]) for i in indices}
        if self.blocks is not None:
            for row in self._rows:
                if id(row) not in kept:
                    self._release(row)
            self._rows = [self._rows[i] for i in indices]
            return
        self._rows = [self._rows[i] for i in indices]
        self._cache.keep(indices)

    def _release(self, row: _Row) -> None:
        """A paged row's blocks go back to the pool (its full prompt blocks stay cached until evicted)."""
        if row.holds_blocks:
            self.blocks.free(row.request.request_id)
            row.holds_blocks = False

    # --- bookkeeping ---

    @property
    def _cache(self) -> BatchKVCache:
        if self._batch_cache is None:
            self._batch_cache = self.decoder.new_batch_cache()
        return self._batch_cache

    def _open_meter(self) -> _Meter:
        if self._meter is None:
            self._meter = _Meter(peak=measure.PeakMemory(self.device).__enter__())
        return self._meter

    def _append_token(self, row: _Row, token_id: int, now_ms: float) -> bool:
        """Record a token; returns whether the row goes on decoding. As vLLM: nothing but max_new_tokens ends a row
        before min_tokens; a stop token (EOS unless ignore_eos, stop_token_ids) ends it, its text left out unless
        include_stop_str_in_output."""
        params = row.request.params
        row.token_ids.append(token_id)
        row.token_times_ms.append(now_ms)
        can_stop = len(row.token_ids) >= params.min_tokens
        is_stop_token = can_stop and ((token_id in self.eos_token_ids and not params.ignore_eos)
                                      or token_id in params.stop_token_ids)
        # NOTE: a constrained row's grammar takes its token; a complete grammar (the JSON closed) ends the row
        grammar_done = False
        if row.matcher is not None and not is_stop_token:
            if not row.matcher.consume_token(token_id):  # NOTE: the mask allowed it; a grammar's failure is reported
                row.finish_reason, row.error = FinishReason.ERROR, f"structured output: {row.matcher.get_error()}"
                return False
            grammar_done = row.matcher.is_stopped()
        hit_stop_string = (row.detok.push(token_id, can_stop=can_stop)
                           if not is_stop_token or params.include_stop_str_in_output else False)
        if is_stop_token or hit_stop_string or grammar_done:
            row.finish_reason = FinishReason.STOP
        elif len(row.token_ids) >= params.max_new_tokens:
            row.finish_reason = FinishReason.LENGTH
        return row.finish_reason is None

    def _suppressed(self, row: _Row) -> tuple[int, ...]:
        """The tokens a row may not pick at its next step: before min_tokens, its stop tokens (vLLM's min_tokens)."""
        params = row.request.params
        if len(row.token_ids) >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        return (*eos, *params.stop_token_ids)

    def _track_cache(self, meter: _Meter) -> None:
        """After a forward, before rows leave: the cache at its fullest for this step. Paged: the blocks rows hold,
        a shared block once (their columns, partly filled last blocks included: that memory is taken)."""
        if self.blocks is not None:
            num_tokens = self.blocks.num_used_blocks * self.blocks.block_size
            allocated = self._paged.allocated_bytes
        else:
            num_tokens, allocated = self._cache.num_tokens, self._cache.allocated_bytes
        if num_tokens > meter.peak_cache_tokens:
            meter.peak_cache_tokens = num_tokens
            if self.blocks is not None:
                meter.kv_blocks_shared = self.blocks.num_shared_blocks
                meter.kv_blocks_private = self.blocks.num_used_blocks - meter.kv_blocks_shared
        meter.peak_cache_allocated_bytes = max(meter.peak_cache_allocated_bytes, allocated)

    def _complete(self, row: _Row, *, text: str | None = None) -> Completion:
        return Completion(
            request_id=row.request.request_id,
            text=row.detok.final_text if text is None else text,
            token_ids=tuple(row.token_ids),
            num_prompt_tokens=len(row.prompt_ids),
            finish_reason=row.finish_reason,
            seed=row.request.params.seed,
            ttft_ms=row.token_times_ms[0],
            token_times_ms=tuple(row.token_times_ms),
            e2e_ms=row.token_times_ms[-1],
            started_at_s=row.started_at_s,
            logprobs=None if row.logprobs is None else tuple(row.logprobs),
            num_cached_tokens=row.num_cached_tokens,
            error=row.error,
        )


def _allowed(rows: list[_Row], vocab_size: int) -> Allowed | None:
    """The tokens each constrained row's grammar allows next (llguidance's bitmask); None when no row is."""
    constrained = [j for j, r in enumerate(rows) if r.matcher is not None]
    if not constrained:
        return None
    bitmask = torch.zeros((len(constrained), (vocab_size + 31) // 32), dtype=torch.int32)
    for k, j in enumerate(constrained):
        matcher = rows[j].matcher
        matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), bitmask.shape[1] * 4)
        if matcher.is_error() or not bitmask[k].any():
            # NOTE: a grammar that failed (a lexer past llguidance's limits) allows nothing: the row picks freely,
            # its matcher refuses the token, and the row alone ends with the grammar's error (never a NaN draw)
            bitmask[k] = -1
    return Allowed(constrained, bitmask)


def pool_blocks(config: ServingConfig, block_bytes: int, block_size: int) -> int:
    """The paged cache's blocks: max_kv_cache_mib of them, else max_batch_tokens' worth; never fewer than one
    request of max_context_tokens needs (a lone request is always served)."""
    batching = config.batching
    tokens = batching.max_batch_tokens
    blocks = -(-tokens // block_size)
    if batching.max_kv_cache_mib is not None:
        blocks = min(blocks, batching.max_kv_cache_mib * 2**20 // block_bytes)
    lone = -(-config.decoding.max_context_tokens // block_size)
    if (window := kv_window(config)) is not None:  # a windowed row holds no more than its sinks, window and a chunk
        lone = min(lone, window[0] + window[1] + 2 + -(-batching.max_prefill_tokens // block_size))
    return max(blocks, lone)


def cache_namespace(config: ServingConfig, dtype: torch.dtype) -> str:
    """What changes the keys and values a block holds besides its tokens: the model, its weights (precision,
    quantisation), the compute dtype, the cache precision, the decoder and (a window changes what every later token
    attends to) the eviction window. Prefix-cache hashes start from it."""
    awq = config.awq.model_dump_json() if config.awq is not None else ""
    window = kv_window(config)
    return "|".join((config.model, config.weights, awq, str(dtype), config.kv_cache_dtype, config.decoder,
                     config.linear_kernel, config.lm_head_weights, str(config.kv_cache.block_size),
                     *((f"window {window[0]}+{window[1]}",) if window else ())))


def kv_window(config: ServingConfig) -> tuple[int, int] | None:
    """(sink blocks, window blocks) a row keeps under kv_cache.eviction: window; None: every block."""
    kv = config.kv_cache
    return (kv.sink_blocks, kv.window_blocks) if kv.eviction == "window" else None


def _eos_token_ids(loaded: LoadedModel) -> set[int]:
    ids = loaded.model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if loaded.tokenizer.eos_token_id is not None:
        ids.add(loaded.tokenizer.eos_token_id)
    return ids


def _tied(model: PreTrainedModel) -> bool:
    """Whether the output layer reads the embedding matrix (tied weights)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def check_configured_kernel(config: ServingConfig, settings: Settings) -> None:
    """A linear kernel or an int8 output layer named in the config that cannot run on this machine is refused before
    the model loads."""
    device = resolve_device(config.device)
    if config.lm_head_weights == "int8":
        reason = ("it needs servelab's decoder (decoder: transformers)" if config.decoder != "auto"
                  else f"servelab's int8 kernel is for CPUs (device {device})" if device.type != "cpu"
                  else load_blocked_kernel(settings.cache_dir).reason or None)
        if reason:
            raise LinearKernelError(f"{config.name}: lm_head_weights 'int8' cannot run here: {reason}")
    if config.decoder != "auto" or config.linear_kernel == "auto":
        return
    if config.weights == "awq-int4":
        from servelab.engine.awq import serving_dtype

        dtype = serving_dtype(device)  # the dtype around the int4 layers: the output layer's
    else:
        dtype = DTYPES[config.weights]
    try:
        check_linear_kernel(config.linear_kernel, device=device, dtype=dtype, cache_dir=settings.cache_dir)
    except LinearKernelError as exc:
        raise LinearKernelError(f"{config.name}: {exc}") from None
