"""The engine: one model loaded for serving, its runner, and admission's tokenising.

An Engine loads a model once, builds the decoder that serves it (servelab's, or transformers' forward where servelab's
does not cover the model) and the runner that executes a scheduler's plans on it (runner.py: `PagedRunner`;
dense_runner.py: `TransformersRunner`). `tokenize` is admission's one pass over a request (its prompt tokenised, every
limit checked, its seed drawn). A worker drives the runner with its own Scheduler; for everyone else (the lab, the
benchmarks, the tests) `add`, `step` and `generate` drive it with a Scheduler of the engine's own, the same class and
the same decisions, with no batch-size limit. Does not know queues or databases: a bad request fails alone.
"""

from __future__ import annotations

import gc
import logging
import random
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch
from transformers import PreTrainedModel

from servelab.config import ServingConfig
from servelab.engine import measure
from servelab.engine.arena import gather_on_huge_pages
from servelab.engine.decoder import LlamaDecoder, build_decoder, release_copied_weights, unsupported_reason
from servelab.engine.decoding import Decodings
from servelab.engine.model_files import ModelLoadError
from servelab.engine.dense_runner import TransformersRunner
from servelab.engine.kvcache import cache_bytes_per_element
from servelab.engine.kernels import load_blocked_kernel
from servelab.engine.linear import LABELS, LinearKernelError, check_linear_kernel
from servelab.engine.paged_attention import PagedAttentionError, config_reason, flex_pool_blocks
from servelab.engine.loader import DTYPES, LoadedModel, apply_threads, load_model, resolve_device
from servelab.engine.runner import PagedRunner, Runner
from servelab.engine.sampling import kernel_argmax
from servelab.memory import DEFAULT_GPU_MEMORY_SHARE, MemoryBreakdown, kv_window, pool_blocks
from servelab.outputs import BatchResult, BatchTimings, Completion, StepOutput, failed
from servelab.resident import return_freed_memory
from servelab.request import GenerationRequest, RequestError, check_prompt_length
from servelab.scheduler.blocks import BlockManager
from servelab.scheduler.policy import BatchPolicy
from servelab.scheduler.scheduler import Scheduler
from servelab.scheduler.state import ScheduledRequest
from servelab.settings import Settings

log = logging.getLogger(__name__)

