"""`servelab check-model` through the real CLI: the decoder that serves a tiny model, its tokens against
transformers' forward, and a model that cannot be checked named with why (the verdict's arithmetic:
tests/analysis/test_token_match.py)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from servelab.cli import app

runner = CliRunner()
QUICK = ["--threads", "1", "--tokens", "4", "--batch-sizes", "1,2", "--prompt-tokens", "8", "--new-tokens", "3"]


def test_a_tiny_llama_is_served_by_servelabs_decoder_with_transformers_tokens(tiny_folder: Path) -> None:
    result = runner.invoke(app, ["check-model", str(tiny_folder), *QUICK])
    assert result.exit_code == 0, result.output
    assert "decoder  servelab's" in result.stdout and "kernels  servelab decoder, dense float32" in result.stdout
    assert "4 greedy tokens equal to transformers' forward" in result.stdout
    assert "batch 1: " in result.stdout and "batch 2: " in result.stdout
    assert "verdict  servelab's fast path serves this model" in result.stdout


def test_an_architecture_servelab_does_not_cover_names_transformers_forward_and_why(tiny_gpt2_folder: Path) -> None:
    result = runner.invoke(app, ["check-model", str(tiny_gpt2_folder), *QUICK])
    assert result.exit_code == 0, result.output
    decoder = next(line for line in result.stdout.splitlines() if line.startswith("decoder"))
    assert "transformers' forward, not servelab's" in decoder and "architecture 'gpt2'" in decoder, decoder
    assert "no paged KV cache" in decoder and "no prefix caching" in decoder and "no int8 KV cache" in decoder
    assert "kernels  transformers decoder" in result.stdout
    assert "4 greedy tokens equal to transformers' forward" in result.stdout


def test_a_missing_folder_or_a_model_that_is_no_causal_lm_exits_2_naming_it(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["check-model", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "nope: no such folder" in missing.stderr, missing.output

    from transformers import DistilBertConfig

    DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(tmp_path / "encoder")
    encoder = runner.invoke(app, ["check-model", str(tmp_path / "encoder")])
    assert encoder.exit_code == 2 and "a 'distilbert' model" in encoder.stderr, encoder.output
    assert "not a causal LM" in encoder.stderr, encoder.output

    (tmp_path / "empty").mkdir()
    empty = runner.invoke(app, ["check-model", str(tmp_path / "empty")])
    assert empty.exit_code == 2 and "no config.json" in empty.stderr, empty.output


def test_bad_weights_are_refused_before_anything_loads(tiny_folder: Path) -> None:
    result = runner.invoke(app, ["check-model", str(tiny_folder), "--weights", "int2"])
    assert result.exit_code == 2 and "choose fp32 or bf16" in result.stderr
