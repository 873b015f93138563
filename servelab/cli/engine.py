"""The engine in this process, no queue: `generate` serves prompts as one batch, `check-model` says whether servelab's
fast path serves a model folder, `check-gpu` checks a CUDA host (or, `--dry-run`, its paths on this CPU), `quantize`
makes int4 weights.

Knows these commands' options and how their results are printed. Does not know the queue, the store or
the lab; the engine and torch are imported inside the commands, so `servelab --help` stays fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, get_args

import typer

from servelab.cli.options import ConfigOption, ThreadsOption, fail, load_config, parse_ints, progress, settings
from servelab.config import ServingConfig


def generate(
    prompts: Annotated[list[str], typer.Argument(help="one or more prompts, served as one batch")],
    config: ConfigOption = Path("configs/fp32.yaml"),
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate per prompt")] = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string; repeat for more")] = None,
    chat: Annotated[bool, typer.Option(help="wrap each prompt as a user message in the chat template")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON record")] = False,
) -> None:
    """Run the engine in-process (no queue) and print each completion with its timings."""
    serving = load_config(config)

    from servelab.engine.engine import Engine
    from servelab.engine.loader import ModelLoadError
    from servelab.request import ChatMessage, GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop or ()))
    requests = [
        GenerationRequest(f"p{i}", messages=(ChatMessage("user", p),), params=params) if chat
        else GenerationRequest(f"p{i}", prompt=p, params=params)
        for i, p in enumerate(prompts)
    ]
    try:
        engine = Engine.from_config(serving, settings())
    except ModelLoadError as exc:
        fail(str(exc))
    result = engine.generate(requests)
    if as_json:
        typer.echo(json.dumps(_result_record(serving, engine, result), indent=2))
    else:
        _print_result(prompts, result)
    if any(c.error for c in result.completions):
        raise typer.Exit(code=1)


def _result_record(serving: ServingConfig, engine, result) -> dict:
    return {
        "config": serving.model_dump(mode="json"),
        "config_hash": serving.config_hash,
        "device": str(engine.device),
        "kernel": engine.kernel,
        "completions": [
            {**{k: v for k, v in c.__dict__.items() if k not in ("token_ids", "token_times_ms")},
             "finish_reason": c.finish_reason.value, "num_generated_tokens": c.num_generated_tokens,
             "tpot_ms": c.tpot_ms, "token_ids": list(c.token_ids), "token_times_ms": list(c.token_times_ms)}
            for c in result.completions
        ],
        "timings": {**result.timings.__dict__, "total_ms": result.timings.total_ms},
        "memory": result.memory.as_dict(),
    }


def _print_result(prompts: list[str], result) -> None:
    for prompt, c in zip(prompts, result.completions):
        typer.secho(f"> {prompt}", bold=True)
        if c.error:
            typer.secho(f"  error: {c.error}", fg=typer.colors.RED)
            continue
        typer.echo(f"  {c.text!r}")
        tpot = f"{c.tpot_ms:.1f}" if c.tpot_ms is not None else "-"
        typer.echo(f"  [{c.finish_reason.value}] prompt {c.num_prompt_tokens} tok, generated {c.num_generated_tokens} tok, "
                   f"TTFT {c.ttft_ms:.1f} ms, TPOT {tpot} ms, E2E {c.e2e_ms:.1f} ms")
    t, m = result.timings, result.memory
    typer.echo(f"batch: prefill {t.prefill_ms:.1f} ms, decode {t.decode_ms:.1f} ms over {len(t.num_rows_per_step)} steps; "
               f"weights {m.weight_bytes / 1e6:.1f} MB, KV cache {m.kv_cache_bytes / 1e6:.2f} MB "
               f"(allocated {m.kv_cache_allocated_bytes / 1e6:.2f} MB), peak working {m.peak_working_bytes / 1e6:.1f} MB")


def check_model(
    model: Annotated[str, typer.Argument(help="a local model folder, or a bundled name "
                                              "(bundled:smollm2-135m-instruct)")],
    weights: Annotated[str, typer.Option(help="fp32 or bf16")] = "fp32",
    threads: ThreadsOption = None,
    tokens: Annotated[int, typer.Option(min=1, max=64, help="greedy tokens compared with transformers' forward")] = 8,
    tolerance: Annotated[float | None, typer.Option(min=0.0, help="the largest log-probability difference (nats) "
                                                    "that passes (default: 1e-3 for fp32, 0.3 for bf16)")] = None,
    batch_sizes: Annotated[str, typer.Option(help="comma-separated batch sizes whose decode tok/s is measured")]
    = "1,16",
    prompt_tokens: Annotated[int, typer.Option(min=1, max=512, help="prompt tokens per row when timing")] = 32,
    new_tokens: Annotated[int, typer.Option(min=2, max=256, help="new tokens per row when timing")] = 16,
) -> None:
    """Whether servelab's fast path serves a model, in a minute: the decoder and kernels that serve it (and why, and
    what it costs, where transformers' forward does), a few greedy tokens and their log-probabilities against
    transformers' own forward on the same weights, and decode tok/s at a few batch sizes.

    Exit status 0 when the tokens match, 1 when they differ beyond the tolerance, 2 when the model does not load.
    """
    if weights not in ("fp32", "bf16"):
        fail(f"--weights {weights}: choose fp32 or bf16")
    sizes = parse_ints(batch_sizes, "--batch-sizes")

    from servelab.engine.loader import ModelLoadError
    from servelab.analysis.token_match import TOLERANCES
    from servelab.lab.check_model import check_config, check_model as run_check, load_engine

    max_new_tokens = max(tokens, new_tokens)
    try:
        config = check_config(model, weights=weights, num_threads=threads, max_new_tokens=max_new_tokens,
                              max_context_tokens=max(prompt_tokens, 64) + max_new_tokens)
        progress(f"loading {model} ({weights})")
        engine = load_engine(config, settings())
    except (ModelLoadError, ValueError) as exc:
        fail(str(exc))
    progress(f"comparing {tokens} greedy tokens with transformers' forward, then timing batches of {batch_sizes}")
    check = run_check(engine, num_tokens=tokens, tolerance=TOLERANCES[weights] if tolerance is None else tolerance,
                      batch_sizes=sizes, num_prompt_tokens=prompt_tokens, num_new_tokens=new_tokens)
    _print_check(check, engine.tokenizer)
    if not check.tokens.passed:
        raise typer.Exit(code=1)


def _print_check(check, tokenizer) -> None:
    text = lambda token_id: repr(tokenizer.decode([token_id]))  # noqa: E731
    typer.echo(f"model    {check.source} ({check.architecture}, {check.weights} weights): {check.folder}")
    if check.decoder_reason is None:
        typer.echo("decoder  servelab's, with its paged KV cache (prefix caching, int8 KV, window eviction, chunked "
                   "prefill) and int8 output layer")
    else:
        typer.secho(f"decoder  transformers' forward, not servelab's: {check.decoder_reason}", fg=typer.colors.YELLOW)
    typer.echo(f"kernels  {check.kernel}")
    t = check.tokens
    diff = f"largest log-probability difference {t.max_logprob_diff:.1e} (tolerance {t.tolerance:.0e})"
    if t.first_difference is None:
        typer.echo(f"tokens   {len(t.token_ids)} greedy tokens equal to transformers' forward (no cache) on the same "
                   f"weights; {diff}")
    else:
        i = t.first_difference
        tie = (f"a near tie: transformers ranks the two {t.gap_at_difference:.1e} apart" if t.is_near_tie else
               f"not a tie: transformers ranks its token {t.gap_at_difference:.2f} above servelab's")
        typer.echo(f"tokens   first difference at position {i} of {len(t.token_ids)}: servelab {t.token_ids[i]} "
                   f"{text(t.token_ids[i])}, transformers {t.reference_ids[i]} {text(t.reference_ids[i])} ({tie}); "
                   f"{diff}")
    speeds = ", ".join(f"batch {s.batch_size}: {s.decode_tokens_per_s:.1f}" for s in check.speeds)
    typer.echo(f"decode   tok/s {speeds} ({check.num_prompt_tokens} prompt + {check.num_new_tokens} new tokens, one "
               f"batch each, {check.num_threads} thread(s); `servelab bench engine` measures it properly)")
    if not t.passed:
        what = "tokens" if t.first_difference is not None and not t.is_near_tie else "log-probabilities"
        typer.secho(f"verdict  FAIL: servelab's {what} differ from transformers' beyond the tolerance",
                    fg=typer.colors.RED)
    elif check.decoder_reason is None:
        typer.echo("verdict  servelab's fast path serves this model, and its tokens match transformers'")
    else:
        typer.echo("verdict  served, and its tokens match transformers', but by transformers' forward: slower, and "
                   "without the features above")


def quantize(config: ConfigOption) -> None:
    """Quantise the config's base model to int4 (AWQ, or RTN with awq.method: rtn) once; later calls reuse it.

    gptqmodel's own output (hundreds of lines) goes to <state>/logs/quantize-<config>.log and its per-run tables to
    <state>/logs/gptqmodel/; the terminal shows one line that follows the layers. stdout is the result line only.
    """
    serving = load_config(config)

    from servelab.cli.progress import LayerTicker, output_to_log

    if serving.weights != "awq-int4":
        fail(f"{config}: weights is {serving.weights!r}; quantize needs weights: awq-int4")
    log_path = Path(settings().state_dir) / "logs" / f"quantize-{serving.name}.log"
    record, error = None, None
    with output_to_log(log_path) as terminal, \
            LayerTicker(terminal, label=f"quantising {serving.name}", log_path=log_path) as ticker:
        # NOTE: imported inside: importing the engine and gptqmodel prints warnings of its own
        from servelab.engine.awq import quantize as quantize_model
        from servelab.engine.loader import ModelLoadError

        try:
            record = quantize_model(serving, settings(), progress=ticker.say)
        except (ModelLoadError, ValueError) as exc:
            error = str(exc)
    if record is None:
        fail(f"{error} (gptqmodel's output: {log_path})")
    verb = "reused" if record.is_reused else f"made in {record.quantize_s:.0f} s"
    calibration = (f"{record.num_calibration_samples} x {record.calibration_seq_len} tokens of "
                   f"{record.calibration_set}" if record.calibration_set else "no calibration (round to nearest)")
    if not record.is_reused:
        progress(f"gptqmodel's output: {log_path}")
    typer.echo(f"{record.method} int{record.bits} g{record.group_size} checkpoint {verb}: {record.checkpoint} "
               f"({calibration})")


def check_gpu(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="tiny shapes in fp32 on this CPU with torch's kernels "
                                                            "(the GPU's code paths): what CI runs")] = False,
    shapes: Annotated[str, typer.Option(help="comma-separated model shapes with random weights: 1b (Llama-3.2-1B), "
                                             "8b (Llama-3.1-8B)")] = "1b,8b",
    dtype: Annotated[str | None, typer.Option(help="bf16, fp16 or fp32 (default: bf16 on CUDA, fp32 in the dry "
                                                   "run)")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="a folder with tokenizer.json (default: the bundled model's; "
                                                       "`make gpu-wheels` copies it into its folder)")] = None,
    awq_kernel: Annotated[str | None, typer.Option(help="the int4 kernel (awq.kernel): default auto on CUDA "
                                                        "(gptqmodel's pick where installed, else ATen's int4 "
                                                        "matmul), aten on the CPU")] = None,
    awq: Annotated[bool, typer.Option(help="check AWQ int4")] = True,
    served: Annotated[bool, typer.Option(help="run the served path (a worker, requests through the queue)")] = True,
    speed: Annotated[bool, typer.Option(help="time decode and prefill, measure the bandwidth, fill the KV pool "
                                             "(--no-speed: tokens only)")] = True,
    paged_attention: Annotated[str, typer.Option(help="how the engines read the KV pool: auto (on CUDA the faster of "
                                                       "flex and torch, timed at load), flex or torch (each path "
                                                       "checked on its own), servelab (CPU only)")] = "auto",
    as_json: Annotated[Path | None, typer.Option("--json", help="also write every figure to this file")] = None,
) -> None:
    """Check a CUDA host in minutes, with no weights to carry: Llama-3.2-1B and Llama-3.1-8B shapes with random
    weights and the bundled tokenizer. Greedy tokens against naive decoding (rows joining and leaving, a cached prefix,
    chunked prefill, AWQ int4), decode and prefill tok/s against transformers' generate and the measured memory
    bandwidth, the KV pool sized from the GPU's memory and the largest batch held, and a worker serving requests
    through the queue.

    Exit status 0 when every token matches (a near tie, within the stated tolerance, is not a wrong token), 1 on a
    wrong token or a part that did not do what it says, 2 when the check cannot run (no CUDA without --dry-run, a
    missing package or tokenizer, a part that failed to start).
    """
    from servelab.lab.check_gpu import SHAPES, TOLERANCES

    names = [s.strip() for s in shapes.split(",") if s.strip()]
    if unknown := [s for s in names if s not in SHAPES or s == "tiny"]:
        fail(f"--shapes {','.join(unknown)}: choose from 1b, 8b")
    dtype = dtype or ("fp32" if dry_run else "bf16")
    if dtype not in ("bf16", "fp16", "fp32"):
        fail(f"--dtype {dtype}: choose bf16, fp16 or fp32")
    readers = get_args(ServingConfig.model_fields["paged_attention"].annotation)  # the config's own choices
    if paged_attention not in readers:
        fail(f"--paged-attention {paged_attention}: choose {', '.join(readers[:-1])} or {readers[-1]}")

    from servelab.lab.check_gpu import CheckCannotRun, run_check

    started = time.perf_counter()

    def timed(message: str) -> None:  # NOTE: each part's start, so a run cut short still says where its minutes went
        progress(f"{time.perf_counter() - started:6.1f} s  {message}")

    try:
        check = run_check(shapes=names, dtype_name=dtype, dry_run=dry_run, tokenizer_path=tokenizer,
                          settings=settings(), awq_kernel=awq_kernel, awq=awq, served=served, speed=speed,
                          paged_attention=paged_attention, progress=timed)
    except CheckCannotRun as exc:
        fail(str(exc))
    _print_gpu_check(check, TOLERANCES)
    if as_json is not None:
        as_json.write_text(json.dumps(check.record(), indent=2) + "\n")
        progress(f"figures written to {as_json}")
    raise typer.Exit(code=check.exit_code)


def _print_gpu_check(check, tolerances: dict[str, float]) -> None:
    what = "dry run: tiny shapes on the CPU, torch's kernels" if check.dry_run else "CUDA"
    typer.echo(f"device   {check.device_name} ({what}); torch {check.torch_version}, transformers "
               f"{check.transformers_version}")
    for s in check.shapes:
        size = f"{s.num_parameters / 1e9:.2f} B" if s.num_parameters >= 1e8 else f"{s.num_parameters / 1e6:.1f} M"
        typer.echo(f"\n{s.shape}: {size} parameters, {s.dtype}, random weights; {s.kernel}; "
                   f"weights held {s.weight_bytes / 2**30:.2f} GiB, read per decode step {s.step_weight_bytes / 2**30:.2f} GiB")
        typer.echo(f"  attention     {s.paged_attention}")
        for part in s.parts:
            _print_part(part, tolerances[s.dtype])
        if not s.decode:
            typer.echo("  speed         not measured (--no-speed)")
            continue
        speeds = "; ".join(f"batch {d.batch_size}: {d.servelab_tok_s:.1f} (transformers {d.transformers_tok_s:.1f}, "
                           f"x{d.servelab_tok_s / d.transformers_tok_s:.2f})" for d in s.decode)
        typer.echo(f"  decode tok/s  {speeds} (one timed batch each, after a warm-up)")
        typer.echo(f"  prefill       {s.prefill_tokens} tokens: {s.prefill_servelab_tok_s:.0f} tok/s (transformers' "
                   f"forward {s.prefill_transformers_tok_s:.0f}, x{s.prefill_servelab_tok_s / s.prefill_transformers_tok_s:.2f})")
        typer.echo(f"  bandwidth     {s.bandwidth_gbs:.1f} GB/s measured (a copy, bytes read + written); decode at "
                   f"batch 1 reads the step's weights at {s.decode1_roof_fraction:.0%} of it")
        typer.echo(f"  KV pool       {s.kv_pool_blocks} blocks x {s.kv_block_size} tokens = "
                   f"{s.kv_pool_blocks * s.kv_block_size} tokens, {s.kv_pool_bytes / 2**30:.2f} GiB, sized from "
                   f"{s.kv_pool_sized_from}")
        typer.echo(f"  largest batch {s.largest_batch} rows in one step ({s.capacity_rows} rows asked at once held "
                   f"{s.capacity_peak_tokens} KV tokens at the peak, {s.capacity_preempted} preempted)")
    if check.awq is not None:
        typer.echo("")
        _print_part(check.awq, tolerances["int4"])
    else:
        typer.secho(f"\nAWQ int4  not checked: {check.awq_reason}", fg=typer.colors.YELLOW)
    served = check.served
    if served is not None and served.ran:
        mark = "" if served.passed else "  FAIL"
        typer.echo(f"\nserved    {served.num_answered_once} of {served.num_requests} requests answered exactly once "
                   f"through the queue ({served.reason}) in {served.seconds:.1f} s{mark}")
    elif served is not None:
        typer.secho(f"\nserved    not run: {served.reason}", fg=typer.colors.YELLOW)
    for problem in check.problems:
        typer.secho(f"could not run: {problem}", fg=typer.colors.RED, err=True)
    parts = {s.shape: s.seconds for s in check.shapes}
    if served is not None and served.ran:
        parts["served path"] = served.seconds
    parts["AWQ int4 and the rest"] = check.seconds - sum(parts.values())
    typer.echo(f"\ntime      {check.seconds:.1f} s in all: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()))
    verdict = {0: "every token equal to naive decoding (near ties within the tolerance named)",
               1: "FAIL: a wrong token, or a part that did not do what it says (above)",
               2: "INCOMPLETE: a part could not run (above)"}[check.exit_code]
    typer.echo(f"\nverdict   {verdict}")


def _print_part(part, tolerance: float) -> None:
    counts = {v: sum(r.verdict == v for r in part.rows) for v in ("equal", "near tie", "WRONG")}
    tokens = sum(len(r.tokens.token_ids) for r in part.rows)
    largest = max((r.tokens.max_logprob_diff for r in part.rows), default=0.0)
    status = "ok" if part.passed else "FAIL"
    typer.echo(f"  {part.name:<16} {status}: {counts['equal']} of {len(part.rows)} rows equal to naive decoding over "
               f"{tokens} tokens, {counts['near tie']} parted at a near tie, {counts['WRONG']} wrong; largest "
               f"log-probability difference {largest:.1e} (tolerance {tolerance:g} nats); {part.detail}")
    if part.failure:
        typer.secho(f"    FAIL: {part.failure}", fg=typer.colors.RED)
    for r in part.rows:
        t = r.tokens
        if r.verdict != "equal":
            where = (f"at token {t.first_difference}: servelab {t.token_ids[t.first_difference]}, naive "
                     f"{t.reference_ids[t.first_difference]}, ranked {t.gap_at_difference:.2e} apart"
                     if t.first_difference is not None else f"log-probabilities {t.max_logprob_diff:.2e} apart")
            typer.echo(f"    {r.request_id} ({r.num_prompt_tokens} prompt tokens): {r.verdict} {where}")
