"""ServingConfig: frozen, hashed, loaded from YAML; a bad file names the field, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from servelab.config import ConfigError, ServingConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path: Path) -> None:
    config = ServingConfig.from_yaml(path)
    assert config.name == path.stem


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("weights: int3\n", ["weights: got 'int3'", "'fp32', 'bf16', 'fp16' or 'awq-int4'"]),
        ("batching:\n  max_batch_size: 0\n", ["batching.max_batch_size: got 0", "greater than or equal to 1"]),
        ("device: tpu\n", ["device: got 'tpu'", "'cuda:N'"]),
        ("model: 'bundled:gpt5'\n", ["model: got 'bundled:gpt5'", "bundled:smollm2-135m-instruct"]),
        ("decoding:\n  max_new_tokens: 4096\n  max_context_tokens: 2048\n", ["must be below max_context_tokens"]),
        ("batch_size: 4\n", ["batch_size: unknown field"]),
        ("awq:\n  group_size: 64\n", ["needs weights: awq-int4"]),
        ("awq:\n  group_size: 100\nweights: awq-int4\n", ["awq.group_size: got 100", "32, 64 or 128"]),
        ("awq:\n  activations: fp16\nweights: awq-int4\n", ["awq.activations: got 'fp16'", "'int8' or 'float'"]),
        ("- a list\n", ["expected a mapping"]),
        ("weights: [unclosed\n", ["not valid YAML"]),
    ],
)
def test_bad_config_names_field_value_and_allowed(tmp_path: Path, text: str, expected: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        ServingConfig.from_yaml(write(tmp_path, text))
    for fragment in expected:
        assert fragment in str(caught.value)
    assert str(tmp_path / "c.yaml") in str(caught.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        ServingConfig.from_yaml(tmp_path / "absent.yaml")


def test_config_is_frozen_and_hash_ignores_the_name(tmp_path: Path) -> None:
    a = ServingConfig.from_dict({"name": "a", "weights": "bf16"})
    b = ServingConfig.from_dict({"name": "b", "weights": "bf16"})
    c = ServingConfig.from_dict({"name": "a", "weights": "fp32"})
    assert a.config_hash == b.config_hash != c.config_hash
    with pytest.raises(pydantic.ValidationError, match="Instance is frozen") as raised:
        a.weights = "fp32"  # type: ignore[misc]
    assert [(e["type"], e["loc"]) for e in raised.value.errors()] == [("frozen_instance", ("weights",))]
    assert a.weights == "bf16"


def test_awq_weights_get_default_awq_settings() -> None:
    config = ServingConfig.from_dict({"name": "q", "weights": "awq-int4"})
    assert config.awq is not None and config.awq.group_size == 64


def test_prefix_caching_asked_of_transformers_decoder_is_refused_by_name_and_a_dumped_config_reloads() -> None:
    with pytest.raises(ConfigError, match="kv_cache.prefix_caching needs servelab's decoder"):
        ServingConfig.from_dict({"name": "t", "decoder": "transformers", "kv_cache": {"prefix_caching": True}})
    config = ServingConfig.from_dict({"name": "t", "decoder": "transformers"})
    assert not config.uses_prefix_caching  # unset: on only where servelab's paged cache serves
    assert ServingConfig.from_dict(config.model_dump(mode="json")) == config  # a worker's dumped config reloads
    assert ServingConfig.from_dict({"name": "t"}).uses_prefix_caching
    assert not ServingConfig.from_dict({"name": "t", "kv_cache": {"prefix_caching": False}}).uses_prefix_caching


def test_window_eviction_is_checked_by_name_and_rounds_to_blocks() -> None:
    with pytest.raises(ConfigError, match="kv_cache.eviction 'window' needs servelab's decoder"):
        ServingConfig.from_dict({"name": "t", "decoder": "transformers", "kv_cache": {"eviction": "window"}})
    with pytest.raises(ConfigError, match=r"kv_cache.window_tokens \(8\) must be at least block_size \(16\)"):
        ServingConfig.from_dict({"name": "t", "kv_cache": {"eviction": "window", "window_tokens": 8}})
    with pytest.raises(ConfigError, match=r"kv_cache.sink_tokens \(4\) must be 0 or at least block_size \(16\)"):
        ServingConfig.from_dict({"name": "t", "kv_cache": {"eviction": "window", "sink_tokens": 4}})
    with pytest.raises(ConfigError, match="kv_cache.eviction: got 'lru'"):
        ServingConfig.from_dict({"name": "t", "kv_cache": {"eviction": "lru"}})
    kv = ServingConfig.from_dict({"name": "t", "kv_cache": {"eviction": "window", "sink_tokens": 20,
                                                           "window_tokens": 500}}).kv_cache
    assert (kv.sink_blocks, kv.window_blocks) == (2, 32)  # rounded up to whole blocks of 16
    assert ServingConfig.from_dict({"name": "t", "kv_cache": {"eviction": "window", "sink_tokens": 0}}).kv_cache.sink_blocks == 0
    # eviction none: the window's sizes change nothing, so they leave the hash as it was
    plain = ServingConfig.from_dict({"name": "t"})
    assert plain.config_hash == ServingConfig.from_dict({"name": "t", "kv_cache": {"window_tokens": 64}}).config_hash
    assert plain.config_hash != ServingConfig.from_dict({"name": "t", "kv_cache": {"eviction": "window"}}).config_hash
    assert "eviction" not in plain.canonical_json()


def test_an_int8_kv_cache_asked_of_transformers_decoder_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype 'int8' needs servelab's decoder"):
        ServingConfig.from_dict({"name": "t", "decoder": "transformers", "kv_cache_dtype": "int8"})
    assert ServingConfig.from_dict({"name": "t", "kv_cache_dtype": "int8"}).kv_cache_dtype == "int8"
    with pytest.raises(ConfigError, match="kv_cache_dtype: got 'int4'"):
        ServingConfig.from_dict({"name": "t", "kv_cache_dtype": "int4"})
