"""`bench kv-dtype`'s measurements on the tiny model: bytes per token read from the pool's tensors, decode timed over
rows holding a copied context, greedy agreement against the first precision; and the command's checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from servelab.cli import app
from servelab.engine.engine import Engine
from servelab.lab.kv_bench import agreement, format_kv_dtype_table, run_kv_dtype_bench
from servelab.settings import Settings
from tests.engine.conftest import make_config


def test_agreement_counts_positions_the_prefix_before_a_difference_and_whole_rows() -> None:
    assert agreement([(1, 2, 3, 4), (5, 6)], [(1, 2, 9, 4), (5, 6)]) == (5 / 6, 4 / 6, 1 / 2)


def test_the_bench_measures_each_precision_on_its_own_pool(tiny_folder: Path, settings: Settings) -> None:
    engines = {d: Engine.from_config(make_config(str(tiny_folder), kv_cache_dtype=d), settings)
               for d in ("fp32", "int8")}
    results = run_kv_dtype_bench(engines, context_ids=list(range(100, 140)), batch_sizes=[2, 3], num_steps=4,
                                 prompts=["name a colour", "count to three"], new_tokens=4, num_rounds=1)
    fp32, int8 = results
    head_dim = engines["int8"].loaded.shape.head_dim
    assert fp32.storage_bytes_per_token == 2 * 2 * 2 * head_dim * 4  # 2 layers x 2 kv heads x keys and values
    assert int8.storage_bytes_per_token / fp32.storage_bytes_per_token == (head_dim + 4) / (4 * head_dim)
    assert all(len(r.tok_s[b]) == 1 and r.tok_s[b][0] > 0 for r in results for b in (2, 3))
    assert fp32.identical_tokens == fp32.identical_rows == 1.0 and 0 <= int8.identical_tokens <= 1
    assert format_kv_dtype_table(results, [2, 3]).count("\n") == 2


def test_the_command_refuses_fewer_than_two_precisions_by_name() -> None:
    result = CliRunner().invoke(app, ["bench", "kv-dtype", "--dtypes", "int8"])
    assert result.exit_code != 0 and "--dtypes 'int8': give two or more distinct values" in result.output
    result = CliRunner().invoke(app, ["bench", "kv-dtype", "--dtypes", "fp32,int4"])
    assert result.exit_code != 0 and "give two or more distinct values" in result.output