UNLIMITED = 1 << 62
# What a model served by transformers' forward goes without: the features of servelab's decoder and its paged cache
WITHOUT_SERVELAB_DECODER = ("paged KV cache", "prefix caching", "int8 KV cache", "window eviction", "chunked prefill",
                            "int8 output layer")


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
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.kv_bytes_per_element = cache_bytes_per_element(config.kv_cache_dtype, loaded.dtype, loaded.shape.head_dim)
        self.decoder = build_decoder(loaded.model, choice=config.decoder, kv_cache_dtype=config.kv_cache_dtype,
                                     dtype=loaded.dtype, device=self.device, linear_kernel=config.linear_kernel,
                                     cache_dir=cache_dir, int4_kernel=config.awq.kernel if config.awq else "auto",
                                     int4_activations=config.awq.activations if config.awq else "int8",
                                     lm_head_weights=config.lm_head_weights,
                                     paged_attention=config.paged_attention,
                                     kv_block_size=config.kv_cache.block_size,
                                     max_context_tokens=config.decoding.max_context_tokens)
        if isinstance(self.decoder, LlamaDecoder) and config.decoding.max_context_tokens > self.decoder.cos.shape[0]:
            # NOTE: refused here, not at the step a row reaches past the rotary tables (a batch's step would fail)
            raise ModelLoadError(
                f"config {config.name!r}: decoding.max_context_tokens is {config.decoding.max_context_tokens}, past the "
                f"{self.decoder.cos.shape[0]} positions servelab's decoder serves for this model "
                f"({self.decoder.positions_reason}): set it to at most {self.decoder.cos.shape[0]}, or decoder: "
                "transformers")
        self._settings = settings
        self._reference: PreTrainedModel | None = None
        blocked = getattr(getattr(self.decoder, "kernel", None), "blocked", None)
        argmax = kernel_argmax(blocked.module) if blocked is not None and blocked.module is not None else None
        self.decodings = Decodings(self.tokenizer, vocab_size=loaded.shape.vocab_size, eos_token_ids=_eos_token_ids(loaded),
                                   device=self.device, argmax=argmax)
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
        figures = dict(shape=loaded.shape, kv_bytes_per_element=self.kv_bytes_per_element,
                       weight_bytes=self.weight_bytes, device=self.device)
        self.runner: Runner
        self.kv_pool_blocks = 0  # the paged pool's blocks (0: not paged): pool_blocks
        if own:
            block_size = config.kv_cache.block_size
            self.kv_pool_blocks = pool_blocks(
                config, self.decoder.kv_bytes_per_block(block_size), block_size, device_memory=device_memory(self.device),
                memory_share=settings.gpu_memory_share if settings is not None else DEFAULT_GPU_MEMORY_SHARE)
            if self.device.type == "cuda" and self.decoder.paged_attention == "flex":
                # NOTE: a pool sized from a large GPU's free memory could pass FlexAttention's 32-bit key offsets
                most = flex_pool_blocks(block_size=block_size, num_kv_heads=self.decoder.num_kv_heads,
                                        head_dim=self.decoder.head_dim) - 1  # and the scratch block
                if self.kv_pool_blocks > most:
                    log.info("KV pool capped at %d blocks (from %d): FlexAttention's key offsets are 32-bit", most,
                             self.kv_pool_blocks)
                    self.kv_pool_blocks = most
            # NOTE: the runner replays graphs only of steps FlexAttention serves (PagedRunner._graphs_for)
            self.runner = PagedRunner(self.decoder, self.decodings, block_size=block_size,
                                      num_blocks=self.kv_pool_blocks,
                                      graph_rows=config.cuda_graph_rows if self.device.type == "cuda" else 0, **figures)
        else:
            self.runner = TransformersRunner(self.decoder, self.decodings, pad_token_id=self.pad_token_id,
                                             max_batch_size=config.batching.max_batch_size, **figures)
        self._scheduler: Scheduler | None = None  # the engine's own, for add / step / generate
        if not own and config.kv_cache.eviction != "none":
            raise ValueError(f"{config.name}: kv_cache.eviction {config.kv_cache.eviction!r} needs servelab's decoder (its "
                             f"paged cache), which does not cover this model ({self.decoder.name} decoder serves it): "
                             "set eviction: none")
        if not own and config.kv_cache.prefix_caching is True:
            raise ValueError(f"{config.name}: kv_cache.prefix_caching needs servelab's decoder (its paged cache), which "
                             f"does not cover this model ({self.decoder.name} decoder serves it): set prefix_caching: "
                             "false")

    @property
    def eos_token_ids(self) -> set[int]:
        """The tokens that end a row (unless ignore_eos): the model's generation config's and its tokenizer's."""
        return self.decodings.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.decodings.eos_token_ids = ids

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
        # NOTE: how the pool is read, where it is not a CPU's default (servelab's fused kernels)
        attention = getattr(self.decoder, "paged_attention", "servelab")
        shown = attention != "servelab" and (self.device.type != "cpu" or self.config.paged_attention != "auto")
        return f"{self.decoder.name} decoder, {linear}{head}" + (f", {attention} paged attention" if shown else "")

    @property
    def decoder_reason(self) -> str | None:
        """Why transformers' forward, not servelab's decoder, serves this model, and what that costs; None where
        servelab's decoder serves it. A worker registers it beside its kernel label."""
        if self.decoder.name == "servelab":
            return None
        reason = unsupported_reason(self.loaded.model)
        why = (f"servelab's decoder does not cover this model: {reason}" if reason
               else "the config sets decoder: transformers")
        return f"{why}; so {', '.join('no ' + feature for feature in WITHOUT_SERVELAB_DECODER)}"

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
        try:  # NOTE: compiled once here (kept in an LRU), so a schema that cannot be served fails before it is scheduled
            self.decodings.matcher(params.constraint)
        except ValueError as exc:
            raise RequestError(f"response_format: the schema cannot be served: {exc}") from None
        return replace(request, prompt_token_ids=tuple(prompt_ids), params=params)

    def encode(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids, the request's limits checked (RequestError names the one that fails)."""
        if request.messages is not None:
            if not request.messages:
                raise RequestError("messages is empty: give at least one message")
            if not self.tokenizer.chat_template:  # NOTE: the model's own template only; servelab has none
                raise RequestError(f"this model's tokenizer has no chat template ({self.loaded.folder}): send a "
                                   "prompt instead of messages")
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

    # --- the scheduler a worker builds, and the engine's own ---

    def new_kv_pool(self) -> BlockManager | None:
        """A fresh pool of this engine's paged cache for a scheduler to own (None: the runner is not paged): its size
        is what this engine's memory holds for the config."""
        if not self.kv_pool_blocks:
            return None
        config = self.config
        return BlockManager(self.kv_pool_blocks, config.kv_cache.block_size, prefix_caching=config.uses_prefix_caching,
                            namespace=cache_namespace(config, self.loaded.dtype), window=kv_window(config),
                            chunk_tokens=config.batching.max_prefill_tokens)

    @property
    def scheduler(self) -> Scheduler:
        """The engine's own scheduler (add, step, generate): continuous, no batch-size limit, the config's pool and
        prefill budget (without a pool, newcomers are prefilled whole however many)."""
        if self._scheduler is None:
            pool = self.new_kv_pool()
            budget = self.config.batching.max_prefill_tokens if pool is not None else UNLIMITED
            self._scheduler = Scheduler(BatchPolicy(UNLIMITED, 0.0, UNLIMITED, "continuous", 0, budget,
                                                    paged=pool is not None), pool)
        return self._scheduler

    def reset(self) -> None:
        """Forget the engine's own scheduler, its pool and every prefix it cached (nothing may be running): the next
        add starts cold."""
        assert not self.num_live, "reset while rows are live"
        self._scheduler = None

    @property
    def live_request_ids(self) -> list[str]:
        return [r.request_id for r in [*self.scheduler.running, *self.scheduler.waiting]]

    @property
    def num_live(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def add(self, requests: Sequence[GenerationRequest]) -> StepOutput:
        """Newcomers join the engine's own scheduler; when no row is decoding, a step runs at once (their prefill, a
        prompt longer than the step's budget going on in the next steps); otherwise they join at the next step. A
        request that cannot be served (too long, bad parameters) finishes at once with an error."""
        rejected, added = [], []
        for request in requests:
            try:
                added.append(ScheduledRequest(self.tokenize(request)))
            except RequestError as exc:
                rejected.append(failed(request.request_id, str(exc)))
        self.scheduler.add(added)
        if not added or any(r.num_pending_tokens == 1 for r in self.scheduler.running):
            return StepOutput((), tuple(rejected))
        out = self.step()
        return replace(out, finished=(*out.finished, *rejected))

    def step(self) -> StepOutput:
        """One step of the engine's own scheduler: its plan, run, its rows updated and the finished ones gone."""
        scheduler = self.scheduler
        plan = scheduler.schedule(0.0)
        out = self.runner.execute(plan)
        scheduler.update(plan)
        scheduler.finish([c.request_id for c in out.finished])
        return out

    def cancel(self, request_ids: Sequence[str]) -> list[Completion]:
        """Take rows out for good (their client left); -> their completions, finish reason `cancelled`, holding the
        text released so far."""
        return self.runner.cancel(self.scheduler.finish(list(request_ids)))

    def generate(self, requests: Sequence[GenerationRequest]) -> BatchResult:
        """A closed batch: every request added at once, stepped until the last row finishes."""
        if self.num_live:
            raise RuntimeError("generate serves a closed batch; this engine has rows running")
        self.take_stats()  # NOTE: the batch's figures start here
        done = {c.request_id: c for c in self.add(requests).finished}
        while self.num_live:
            done.update((c.request_id, c) for c in self.step().finished)
        timings, memory = self.take_stats()
        return BatchResult(completions=tuple(done[r.request_id] for r in requests), timings=timings, memory=memory)

    def take_stats(self) -> tuple[BatchTimings, MemoryBreakdown]:
        """The timings and memory of the steps since the last call; the next step starts a new stretch."""
        return self.runner.take_stats()


def device_memory(device: torch.device) -> tuple[int, int, int] | None:
    """(free, total, this process's) bytes of a CUDA device, what torch's allocator caches unused counted free; None
    elsewhere (a CPU's pool is sized by the config alone)."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()  # NOTE: blocks the allocator caches are free to the pool, but mem_get_info counts them used
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total), int(torch.cuda.memory_reserved(device))


def cache_namespace(config: ServingConfig, dtype: torch.dtype) -> str:
    """What changes the keys and values a block holds besides its tokens: the model, its weights (precision,
    quantisation), the compute dtype, the cache precision, the decoder and (a window changes what every later token
    attends to) the eviction window. Prefix-cache hashes start from it."""
    awq = config.awq.model_dump_json() if config.awq is not None else ""
    window = kv_window(config)
    return "|".join((config.model, config.weights, awq, str(dtype), config.kv_cache_dtype, config.decoder,
                     config.linear_kernel, config.paged_attention, config.lm_head_weights,
                     str(config.kv_cache.block_size),
                     *((f"window {window[0]}+{window[1]}",) if window else ())))


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
    if (reason := config_reason(config, device)) is not None:
        raise PagedAttentionError(f"{config.name}: paged_attention {config.paged_attention!r} cannot serve here: {reason}")
    if config.decoder != "auto" or config.linear_kernel == "auto":
        return
    if config.weights == "awq-int4":
        from servelab.engine.awq import serving_dtype

        dtype = serving_dtype(device, config.awq.kernel if config.awq else "auto")  # around the int4 layers
    else:
        dtype = DTYPES[config.weights]
    try:
        check_linear_kernel(config.linear_kernel, device=device, dtype=dtype, cache_dir=settings.cache_dir)
    except LinearKernelError as exc:
        raise LinearKernelError(f"{config.name}: {exc}") from None
