"""The engine's benches: their command lines refuse bad values by name, bench.int4_activations' agreement counts
leading tokens, and bench.prefetch runs its settings side by side and leaves the kernel's setting as it found it.
(What they measure needs the bundled model and minutes: they are run by hand, see docs/performance.md.)"""

from __future__ import annotations

import pytest

from bench import huge_pages
from bench.int4_activations import _report, main


@pytest.mark.parametrize(("argv", "message"), [
    (["--batch-sizes", "0"], "--batch-sizes: expected a comma list of positive integers, got '0'"),
    (["--batch-sizes", "1,x"], "--batch-sizes: expected a comma list of positive integers, got '1,x'"),
    (["--heads", "bf16"], "--heads: expected a comma list of auto and int8, got 'bf16'"),
    (["--rounds", "0"], "--rounds: invalid choice"),
    (["--skip", "both"], "--skip: invalid choice"),
])
def test_bad_arguments_are_refused_by_name(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_agreement_counts_prompts_identical_over_the_tokens_and_where_the_others_part(capsys) -> None:
    reference = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    tokens = [[1, 2, 3, 4], [1, 2, 0, 4], [0, 6, 7, 8], [9, 9, 9, 9]]
    _report("x", reference, tokens, 4)
    assert capsys.readouterr().out.strip() == "x: 2 of 4 identical over 4 tokens; the others part at tokens [0, 2]"


@pytest.mark.parametrize(("argv", "message"), [
    ([], "the following arguments are required: --config"),
    (["--config", "configs/absent.yaml"], "configs/absent.yaml: no such config file"),
    (["--config", "configs/fp32.yaml", "--batch-sizes", "-1"], "expected a comma list of positive integers"),
])
def test_huge_pages_refuses_bad_arguments_by_name(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        huge_pages.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("module", "argv", "message"), [
    ("bench.threads", ["--random-weights", "/nonexistent-folder"], "--random-weights /nonexistent-folder: no config.json"),
    ("bench.decode_step", ["--new-tokens", "1"], "--new-tokens must be at least 2"),
    ("bench.decode_step", ["--threads", "0"], "--threads: expected a comma list of positive integers, got '0'"),
    ("bench.prefill_step", ["--prompt-tokens", "1"], "--prompt-tokens must be at least 2"),
    ("bench.matmul", ["--rows", "0"], "--rows: expected a comma list of positive integers, got '0'"),
    ("bench.matmul", ["--dtype", "fp16"], "--dtype: invalid choice: 'fp16'"),
    ("bench.prefetch", ["--settings", "l3:16"], "'l3:16': a setting is l1:LINES or l2:LINES, LINES from 1 to 1024"),
    ("bench.prefetch", ["--settings", "l2:0"], "'l2:0': a setting is l1:LINES or l2:LINES"),
    ("bench.prefetch", ["--settings", "l2:16,l2:16"], "'l2:16,l2:16' names a setting twice"),
    ("bench.prefetch", ["--dtypes", "fp32,fp16"], "'fp32,fp16': dtypes from bf16, fp32"),
    ("bench.prefetch", ["--layers", "0"], "--layers: invalid choice"),
])
def test_thread_benches_refuse_bad_arguments_by_name(module: str, argv: list[str], message: str, monkeypatch,
                                                     capsys) -> None:
    import importlib
    import sys

    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(module).main()
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_the_prefetch_bench_compares_settings_and_leaves_the_default_as_it_was(capsys) -> None:
    from bench import prefetch
    from servelab.engine.kernels import best_isa, load_blocked_kernel

    if best_isa() is None:
        pytest.skip("servelab's kernel cannot run on this CPU")
    kernel = load_blocked_kernel(prefetch.REPO / ".cache").module
    default = kernel.weight_prefetch()
    prefetch.main(["--settings", "l2:16,l1:32", "--dtypes", "bf16", "--rows", "1", "--threads", "1", "--layers", "1",
                   "--rounds", "1"])
    out = capsys.readouterr().out
    assert f"default setting {default[0]}:{default[1]}" in out
    assert "NOTE: the weights are not twice the largest cache" in out  # one layer fits any cache
    [line] = [line for line in out.splitlines() if line.startswith("bf16, 1 row(s), 1 thread(s): ")]
    assert "l2:16 " in line and "(x1.00)" in line and "l1:32 " in line
    assert kernel.weight_prefetch() == default
