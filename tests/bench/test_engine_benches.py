"""bench.int4_activations and bench.huge_pages: their command lines refuse bad values by name, and agreement counts
leading tokens. (What they measure needs the bundled model and minutes: they are run by hand, see
docs/performance.md.)"""

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
