"""A stored run's settings as the dashboard's tables show them: one line of text per setting a review compares.

Reads the config a run stored (`ServingConfig.model_dump`) and the hardware its worker registered (the decoder
that served it, with why where it was transformers' forward, and the paged pool it built); the cache's settings
(precision, eviction, prefix caching, block size, capacity) are described from the whole kv_cache section, so a
field added there shows without a change here. Pure: dicts in, text out.
"""

from __future__ import annotations

from typing import Any

from servelab.config import ServingConfig

# The settings a review compares, in the order the design lists them; each is a path into the stored config.
# NOTE: the cache's settings (precision, eviction, prefix caching, block size, capacity) are described by
# describe_settings from the whole kv_cache section, so a field added there shows without a change here.
SETTING_PATHS = {
    "model": ("model",), "weight precision": ("weights",), "output layer": ("lm_head_weights",), "AWQ": ("awq",),
    "decoding limits": ("decoding",), "decoder": ("decoder",), "matmul kernel": ("linear_kernel",),
    "device": ("device",), "threads": ("num_threads",),
}
CAPACITY_FIELDS = ("max_kv_cache_mib", "max_batch_tokens")  # batching's fields that size the cache's pool
EVICTION_FIELD = "eviction"
NO_EVICTION = "none (a row keeps its whole cache until it finishes)"
# NOTE: a run stored before a field existed was served with its default: shown as that
_DEFAULTS = ServingConfig(name="defaults").model_dump(mode="json")


def describe_settings(config: dict[str, Any], hardware: dict[str, Any] | None = None) -> dict[str, str]:
    """Every setting a review compares, as text: the cache's precision, eviction (named even when there is none),
    prefix caching, block size and capacity (with the pool the worker built, from its registered hardware), and the
    decoder that served the run (transformers' forward named with its reason and cost, where the worker said so)."""
    hardware = hardware or {}
    batching = {**_DEFAULTS["batching"], **(config.get("batching") or {})}
    kv = {**_DEFAULTS["kv_cache"], **(config.get("kv_cache") or {})}
    transformers = config.get("decoder") == "transformers" or hardware.get("decoder") == "transformers"
    shown = {name: _setting_text(_get(config, path)) for name, path in SETTING_PATHS.items()}
    shown["decoder"] = _decoder(shown["decoder"], hardware)
    cache = {
        "cache precision": _cache_precision(config.get("kv_cache_dtype")),
        "cache eviction": _eviction(kv),
        "prefix caching": _prefix_caching(kv.get("prefix_caching"), transformers=transformers),
        "cache block size": "not paged (transformers' decoder)" if transformers else f"{kv['block_size']} tokens",
        "cache capacity": _capacity(batching, hardware),
        "batch policy": _setting_text({k: v for k, v in batching.items() if k not in CAPACITY_FIELDS}),
    }
    # NOTE: the cache's settings right after the weights', before the rest
    shown = {**dict(list(shown.items())[:4]), **cache, **dict(list(shown.items())[4:])}
    return shown


def _decoder(chosen: str, hardware: dict[str, Any]) -> str:
    """The config's choice and, where the worker registered it, the decoder that served (a run stored before workers
    registered it shows the choice alone)."""
    served = hardware.get("decoder")
    if served == "transformers":
        reason = hardware.get("decoder_reason") or "the reason was not recorded"
        return f"{chosen}: transformers' forward served it ({reason})"
    return f"{chosen}: servelab's decoder served it" if served == "servelab" else chosen


def _cache_precision(dtype: str | None) -> str:
    return "auto (the compute dtype)" if dtype in (None, "auto") else str(dtype)


def _eviction(kv: dict[str, Any]) -> str:
    """`none` with what it means, or the policy and its parameters (every other kv_cache field past the block size
    and prefix caching: sink_tokens, window_tokens, and whatever a later policy adds)."""
    policy = kv.get(EVICTION_FIELD) or "none"
    if policy == "none":
        return NO_EVICTION
    params = {k: v for k, v in kv.items() if k not in (EVICTION_FIELD, "block_size", "prefix_caching")}
    return f"{policy}: {_setting_text(params)}" if params else str(policy)


def _prefix_caching(value: bool | None, *, transformers: bool) -> str:
    if transformers:
        return "off (transformers' decoder keeps its own cache)"
    return "on (default)" if value is None else ("on" if value else "off")


def _capacity(batching: dict[str, Any], hardware: dict[str, Any]) -> str:
    tokens, mib = batching.get("max_batch_tokens"), batching.get("max_kv_cache_mib")
    text = f"{tokens} tokens (max_batch_tokens)" if mib is None else \
        f"{mib} MiB (max_kv_cache_mib; max_batch_tokens {tokens})"
    blocks, size, pool_bytes = (hardware.get(k) for k in ("kv_pool_blocks", "kv_block_size", "kv_pool_bytes"))
    if blocks and size and pool_bytes:
        text += f"; pool {blocks} blocks x {size} tokens = {pool_bytes / 2**20:.1f} MiB"
    return text


def _get(data: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _setting_text(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return "-" if value is None else str(value)
