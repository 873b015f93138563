"""A stored run's settings as the dashboard's tables show them: the cache's settings one by one."""

from __future__ import annotations

from servelab.config import ServingConfig
from servelab.store.run_settings import NO_EVICTION, describe_settings

CACHE_SETTINGS = ("cache precision", "cache eviction", "prefix caching", "cache block size", "cache capacity")


def stored(path: str, **kv_cache) -> dict:
    config = ServingConfig.from_yaml(path).model_dump(mode="json")
    config["kv_cache"] = {**config["kv_cache"], **kv_cache}
    return config


def test_every_run_shows_the_caches_settings_right_after_the_weights() -> None:
    shown = describe_settings(stored("configs/fp32-continuous-kvsmall.yaml"),
                              {"kv_pool_blocks": 22, "kv_block_size": 16, "kv_pool_bytes": 22 * 737_280})
    names = list(shown)
    assert names[names.index("AWQ") + 1:names.index("AWQ") + 6] == list(CACHE_SETTINGS)
    assert shown["cache precision"] == "auto (the compute dtype)"
    assert shown["cache eviction"] == NO_EVICTION
    assert shown["prefix caching"] == "on (default)" and shown["cache block size"] == "16 tokens"
    assert shown["cache capacity"] == "16 MiB (max_kv_cache_mib; max_batch_tokens 16384); pool 22 blocks x 16 tokens = 15.5 MiB"
    assert "max_kv_cache_mib" not in shown["batch policy"] and "policy=continuous" in shown["batch policy"]


def test_an_eviction_policy_shows_with_its_parameters_and_other_values_as_set() -> None:
    shown = describe_settings(stored("configs/fp32-kv-bf16.yaml", prefix_caching=False, eviction="window",
                                     sink_tokens=64, window_tokens=512))
    assert shown["cache eviction"] == "window: sink_tokens=64, window_tokens=512"
    assert shown["cache precision"] == "bf16" and shown["prefix caching"] == "off"
    assert shown["cache capacity"] == "16384 tokens (max_batch_tokens)"  # no pool recorded: said without one
    assert describe_settings(stored("configs/fp32.yaml", eviction="none"))["cache eviction"] == NO_EVICTION


def test_transformers_decoder_says_its_cache_is_not_paged() -> None:
    shown = describe_settings(stored("configs/fp32-transformers.yaml"))
    assert shown["prefix caching"].startswith("off") and shown["cache block size"].startswith("not paged")


def test_a_run_stored_before_the_cache_section_still_shows_every_setting() -> None:
    old = {"model": "bundled:smollm2-135m-instruct", "weights": "fp32", "batching": {"max_batch_size": 4}}
    shown = describe_settings(old)
    assert all(shown[name] for name in CACHE_SETTINGS) and shown["cache eviction"] == NO_EVICTION


def test_the_decoder_that_served_a_run_shows_beside_the_configs_choice() -> None:
    config = stored("configs/fp32.yaml")
    assert describe_settings(config, {"decoder": "servelab"})["decoder"] == "auto: servelab's decoder served it"
    assert describe_settings(config)["decoder"] == "auto", "a run stored before workers registered their decoder"
    served = describe_settings(config, {"decoder": "transformers", "decoder_reason": "architecture 'gpt2'; so no "
                                        "paged KV cache"})
    assert served["decoder"] == "auto: transformers' forward served it (architecture 'gpt2'; so no paged KV cache)"
    assert served["cache block size"].startswith("not paged") and served["prefix caching"].startswith("off")
