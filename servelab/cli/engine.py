"""The engine in this process, no queue: `generate` serves prompts as one batch, `check-model` says whether servelab's
fast path serves a model folder, `quantize` makes int4 weights.

Knows these commands' options and how their results are printed. Does not know the queue, the store or
the lab; the engine and torch are imported inside the commands, so `servelab --help` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

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

    gptqmodel's own output (hundreds of lines) goes to <state>/logs/quantize-<config>.log; the terminal shows one
    line that follows the layers. stdout is the result line only.
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
